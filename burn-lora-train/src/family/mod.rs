//! The model-family seam: what the trainer asks of a family of models ([`Family`]), and the
//! families `model.arch` selects ([`Arch`]).
//!
//! The trainer owns everything that is the same for every family: the run folder, the dataset
//! and its caches, the optimizer, checkpoints and resume, the logs. A family owns what differs:
//! its model sources, the encoders that turn an image and a caption into the tensors the
//! denoiser reads (run once, before training, and dropped), the denoiser itself and how its
//! frozen weights reach the device, the objective, and the names its adapted layers take in
//! each LoRA file format. What a family caches is named tensors ([`Encoded`]): the cache keeps
//! whatever the family's encoders return, under the family's names.

mod ddpm;
mod flow;
mod flux1;
mod flux2;
mod sdxl;
mod wan;

use std::collections::BTreeMap;

use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, FloatDType, Tensor, TensorData};
use burn_diffusion::vae::{AutoencoderKl, VaeCheckpoint, VaeConfig};
use burn_diffusion::{BlockTape, PlaceWeight, materialize, random_placed};
use burn_kernels::{FusedOps, Kernels};
use burn_lora::LayoutNames;
use burn_offload::{Offload, OffloadBackend, StreamTarget, WeightStream};

use crate::config::{ModelFiles, ModelSource, TrainPlan};
use crate::dataset::{Bucket, Dataset, DatasetError, Item, PIXEL_MULTIPLE};
use crate::error::TrainError;
use crate::models::{built_on_host, float_dtype};
use crate::rng::Rng;

pub use flux1::Flux1;
pub use flux2::Flux2Family;
pub use sdxl::Sdxl;
pub use wan::Wan;

/// The backend the denoiser trains on, over the computing backend `B`: frozen weights may
/// stream from host memory.
pub type TrainBackend<B> = Autodiff<Offload<B>>;

/// One item's encodings by name: an image's (`latent` for FLUX.1) or a caption's (`pooled`,
/// `states`). The names are the family's; the cache stores them as given.
pub type Encoded = BTreeMap<String, TensorData>;

/// The architectures `model.arch` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// FLUX.1 dev / schnell: [`Flux1`].
    Flux1,
    /// FLUX.2 dev / klein: [`Flux2Family`].
    Flux2,
    /// Stable Diffusion XL (base 1.0 and fine-tunes of its shape): [`Sdxl`].
    Sdxl,
    /// Wan 2.1 text-to-video (and each expert of Wan 2.2 A14B): [`Wan`].
    Wan,
}

/// How a family's denoiser is trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Objective {
    /// Flow matching: the model predicts `noise − x₀` at a noise level σ ∈ [0, 1].
    Flow,
    /// Denoising diffusion (DDPM, 1000 discrete timesteps): the model predicts the noise ε or
    /// the velocity v.
    Ddpm,
}

impl Arch {
    /// Every architecture, with its name in the configuration.
    pub const ALL: &'static [(&'static str, Arch)] = &[
        ("flux1", Arch::Flux1),
        ("flux2", Arch::Flux2),
        ("sdxl", Arch::Sdxl),
        ("wan", Arch::Wan),
    ];

    /// The name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Flux1 => "flux1",
            Arch::Flux2 => "flux2",
            Arch::Sdxl => "sdxl",
            Arch::Wan => "wan",
        }
    }

    /// The model's components, as `model.<component>` names them and a diffusers folder holds
    /// them; the first is the trained denoiser.
    pub fn components(self) -> &'static [&'static str] {
        match self {
            Arch::Flux1 => flux1::COMPONENTS,
            Arch::Flux2 => flux2::COMPONENTS,
            Arch::Sdxl => sdxl::COMPONENTS,
            Arch::Wan => wan::COMPONENTS,
        }
    }

    /// The shapes of `random:<shape>` models.
    pub fn random_shapes(self) -> &'static [&'static str] {
        match self {
            Arch::Flux1 => flux1::RANDOM_SHAPES,
            Arch::Flux2 => flux2::RANDOM_SHAPES,
            Arch::Sdxl => sdxl::RANDOM_SHAPES,
            Arch::Wan => wan::RANDOM_SHAPES,
        }
    }

    /// The tokenizer folders the model's text encoders need, under `model.tokenizers`.
    pub fn tokenizer_folders(self) -> &'static [&'static str] {
        match self {
            Arch::Flux1 => flux1::TOKENIZERS,
            Arch::Flux2 => flux2::TOKENIZERS,
            Arch::Sdxl => sdxl::TOKENIZERS,
            Arch::Wan => wan::TOKENIZERS,
        }
    }

    /// The σ sampling a run gets when `train.timestep_type` is not given: FLUX.1 `sigmoid`
    /// (ai-toolkit's default), FLUX.2 its resolution-dependent shift (musubi-tuner's
    /// `flux2_shift`), SDXL `uniform` (every trainer's default for DDPM timesteps), Wan `shift`
    /// (musubi-tuner's recommended `--timestep_sampling shift`, by `train.timestep_shift`).
    pub fn default_timestep_type(self) -> &'static str {
        match self {
            Arch::Flux1 => "sigmoid",
            Arch::Flux2 => "flux2_shift",
            Arch::Sdxl => "uniform",
            Arch::Wan => "shift",
        }
    }

    /// How the denoiser is trained.
    pub fn objective(self) -> Objective {
        match self {
            Arch::Flux1 | Arch::Flux2 | Arch::Wan => Objective::Flow,
            Arch::Sdxl => Objective::Ddpm,
        }
    }

    /// Whether `train.train_text_encoder` can train the text encoders beside the denoiser
    /// (SDXL's, as kohya's sd-scripts do).
    pub fn trains_text_encoders(self) -> bool {
        self == Arch::Sdxl
    }

    /// Whether the denoiser's single file holds every component (SDXL's all-in-one
    /// checkpoint), so that `model.path` alone names them all.
    pub fn single_file_holds_all(self) -> bool {
        self == Arch::Sdxl
    }
}

