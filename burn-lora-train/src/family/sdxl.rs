//! Stable Diffusion XL: the UNet trained by DDPM (ε- or v-prediction, min-SNR-γ, noise
//! offset) on the 4-channel VAE's scaled latents, conditioned on both CLIPs' penultimate states,
//! OpenCLIP bigG's pooled projection and each image's micro-conditioning (original size, crop,
//! target size). With `train.train_text_encoder` both CLIPs train too: the cache then keeps
//! each caption's token ids, and every step encodes them through the adapted encoders.
//!
//! Sources: `tiny` builds small random models seeded from the run's seed (on the CPU, then
//! copied to the device); `random:sdxl` the full-size shape with random weights; files are a
//! diffusers pipeline folder (`unet/`, `vae/`, `text_encoder/`, `text_encoder_2/`) or the
//! all-in-one SGM checkpoint (`sd_xl_base_1.0.safetensors`), each component also given on its
//! own. The VAE runs in f32 whatever the model's dtype: SDXL's VAE overflows in half precision
//! (diffusers' `force_upcast`, kohya's `--no_half_vae`).

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, DType, Float, FloatDType, Int, Tensor, TensorData, TensorKind};
use burn_diffusion::LoadError;
use burn_diffusion::clip::{ClipActivation, ClipTextConfig, ClipTextModel, SgmTextEncoder};
use burn_diffusion::pipeline::{BucketFit, encode_sdxl_prompt, sdxl_conditioning};
use burn_diffusion::sdxl::{
    UNet2DCondition, UNetCheckpoint, UNetConfig, UNetInput, text_encoder_names,
};
use burn_diffusion::tokenize::CaptionTokenizer;
use burn_diffusion::vae::VaeConfig;
use burn_diffusion::{BlockTape, PlaceWeight};
use burn_kernels::{FusedOps, Kernels};
use burn_lora::LayoutNames;
use burn_offload::{Offload, OffloadBackend, StreamTarget, WeightStream};
use burn_quant::Checkpoint;

use super::ddpm::{DdpmPair, DdpmSchedule, sample_timesteps};
use super::{
    Encoded, Family, Sample, Schema, TrainBackend, check_caption, encode_vae_latents, into_stream,
    load_denoiser, mse_gradients, random_model, source_name, tokenizers_key, vae,
};
use crate::config::{ModelSource, TrainPlan};
use crate::dataset::Dataset;
use crate::error::TrainError;
use crate::models::{built_on_host, float_dtype};
use crate::rng::Rng;

/// Caption length of both CLIPs (the tiny ones too).
const CLIP_TOKENS: usize = 77;
/// Captions encoded per batch.
const TEXT_BATCH: usize = 8;

/// An image's encodings: the VAE latent, scaled, `[4, h/8, w/8]`, in the model's dtype.
const LATENT: &str = "latent";
/// And its micro-conditioning `[6]` (f32): original height and width, crop top and left,
/// target height and width, as diffusers' `add_time_ids`.
const TIME_IDS: &str = "time_ids";
/// A caption's encodings: both CLIPs' penultimate states side by side, `[77, 2048]`.
const STATES: &str = "states";
/// And bigG's pooled projection, `[1280]`.
const POOLED: &str = "pooled";
/// A caption's token ids for CLIP-L, `[77]` (i64), when the text encoders train.
const TOKENS: &str = "tokens";
/// And for bigG.
const TOKENS_2: &str = "tokens_2";

/// The components, as `model.<component>` and diffusers folders name them.
pub(super) const COMPONENTS: &[&str] = &["unet", "vae", "text_encoder", "text_encoder_2"];
/// The `random:` shape: SDXL base 1.0's.
pub(super) const RANDOM_SHAPES: &[&str] = &["sdxl"];
/// The tokenizers: CLIP-L's and bigG's, as in a diffusers folder.
pub(super) const TOKENIZERS: &[&str] = &["tokenizer", "tokenizer_2"];

/// Width of the tiny CLIP-L's states.
const TINY_CLIP_L: usize = 32;
/// Width of the tiny bigG's states and of its projection.
const TINY_BIG_G: usize = 48;
/// Layers of each tiny CLIP.
const TINY_CLIP_LAYERS: usize = 3;

/// CLIP-L and OpenCLIP bigG (with its projection).
type TextEncoders<B> = (ClipTextModel<B>, ClipTextModel<B>);

/// What SDXL trains: the UNet and, with `train.train_text_encoder`, both text encoders, at
/// the paths diffusers' pipeline gives its components
/// ([`burn_diffusion::sdxl::TEXT_ENCODERS`]).
#[derive(Module, Debug)]
pub struct SdxlModel<B: Backend> {
    /// The UNet.
    pub unet: UNet2DCondition<B>,
    /// CLIP-L, when it trains.
    pub text_encoder: Option<ClipTextModel<B>>,
    /// OpenCLIP bigG, when it trains.
    pub text_encoder_2: Option<ClipTextModel<B>>,
}

