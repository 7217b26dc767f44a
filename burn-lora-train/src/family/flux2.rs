//! FLUX.2 (dev, klein): the transformer trained by flow matching on the VAE's normalized,
//! patchified latents, conditioned on the stacked hidden states of a decoder-only text model
//! (Mistral-Small-3 for dev, Qwen3 for klein).
//!
//! Sources: `tiny` builds a small dev-shaped model (guidance, Mistral prompt format) seeded from
//! the run's seed on the CPU; `random:flux2-dev` / `random:flux2-klein-4b` /
//! `random:flux2-klein-9b` build full-size ones with random weights (when the weights stream,
//! the matrices are made in host memory and never on the device; the text decoder has only
//! the layers its stacked states read); files are read with burn-diffusion's loaders (BFL
//! single files and FP8 files, diffusers folders, ComfyUI's separate text-encoder and VAE
//! files).

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_diffusion::BlockTape;
use burn_diffusion::flux2::{Flux2, Flux2Checkpoint, Flux2Config, Flux2Input};
use burn_diffusion::materialize;
use burn_diffusion::pipeline::{
    FLUX2_DEV_LAYERS, FLUX2_KLEIN_LAYERS, encode_flux2_text, flux2_image_ids, flux2_text_ids,
    pack_flux2_latents,
};
use burn_diffusion::text_decoder::{TextDecoder, TextDecoderConfig};
use burn_diffusion::tokenize::{FLUX2_TEXT_LENGTH, PromptTokenizer};
use burn_diffusion::vae::{AutoencoderKl, VaeCheckpoint, VaeConfig};
use burn_kernels::{FusedOps, Kernels};
use burn_lora::LayoutNames;
use burn_offload::{Offload, StreamTarget, WeightStream};

use super::flow::FlowPair;
use super::{
    Encoded, Family, Sample, Schema, TrainBackend, check_caption, encode_vae_latents,
    encoder_stream, into_stream, load_denoiser, mse_gradients, random_model, source_name, streamed,
};
use crate::config::{ModelSource, TrainPlan};
use crate::dataset::Dataset;
use crate::error::TrainError;
use crate::models::{built_on_host, float_dtype};
use crate::rng::Rng;

/// Prompt length of the tiny model's text decoder: its tokenizer's prompts of the tiny
/// captions, FLUX.2-dev's system message included, take 50 to 62 tokens.
const TINY_TOKENS: usize = 64;
/// The tiny decoder's stacked hidden states.
const TINY_LAYERS: [usize; 3] = [1, 2, 3];
/// Captions encoded per batch.
const TEXT_BATCH: usize = 4;

/// An image's encoding: the normalized, patchified VAE latent `[128, h/16, w/16]`, in the
/// model's dtype.
const LATENT: &str = "latent";
/// A caption's encoding: the stacked hidden states `[tokens, 3 · hidden]`.
const STATES: &str = "states";

/// The components, as `model.<component>` and diffusers folders name them.
pub(super) const COMPONENTS: &[&str] = &["transformer", "vae", "text_encoder"];
/// The `random:` shapes.
pub(super) const RANDOM_SHAPES: &[&str] = &["flux2-dev", "flux2-klein-4b", "flux2-klein-9b"];
/// The tokenizer of the text decoder, as in a diffusers folder.
pub(super) const TOKENIZERS: &[&str] = &["tokenizer"];

/// Which decoder conditions the model, and so which prompt format and hidden states it uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TextModel {
    /// Mistral-Small-3 (dev): layers 10, 20, 30.
    Mistral,
    /// Qwen3 (klein): layers 9, 18, 27.
    Qwen3,
}

impl TextModel {
    /// The hidden states FLUX.2 stacks.
    fn layers(self) -> &'static [usize; 3] {
        match self {
            TextModel::Mistral => &FLUX2_DEV_LAYERS,
            TextModel::Qwen3 => &FLUX2_KLEIN_LAYERS,
        }
    }

    fn name(self) -> &'static str {
        match self {
            TextModel::Mistral => "Mistral-Small-3 (FLUX.2-dev)",
            TextModel::Qwen3 => "Qwen3 (FLUX.2-klein)",
        }
    }
}