/// One training sample as the family's objective sees it: the item's encodings and its
/// caption's (the empty caption's when the caption was dropped).
pub struct Sample<'a> {
    /// What the image encoder gave for the item.
    pub image: &'a Encoded,
    /// What the text encoders gave for the caption.
    pub caption: &'a Encoded,
}

/// What a model family provides to the trainer.
///
/// Methods are generic over the computing backend; `B: StreamTarget` where weights may stream,
/// `B: Kernels` / `FusedOps` where only the fused ops matter.
pub trait Family: Sized {
    /// The trained model (the denoiser, with adapters) on the backend `B`.
    type Model<B: Backend>: Module<B>;

    /// The family for `plan`'s model, reading the configuration of its files (not their
    /// weights).
    fn new(plan: &TrainPlan) -> Result<Self, TrainError>;

    /// The names the adapted layers take in every LoRA file layout.
    fn lora_names(&self) -> LayoutNames;

    /// The name recorded as the LoRA file's base model.
    fn base_model_name(&self, plan: &TrainPlan) -> String;

    /// What the cache key must cover besides the items, the architecture and the model source:
    /// anything else the encodings depend on; by default the tokenizer folder.
    fn cache_key(&self, plan: &TrainPlan) -> String {
        tokenizers_key(plan)
    }

    /// The names of an image's encodings and of a caption's, as the encoders return them.
    fn schema(&self) -> Schema;

    /// The pixels a bucket's sides are multiples of: what the image encoder's downsampling
    /// and the denoiser's patches divide ([`PIXEL_MULTIPLE`] by default).
    fn pixel_multiple(&self) -> usize {
        PIXEL_MULTIPLE
    }

    /// Encodes the images of `items` (their pixels from `dataset`), loading the image encoder
    /// and dropping it before returning; an encoding that is not finite is an error naming the
    /// image.
    fn encode_images<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        dataset: &Dataset,
        items: &[usize],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError>;

    /// Encodes `texts`, loading the text encoders and dropping them before returning (streaming
    /// them where the denoiser streams, [`encoder_stream`]); an encoding that is not finite is an
    /// error naming the caption.
    fn encode_captions<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        texts: &[&str],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError>;

    /// The denoiser, every parameter frozen; with a `stream`, its weight matrices (loaded from
    /// files, or made for `random:`) go straight to host memory as streamed weights.
    fn load<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<TrainBackend<B>>>,
    ) -> Result<Self::Model<TrainBackend<B>>, TrainError>;

    /// One micro-batch: the objective's loss and the gradients of the adapters. Everything
    /// random (timesteps, noise) comes from `rng`, in a fixed order.
    fn loss<B: FusedOps>(
        &self,
        plan: &TrainPlan,
        model: &Self::Model<Autodiff<B>>,
        batch: &[Sample<'_>],
        rng: &mut Rng,
        device: &B::Device,
    ) -> (f64, GradientsParams);
}