/// The SDXL family, for one model source.
#[derive(Clone, Debug)]
pub struct Sdxl {
    config: UNetConfig,
    /// The layer counts of CLIP-L and bigG.
    text_encoder_layers: (usize, usize),
    train_text_encoder: bool,
    schedule: DdpmSchedule,
}

impl Sdxl {
    /// The family of `source`'s UNet, its configuration read without loading weights, with
    /// frozen text encoders.
    pub fn of(source: &ModelSource) -> Result<Self, TrainError> {
        let config = match source {
            ModelSource::Tiny => tiny_unet(),
            ModelSource::Random(_) => UNetConfig::sdxl(),
            ModelSource::Files(files) => UNetCheckpoint::open(files.get("unet"))?.config().clone(),
        };
        let text_encoder_layers = match source {
            ModelSource::Tiny => (TINY_CLIP_LAYERS, TINY_CLIP_LAYERS),
            _ => (
                ClipTextConfig::clip_l().num_hidden_layers,
                ClipTextConfig::open_clip_big_g().num_hidden_layers,
            ),
        };
        Ok(Self {
            config,
            text_encoder_layers,
            train_text_encoder: false,
            schedule: DdpmSchedule::sdxl(),
        })
    }

    /// CLIP-L and bigG in the model's dtype on `device`; with a `stream`, the weight matrices
    /// of files load, and those of `random:` are made, straight in its host memory.
    fn text_encoders<B: OffloadBackend + Kernels>(
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<B>>,
    ) -> Result<TextEncoders<B>, TrainError> {
        let dtype = float_dtype(plan);
        let seed = plan.train.seed;
        Ok(match &plan.model.source {
            ModelSource::Tiny => {
                let clip_l = ClipTextConfig {
                    vocab_size: 4096,
                    hidden_size: TINY_CLIP_L,
                    intermediate_size: 2 * TINY_CLIP_L,
                    num_hidden_layers: TINY_CLIP_LAYERS,
                    num_attention_heads: 2,
                    max_position_embeddings: CLIP_TOKENS,
                    hidden_act: ClipActivation::QuickGelu,
                    layer_norm_eps: 1e-5,
                    eos_token_id: 2,
                    projection_dim: None,
                };
                let big_g = ClipTextConfig {
                    hidden_size: TINY_BIG_G,
                    intermediate_size: 2 * TINY_BIG_G,
                    hidden_act: ClipActivation::Gelu,
                    projection_dim: Some(TINY_BIG_G),
                    ..clip_l.clone()
                };
                let clip_l = built_on_host(
                    seed ^ 2,
                    dtype,
                    |h| clip_l.init::<Flex>(h),
                    clip_l.init(device),
                );
                let big_g = built_on_host(
                    seed ^ 3,
                    dtype,
                    |h| big_g.init::<Flex>(h),
                    big_g.init(device),
                );
                (clip_l, big_g)
            }
            ModelSource::Random(_) => {
                let random = |config: ClipTextConfig, seed| {
                    B::seed(device, seed);
                    random_model(config.init(device), dtype, seed, stream, "CLIP")
                };
                (
                    random(ClipTextConfig::clip_l(), seed ^ 2)?,
                    random(ClipTextConfig::open_clip_big_g(), seed ^ 3)?,
                )
            }
            ModelSource::Files(files) => {
                let load = |component, encoder| {
                    let mut place = stream.map(into_stream);
                    let place = place.as_mut().map(|p| p as &mut PlaceWeight<'_, B>);
                    text_encoder(files.get(component), encoder, device, dtype, place)
                };
                (
                    load("text_encoder", SgmTextEncoder::ClipL)?,
                    load("text_encoder_2", SgmTextEncoder::BigG)?,
                )
            }
        })
    }
}

/// One of SDXL's text encoders from `path`: the all-in-one SGM file when it holds `encoder`'s
/// tensors, else a transformers folder or single file.
fn text_encoder<B: Kernels>(
    path: &Path,
    encoder: SgmTextEncoder,
    device: &B::Device,
    dtype: FloatDType,
    place: Option<&mut PlaceWeight<'_, B>>,
) -> Result<ClipTextModel<B>, TrainError> {
    let all_in_one = path.is_file()
        && Checkpoint::open(path)
            .map_err(LoadError::from)?
            .tensors()
            .any(|t| t.name.starts_with(encoder.prefix()));
    Ok(if all_in_one {
        ClipTextModel::load_sgm(path, encoder, device, dtype, place)?
    } else {
        ClipTextModel::load(path, device, dtype, place)?
    })
}

impl Family for Sdxl {
    type Model<B: Backend> = SdxlModel<B>;