/// The FLUX.2 family, for one model source.
#[derive(Clone, Debug)]
pub struct Flux2Family {
    config: Flux2Config,
}

impl Flux2Family {
    /// The family of `source`'s transformer, its configuration read without loading weights.
    pub fn of(source: &ModelSource) -> Result<Self, TrainError> {
        let config = match source {
            ModelSource::Tiny => Self::tiny(),
            ModelSource::Random(shape) => match shape.as_str() {
                "flux2-klein-4b" => Flux2Config::klein_4b(),
                "flux2-klein-9b" => Flux2Config::klein_9b(),
                _ => Flux2Config::dev(),
            },
            ModelSource::Files(files) => Flux2Checkpoint::open(files.get("transformer"))?
                .config()
                .clone(),
        };
        Ok(Self { config })
    }

    /// 16 input channels (4 latent channels patchified), width 32, two blocks of each kind,
    /// guidance: FLUX.2-dev's shape in small.
    fn tiny() -> Flux2Config {
        let context = TINY_LAYERS.len() * Self::tiny_decoder().hidden_size;
        Flux2Config::new(16, 16, context, 32, 2, 2, 2, vec![4; 4], true)
    }

    fn tiny_decoder() -> TextDecoderConfig {
        TextDecoderConfig {
            vocab_size: 1024,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 3,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 16,
            rope_theta: 1e6,
            rms_norm_eps: 1e-5,
            qk_norm: false,
            final_norm: true,
        }
    }

    /// The text model of a random or tiny source.
    fn built_text_model(&self) -> TextModel {
        if self.config.guidance_embed {
            TextModel::Mistral
        } else {
            TextModel::Qwen3
        }
    }

    fn text_tokens(plan: &TrainPlan) -> usize {
        match plan.model.source {
            ModelSource::Tiny => TINY_TOKENS,
            _ => FLUX2_TEXT_LENGTH,
        }
    }