/// The names of the tensors a family's encoders return, for the cache.
#[derive(Clone, Copy, Debug)]
pub struct Schema {
    /// An image's encodings.
    pub image: &'static [&'static str],
    /// A caption's encodings.
    pub caption: &'static [&'static str],
}

/// `encode` applied to the images of `items`, batched by bucket (at most `batch` images per
/// call, each `[3, h, w]` in `[-1, 1]`, stacked to `[n, 3, h, w]` on `device`); `encode`
/// returns each image's encodings. The encodings come back in `items` order, each checked to
/// be finite (`encoder` names the encoder in the error).
pub fn encode_images_by_bucket<B: Kernels>(
    dataset: &Dataset,
    items: &[usize],
    batch: usize,
    device: &B::Device,
    encoder: &'static str,
    encode: impl FnMut(Tensor<B, 4>) -> Vec<Encoded>,
) -> Result<Vec<Encoded>, TrainError> {
    encode_by_bucket::<B, 3, 4>(
        dataset,
        items,
        batch,
        device,
        encoder,
        Item::load_pixels,
        encode,
    )
}

/// `encode` applied to the clips of `items` one at a time (each `[1, 3, frames, h, w]` in
/// `[-1, 1]` on `device`; an image is a one-frame clip), returning its encodings. The encodings
/// come back in `items` order, each checked to be finite.
pub fn encode_clips_by_bucket<B: Kernels>(
    dataset: &Dataset,
    items: &[usize],
    device: &B::Device,
    mut encode: impl FnMut(Tensor<B, 5>) -> Encoded,
) -> Result<Vec<Encoded>, TrainError> {
    encode_by_bucket::<B, 4, 5>(
        dataset,
        items,
        1,
        device,
        "the VAE",
        Item::load_clip,
        |clip| vec![encode(clip)],
    )
}