    fn new(plan: &TrainPlan) -> Result<Self, TrainError> {
        Ok(Self {
            train_text_encoder: plan.train.train_text_encoder,
            ..Self::of(&plan.model.source)?
        })
    }

    /// The UNet's names (under `unet.`) and both text encoders'.
    fn lora_names(&self) -> LayoutNames {
        let unet = burn_diffusion::sdxl::lora_names(&self.config.layout());
        LayoutNames {
            checkpoint: unet.checkpoint.nested("unet."),
            diffusers: unet.diffusers.nested("unet."),
            components: text_encoder_names(self.text_encoder_layers),
            ..unet
        }
    }

    /// The tokenizer folder, and whether captions are cached as token ids.
    fn cache_key(&self, plan: &TrainPlan) -> String {
        let ids = if self.train_text_encoder {
            "captions as token ids\n"
        } else {
            ""
        };
        format!("{}{ids}", tokenizers_key(plan))
    }

    fn base_model_name(&self, plan: &TrainPlan) -> String {
        source_name(plan, "tiny", "unet")
    }

    fn schema(&self) -> Schema {
        Schema {
            image: &[LATENT, TIME_IDS],
            caption: if self.train_text_encoder {
                &[TOKENS, TOKENS_2]
            } else {
                &[STATES, POOLED]
            },
        }
    }

    /// The latents, and each item's micro-conditioning from its size and bucket.
    fn encode_images<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        dataset: &Dataset,
        items: &[usize],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let vae = vae::<Offload<B>>(plan, device, VaeConfig::sdxl())?;
        let mut encoded = encode_vae_latents(vae, plan, dataset, items, LATENT, device)?;
        for (encoding, &i) in encoded.iter_mut().zip(items) {
            encoding.insert(TIME_IDS.to_string(), time_ids(dataset, i));
        }
        Ok(encoded)
    }