    /// The VAE, on `device` in `model.vae_dtype` whatever the model's dtype (as FLUX.1's).
    fn vae<B: Kernels>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
    ) -> Result<AutoencoderKl<B>, TrainError> {
        let dtype = plan.model.vae_dtype;
        B::seed(device, plan.train.seed ^ 1);
        Ok(match &plan.model.source {
            ModelSource::Tiny => {
                let config = VaeConfig {
                    latent_channels: 4,
                    block_out_channels: vec![8, 8, 8, 8],
                    layers_per_block: 1,
                    norm_num_groups: 4,
                    ..VaeConfig::flux2()
                };
                built_on_host(
                    plan.train.seed ^ 1,
                    dtype,
                    |host| config.init::<Flex>(host),
                    config.init::<B>(device),
                )
            }
            ModelSource::Random(_) => materialize(VaeConfig::flux2().init::<B>(device), dtype),
            ModelSource::Files(files) => {
                let path = files.get("vae");
                let checkpoint = VaeCheckpoint::open(path)?;
                let config = checkpoint.config();
                let patch = config.batch_norm.as_ref().map_or(1, |bn| bn.patch_size);
                let channels = config.latent_channels * patch * patch;
                self.check_width(
                    path,
                    "VAE",
                    "in_channels",
                    channels,
                    self.config.in_channels,
                )?;
                checkpoint.load(device, dtype)?
            }
        })
    }

    /// An error naming `file` when its `model` gives `found` values per token where the
    /// transformer reads `expected` (its `field`): a VAE or text decoder of another FLUX.2.
    fn check_width(
        &self,
        file: &Path,
        model: &str,
        field: &str,
        found: usize,
        expected: usize,
    ) -> Result<(), TrainError> {
        if found == expected {
            return Ok(());
        }
        Err(mismatch(
            file,
            format!(
                "this {model} gives {found} values per token, the transformer reads {expected} ({field})"
            ),
        ))
    }

    /// The text decoder in the model's dtype and which one it is; with a `stream`, its
    /// `Linear` weights are streamed weights in host memory (loaded or made there directly),
    /// and its token embedding stays on the device.
    fn text_decoder<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<Offload<B>>>,
    ) -> Result<(TextDecoder<Offload<B>>, TextModel), TrainError> {
        let dtype = float_dtype(plan);
        let seed = plan.train.seed ^ 2;
        let (decoder, model) = match &plan.model.source {
            ModelSource::Tiny => {
                let config = Self::tiny_decoder();
                let decoder =
                    built_on_host(seed, dtype, |h| config.init::<Flex>(h), config.init(device));
                (decoder, TextModel::Mistral)
            }
            ModelSource::Random(_) => {
                let model = self.built_text_model();
                let preset = match model {
                    TextModel::Mistral => TextDecoderConfig::mistral_small_3(),
                    TextModel::Qwen3 if self.config.hidden_size == 3072 => {
                        TextDecoderConfig::qwen3_4b()
                    }
                    TextModel::Qwen3 => TextDecoderConfig::qwen3_8b(),
                };
                let config = TextDecoderConfig {
                    num_hidden_layers: *model.layers().iter().max().expect("three layers"),
                    final_norm: false,
                    ..preset
                };
                Offload::<B>::seed(device, seed);
                let decoder =
                    random_model(config.init(device), dtype, seed, stream, "text decoder")?;
                (decoder, model)
            }
            ModelSource::Files(files) => {
                let path = files.get("text_encoder");
                let decoder = match stream {
                    Some(stream) => {
                        TextDecoder::load_with(path, device, dtype, &mut into_stream(stream))?
                    }
                    None => TextDecoder::load(path, device, dtype)?,
                };
                let hidden = decoder.config().hidden_size;
                let context = self.config.context_in_dim;
                self.check_width(path, "text decoder", "context_in_dim", 3 * hidden, context)?;
                let model = if decoder.config().qk_norm {
                    TextModel::Qwen3
                } else {
                    TextModel::Mistral
                };
                let layers = decoder.config().num_hidden_layers;
                let read = model.layers();
                if read.iter().any(|&l| l > layers) {
                    let message = format!(
                        "this text decoder has {layers} layers; FLUX.2 reads the hidden states \
                         {read:?} of {}",
                        model.name()
                    );
                    return Err(mismatch(path, message));
                }
                (decoder, model)
            }
        };
        // A random or loaded decoder's Linear weights are in host memory already; its token
        // embedding stays on the device, where every lookup reads it.
        let decoder = match (stream, &plan.model.source) {
            (Some(stream), ModelSource::Tiny) => stream.stream_frozen(decoder)?,
            _ => decoder,
        };
        Ok((decoder, model))
    }
}

/// A configuration error about `file`, a component that does not belong with the transformer.
fn mismatch(file: &Path, message: String) -> TrainError {
    burn_diffusion::LoadError::Config {
        file: file.to_path_buf(),
        message: format!(
            "{message}; FLUX.2-dev pairs with Mistral-Small-3, klein 4B with Qwen3-4B, klein 9B \
             with Qwen3-8B, all with the FLUX.2 VAE"
        ),
    }
    .into()
}

impl Family for Flux2Family {
    type Model<B: Backend> = Flux2<B>;

    fn new(plan: &TrainPlan) -> Result<Self, TrainError> {
        Self::of(&plan.model.source)
    }

    fn lora_names(&self) -> LayoutNames {
        burn_diffusion::flux2::lora_names(&self.config)
    }

    fn base_model_name(&self, plan: &TrainPlan) -> String {
        source_name(plan, "tiny-flux2", "transformer")
    }

    fn schema(&self) -> Schema {
        Schema {
            image: &[LATENT],
            caption: &[STATES],
        }
    }