/// `encode` applied to the items `load` gives (`D`-dimensional each, stacked on a new first
/// axis), batched by bucket, at most `batch` per call; the encodings in `items` order, each
/// checked to be finite.
fn encode_by_bucket<B: Kernels, const D: usize, const D2: usize>(
    dataset: &Dataset,
    items: &[usize],
    batch: usize,
    device: &B::Device,
    encoder: &'static str,
    load: impl Fn(&Item) -> Result<TensorData, DatasetError>,
    mut encode: impl FnMut(Tensor<B, D2>) -> Vec<Encoded>,
) -> Result<Vec<Encoded>, TrainError> {
    let mut by_bucket: BTreeMap<Bucket, Vec<usize>> = BTreeMap::new();
    for (position, &i) in items.iter().enumerate() {
        by_bucket
            .entry(dataset.items()[i].bucket)
            .or_default()
            .push(position);
    }
    let mut out: Vec<Option<Encoded>> = vec![None; items.len()];
    for positions in by_bucket.into_values() {
        for chunk in positions.chunks(batch) {
            let inputs = chunk
                .iter()
                .map(|&p| {
                    Ok(Tensor::<B, D>::from_data(
                        load(&dataset.items()[items[p]])?,
                        device,
                    ))
                })
                .collect::<Result<Vec<_>, DatasetError>>()?;
            for (&p, encoded) in chunk.iter().zip(encode(Tensor::stack(inputs, 0))) {
                if !encoded.values().all(finite) {
                    return Err(TrainError::NonFiniteEncoding {
                        encoder,
                        input: dataset.items()[items[p]].image.display().to_string(),
                    });
                }
                out[p] = Some(encoded);
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|e| e.expect("every item encoded"))
        .collect())
}

/// The VAE of `preset`'s kind for `plan`'s model, on `device` in `model.vae_dtype` whatever the
/// model's dtype (f32 by default, as kohya's `--no_half_vae` and diffusers' `force_upcast` run
/// it: it encodes each image once, and the latents are cached). `tiny` builds a small random
/// one seeded from the run's seed, `random:` the preset with random weights, files load the
/// `vae` component.
pub fn vae<B: Kernels>(
    plan: &TrainPlan,
    device: &B::Device,
    preset: VaeConfig,
) -> Result<AutoencoderKl<B>, TrainError> {
    let dtype = plan.model.vae_dtype;
    B::seed(device, plan.train.seed ^ 1);
    Ok(match &plan.model.source {
        ModelSource::Tiny => {
            let config = VaeConfig {
                block_out_channels: vec![8, 8, 8, 8],
                layers_per_block: 1,
                norm_num_groups: 4,
                ..preset
            };
            built_on_host(
                plan.train.seed ^ 1,
                dtype,
                |host| config.init::<Flex>(host),
                config.init::<B>(device),
            )
        }
        ModelSource::Random(_) => materialize(preset.init::<B>(device), dtype),
        ModelSource::Files(files) => VaeCheckpoint::open(files.get("vae"))?.load(device, dtype)?,
    })
}

/// `vae`'s normalized latents ([`AutoencoderKl::encode_latents`], computed in the VAE's dtype,
/// kept in the model's dtype) of the images of `items`, one image at a time, each under
/// `name`; the VAE is dropped before returning.
///
/// One at a time: the activations of one 1024² image take gigabytes, and the encoders run
/// before the run's budget is measured; CubeCL tunes a kernel on its first use by running
/// every candidate on the whole input, so on a fresh machine a larger batch also lengthens the
/// tuning, and one image per call keeps one shape per bucket.
pub fn encode_vae_latents<B: Kernels>(
    vae: AutoencoderKl<B>,
    plan: &TrainPlan,
    dataset: &Dataset,
    items: &[usize],
    name: &str,
    device: &B::Device,
) -> Result<Vec<Encoded>, TrainError> {
    let encoded = encode_images_by_bucket::<B>(dataset, items, 1, device, "the VAE", |images| {
        let latents = vae
            .encode_latents(images.cast(DType::F32))
            .cast(plan.model.dtype);
        latents
            .iter_dim(0)
            .map(|latent| {
                let latent = latent.squeeze_dim::<3>(0).into_data();
                Encoded::from([(name.to_string(), latent)])
            })
            .collect()
    });
    drop(vae);
    B::memory_cleanup(device);
    encoded
}

/// The weight stream the text encoders load into when the denoiser streams (the run's
/// `model.offload` or `model.quantize`), else `None`. The encoders run before any step is
/// measured: on a device that reports its memory, a budget that bounds anything has them
/// stream every weight (`models::weight_stream`).
pub fn encoder_stream<B: StreamTarget>(
    plan: &TrainPlan,
    device: &B::Device,
) -> Result<Option<WeightStream<Offload<B>>>, TrainError> {
    Ok(crate::models::weight_stream::<Offload<B>>(
        plan, device, None,
    )?)
}

/// A `random:` model from `init` (lazily initialized) in `dtype`: with a `stream`, its `Linear`
/// weights are made in host memory as streamed weights ([`random_placed`], from `seed`), never
/// on the device, and its other parameters on the device; without, every parameter is created
/// on the device. `model` names it in errors.
pub fn random_model<OB: OffloadBackend, M: Module<OB>>(
    init: M,
    dtype: FloatDType,
    seed: u64,
    stream: Option<&WeightStream<OB>>,
    model: &'static str,
) -> Result<M, TrainError> {
    match stream {
        Some(stream) => random_placed(init, dtype, seed, &mut into_stream(stream))
            .map_err(|source| TrainError::Random { model, source }),
        None => Ok(materialize(init, dtype)),
    }
}

/// The denoiser of `plan`'s model with every parameter frozen, from the seed `plan.train.seed ^
/// 4`: files by `open` (with a `stream`, handed its placement, so that the weight matrices load
/// straight into host memory), `tiny` by `init_host` on the CPU and copied to the device (so that
/// every backend trains the same model), `random:` by `init` (lazily initialized; with a
/// `stream` its matrices are made in host memory). `name` names the model in errors.
pub fn load_denoiser<B: StreamTarget, M: Module<TrainBackend<B>>, H: Module<Flex>>(
    plan: &TrainPlan,
    device: &B::Device,
    stream: Option<&WeightStream<TrainBackend<B>>>,
    name: &'static str,
    init_host: impl FnOnce(&FlexDevice) -> H,
    init: impl FnOnce() -> M,
    open: impl FnOnce(
        &ModelFiles,
        FloatDType,
        Option<&mut PlaceWeight<'_, TrainBackend<B>>>,
    ) -> Result<M, TrainError>,
) -> Result<M, TrainError> {
    let dtype = float_dtype(plan);
    let seed = plan.train.seed ^ 4;
    TrainBackend::<B>::seed(device, seed);
    let model = match &plan.model.source {
        ModelSource::Files(files) => match stream {
            Some(stream) => open(files, dtype, Some(&mut into_stream(stream)))?,
            None => open(files, dtype, None)?,
        },
        ModelSource::Tiny => built_on_host(seed, dtype, init_host, init()),
        ModelSource::Random(_) => random_model(init(), dtype, seed, stream, name)?,
    };
    Ok(model.no_grad())
}

/// The placement a loader hands weight matrices to ([`burn_diffusion::PlaceWeight`]): each
/// becomes a streamed weight in `stream`'s host memory.
pub fn into_stream<B: OffloadBackend>(
    stream: &WeightStream<B>,
) -> impl FnMut(&str, TensorData) -> Result<Tensor<B, 2>, Box<dyn std::error::Error + Send + Sync>> + '_
{
    |name, data| stream.streamed_tensor::<2>(name, data).map_err(Into::into)
}

/// Runs `encode` as one step of `stream` (when the encoder streams), logging how many bytes
/// `encoder` streamed from host memory.
pub fn streamed<B: StreamTarget, T>(
    stream: Option<&WeightStream<Offload<B>>>,
    encoder: &str,
    encode: impl FnOnce() -> T,
) -> T {
    let Some(stream) = stream else {
        return encode();
    };
    stream.begin_step();
    let out = encode();
    let stats = stream.end_step();
    tracing::info!(
        "{encoder} streamed {:.2} GB from host memory",
        stats.bytes_uploaded as f64 / 1e9
    );
    out
}

/// The part of a cache key that names `plan`'s tokenizer folder ([`Family::cache_key`]'s
/// default).
pub(crate) fn tokenizers_key(plan: &TrainPlan) -> String {
    format!("tokenizers {}\n", plan.model.tokenizers.display())
}

/// The name a LoRA file records as its base model: `tiny` for the tiny model, `random:<shape>`,
/// or the file of `component` (the denoiser).
pub fn source_name(plan: &TrainPlan, tiny: &str, component: &str) -> String {
    match &plan.model.source {
        ModelSource::Tiny => tiny.to_string(),
        ModelSource::Random(shape) => format!("random:{shape}"),
        ModelSource::Files(files) => files.get(component).display().to_string(),
    }
}

/// An error when `data`, `encoder`'s encoding of the caption `text`, is not finite.
pub fn check_caption(
    encoder: &'static str,
    text: &str,
    data: &TensorData,
) -> Result<(), TrainError> {
    if finite(data) {
        return Ok(());
    }
    let input = match text.chars().count() {
        0 => "the empty caption".to_string(),
        1..=60 => format!("the caption \"{text}\""),
        _ => format!(
            "the caption \"{}…\"",
            text.chars().take(60).collect::<String>()
        ),
    };
    Err(TrainError::NonFiniteEncoding { encoder, input })
}

/// The names the adapted layers of `arch`'s model from `source` take in every LoRA file
/// layout, read without loading its weights.
pub fn lora_names(arch: Arch, source: &ModelSource) -> Result<LayoutNames, TrainError> {
    match arch {
        Arch::Flux1 => Ok(Flux1::of(source)?.lora_names()),
        Arch::Flux2 => Ok(Flux2Family::of(source)?.lora_names()),
        Arch::Sdxl => Ok(Sdxl::of(source)?.lora_names()),
        Arch::Wan => Ok(Wan::of(source)?.lora_names()),
    }
}

/// Whether every value of `data` is finite.
pub fn finite(data: &TensorData) -> bool {
    data.iter::<f32>().all(f32::is_finite)
}

/// The mean squared error of `prediction` against `target` (in f32) of each sample (the first
/// axis), times its weight when `weights` are given, averaged over the batch; and the
/// gradients of `model`'s adapters through `tape`.
pub(crate) fn mse_gradients<B: FusedOps, M: AutodiffModule<Autodiff<B>>, const D: usize>(
    prediction: Tensor<Autodiff<B>, D>,
    target: Tensor<B, D>,
    weights: Option<Tensor<B, 1>>,
    tape: BlockTape<B, NoCheckpointing>,
    model: &M,
) -> (f64, GradientsParams) {
    let squares = (prediction.cast(DType::F32) - Tensor::from_inner(target)).powi_scalar(2);
    let loss = match weights {
        None => squares.mean(),
        Some(weights) => {
            let n = squares.dims()[0];
            let per_sample = squares.flatten::<2>(1, D - 1).mean_dim(1).reshape([n]);
            (per_sample * Tensor::from_inner(weights)).mean()
        }
    };
    let grads = GradientsParams::from_grads(tape.backward(&loss, model), model);
    // Read after the backward is queued: reading first would leave the device idle while the
    // host queues the backward.
    let value = loss.into_scalar().elem::<f64>();
    (value, grads)
}