    fn encode_captions<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        texts: &[&str],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let folder = &plan.model.tokenizers;
        let tokenizers = (
            CaptionTokenizer::clip(&folder.join("tokenizer"), CLIP_TOKENS)?,
            CaptionTokenizer::clip(&folder.join("tokenizer_2"), CLIP_TOKENS)?,
        );
        if self.train_text_encoder {
            let ids = |tokenizer: &CaptionTokenizer| -> Result<Vec<TensorData>, TrainError> {
                Ok(tokenizer
                    .encode(texts)?
                    .into_iter()
                    .map(|row| {
                        let row: Vec<i64> = row.into_iter().map(i64::from).collect();
                        TensorData::new(row, [CLIP_TOKENS])
                    })
                    .collect())
            };
            let (ids, ids_2) = (ids(&tokenizers.0)?, ids(&tokenizers.1)?);
            return Ok(ids
                .into_iter()
                .zip(ids_2)
                .map(|(ids, ids_2)| {
                    Encoded::from([(TOKENS.to_string(), ids), (TOKENS_2.to_string(), ids_2)])
                })
                .collect());
        }
        let (clip_l, big_g) = Self::text_encoders::<Offload<B>>(plan, device, None)?;
        let encoded = encode_sdxl_prompt(
            (&tokenizers.0, &tokenizers.1),
            (&clip_l, &big_g),
            texts,
            TEXT_BATCH,
        )?;
        drop((clip_l, big_g));
        B::memory_cleanup(device);
        encoded
            .into_iter()
            .zip(texts)
            .map(|((states, pooled), text)| {
                check_caption("CLIP", text, &states)?;
                check_caption("CLIP bigG", text, &pooled)?;
                Ok(Encoded::from([
                    (STATES.to_string(), states),
                    (POOLED.to_string(), pooled),
                ]))
            })
            .collect()
    }

    /// With a `stream`, the `Linear` weights of files load, and those of `random:` are made,
    /// straight in host memory (the UNet's, and those of text encoders that train).
    fn load<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<TrainBackend<B>>>,
    ) -> Result<SdxlModel<TrainBackend<B>>, TrainError> {
        let (text_encoder, text_encoder_2) = if self.train_text_encoder {
            let (clip_l, big_g) = Self::text_encoders::<TrainBackend<B>>(plan, device, stream)?;
            (Some(clip_l.no_grad()), Some(big_g.no_grad()))
        } else {
            (None, None)
        };
        let unet = load_denoiser(
            plan,
            device,
            stream,
            "UNet",
            |host| self.config.init::<Flex>(host),
            || self.config.init(device),
            |files, dtype, place| {
                let checkpoint = UNetCheckpoint::open(files.get("unet"))?;
                Ok(match place {
                    Some(place) => checkpoint.load_with(device, dtype, place)?,
                    None => checkpoint.load(device, dtype)?,
                })
            },
        )?;
        Ok(SdxlModel {
            unet,
            text_encoder,
            text_encoder_2,
        })
    }

    /// DDPM: a timestep drawn for each sample (`train.timestep_type` mapped onto the 1000
    /// steps), the noise (and its offset) on the CPU, the model trained to predict ε or v; the
    /// mean squared error of each sample (in f32), weighted by min-SNR-γ when configured,
    /// averaged over the batch. Text encoders that train encode the captions first.
    fn loss<B: FusedOps>(
        &self,
        plan: &TrainPlan,
        model: &SdxlModel<Autodiff<B>>,
        batch: &[Sample<'_>],
        rng: &mut Rng,
        device: &B::Device,
    ) -> (f64, GradientsParams) {
        let x0 = stack::<B, 3, 4, Float>(batch, |s| &s.image[LATENT], device).cast(DType::F32);
        let [n, _, h, w] = x0.dims();
        let timesteps = sample_timesteps(
            plan.train.timestep,
            plan.train.timestep_range,
            n,
            h * w / 4,
            rng,
        );
        let pair = DdpmPair::new(
            x0,
            &timesteps,
            &self.schedule,
            &plan.train.ddpm,
            rng,
            device,
        );

        let dtype = plan.model.dtype;
        let (states, pooled) = match (&model.text_encoder, &model.text_encoder_2) {
            (Some(clip_l), Some(big_g)) => {
                let ids = |name| {
                    Tensor::from_inner(stack::<B, 1, 2, Int>(batch, |s| &s.caption[name], device))
                };
                sdxl_conditioning((clip_l, big_g), (ids(TOKENS), ids(TOKENS_2)))
            }
            _ => (
                Tensor::from_inner(stack::<B, 2, 3, Float>(
                    batch,
                    |s| &s.caption[STATES],
                    device,
                )),
                Tensor::from_inner(stack::<B, 1, 2, Float>(
                    batch,
                    |s| &s.caption[POOLED],
                    device,
                )),
            ),
        };
        let input = UNetInput {
            sample: Tensor::from_inner(pair.x_t.cast(dtype)),
            timestep: Tensor::from_inner(pair.timesteps.clone()),
            encoder_hidden_states: states.cast(dtype),
            text_embeds: pooled.cast(dtype),
            time_ids: Tensor::from_inner(stack::<B, 1, 2, Float>(
                batch,
                |s| &s.image[TIME_IDS],
                device,
            )),
        };
        let mut tape = BlockTape::new(plan.train.gradient_checkpointing);
        let prediction = model.unet.forward_with(input, &mut tape);
        mse_gradients(prediction, pair.target, Some(pair.weights), tape, model)
    }
}

/// The encodings `of` each sample, stacked on a new first axis.
fn stack<'a, B: Backend, const D: usize, const D2: usize, K: TensorKind<B> + BasicOps<B>>(
    batch: &'a [Sample<'a>],
    of: impl Fn(&'a Sample<'a>) -> &'a TensorData,
    device: &B::Device,
) -> Tensor<B, D2, K> {
    let tensors = batch
        .iter()
        .map(|s| Tensor::<B, D, K>::from_data(of(s).clone(), device))
        .collect();
    Tensor::stack(tensors, 0)
}

/// The UNet of `model.path: tiny`: SDXL's blocks at widths 8, 16, 16, conditioned on the tiny
/// CLIPs' states and bigG's projection.
fn tiny_unet() -> UNetConfig {
    UNetConfig {
        block_out_channels: vec![8, 16, 16],
        transformer_layers_per_block: vec![1, 1, 2],
        attention_head_dim: vec![1, 1, 2],
        cross_attention_dim: TINY_CLIP_L + TINY_BIG_G,
        addition_time_embed_dim: 8,
        projection_class_embeddings_input_dim: TINY_BIG_G + 6 * 8,
        norm_num_groups: 4,
        ..UNetConfig::sdxl()
    }
}

/// The micro-conditioning of item `i` (`[6]`, f32): its image's size, the top-left corner of
/// its cut-out in the resized image, and its bucket, each as (height, width).
fn time_ids(dataset: &Dataset, i: usize) -> TensorData {
    let item = &dataset.items()[i];
    let (width, height) = item.size;
    let bucket = item.bucket;
    let fit = BucketFit::new(width, height, bucket.width, bucket.height);
    let ids = [
        height as f32,
        width as f32,
        fit.top as f32,
        fit.left as f32,
        bucket.height as f32,
        bucket.width as f32,
    ];
    TensorData::new(ids.to_vec(), [6])
}