    fn encode_images<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        dataset: &Dataset,
        items: &[usize],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let vae = self.vae::<Offload<B>>(plan, device)?;
        encode_vae_latents(vae, plan, dataset, items, LATENT, device)
    }

    /// When the transformer streams its weights, the text decoder streams too, within the
    /// same budget.
    fn encode_captions<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        texts: &[&str],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let stream = encoder_stream::<B>(plan, device)?;
        let (decoder, model) = self.text_decoder::<B>(plan, device, stream.as_ref())?;
        let folder = plan.model.tokenizers.join("tokenizer");
        let length = Self::text_tokens(plan);
        let tokenizer = match model {
            TextModel::Mistral => PromptTokenizer::mistral(&folder, length)?,
            TextModel::Qwen3 => PromptTokenizer::qwen3(&folder, length)?,
        };
        let layers = match plan.model.source {
            ModelSource::Tiny => &TINY_LAYERS,
            _ => model.layers(),
        };
        let states = streamed(stream.as_ref(), "the text decoder", || {
            encode_flux2_text(&tokenizer, decoder, texts, layers, TEXT_BATCH)
        })?;
        states
            .into_iter()
            .zip(texts)
            .map(|(states, text)| {
                check_caption("the text decoder", text, &states)?;
                Ok(Encoded::from([(STATES.to_string(), states)]))
            })
            .collect()
    }

    fn load<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<TrainBackend<B>>>,
    ) -> Result<Flux2<TrainBackend<B>>, TrainError> {
        load_denoiser(
            plan,
            device,
            stream,
            "transformer",
            |host| self.config.init::<Flex>(host),
            || self.config.init(device),
            |files, dtype, place| {
                let path = files.get("transformer");
                Ok(match place {
                    Some(place) => Flux2Checkpoint::open(path)?.load_with(device, dtype, place)?,
                    None => Flux2::load(path, device, dtype)?,
                })
            },
        )
    }

    /// Flow matching as for FLUX.1, on the packed latents `[n, h·w, 128]`: σ drawn for each
    /// sample (`train.timestep_type`, FLUX.2's resolution shift by default, from the token
    /// count `h·w`), the noise on the CPU, `x_t = (1 − σ)·x₀ + σ·noise`, target `noise − x₀`.
    fn loss<B: FusedOps>(
        &self,
        plan: &TrainPlan,
        flux: &Flux2<Autodiff<B>>,
        batch: &[Sample<'_>],
        rng: &mut Rng,
        device: &B::Device,
    ) -> (f64, GradientsParams) {
        let latents = batch
            .iter()
            .map(|s| Tensor::<B, 3>::from_data(s.image[LATENT].clone(), device).cast(DType::F32))
            .collect();
        let states = batch
            .iter()
            .map(|s| Tensor::<B, 2>::from_data(s.caption[STATES].clone(), device))
            .collect();
        let latents = Tensor::stack::<4>(latents, 0);
        let [n, _, h, w] = latents.dims();
        let x0 = pack_flux2_latents(latents);

        let sigmas: Vec<f32> = (0..n)
            .map(|_| {
                plan.train
                    .timestep_range
                    .sample(plan.train.timestep, h * w, rng) as f32
            })
            .collect();
        let pair = FlowPair::new(x0, sigmas, rng, device);

        let dtype = plan.model.dtype;
        let txt: Tensor<B, 3> = Tensor::stack(states, 0).cast(dtype);
        let txt_len = txt.dims()[1];
        let input = Flux2Input {
            img: Tensor::from_inner(pair.x_t.cast(dtype)),
            txt: Tensor::from_inner(txt),
            timesteps: Tensor::from_inner(pair.sigma.cast(dtype)),
            guidance: self.config.guidance_embed.then(|| {
                Tensor::from_inner(
                    Tensor::<B, 1>::full([n], plan.train.guidance_scale, device).cast(dtype),
                )
            }),
            img_ids: flux2_image_ids(h, w),
            txt_ids: flux2_text_ids(txt_len),
        };
        let mut tape = BlockTape::new(plan.train.gradient_checkpointing);
        let prediction = flux.forward_with(input, &mut tape);
        mse_gradients(prediction, pair.target, None, tape, flux)
    }
}
