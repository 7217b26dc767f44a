//! FLUX.1 (dev and schnell): the transformer trained by flow matching on packed VAE latents,
//! conditioned on CLIP-L's pooled vector and T5-XXL's hidden states.
//!
//! Sources: `tiny` builds small random models seeded from the run's seed (on the CPU, then
//! copied to the device, so that every backend trains the same model); `random:` builds
//! full-size ones (random weights, for measuring speed and memory without the real files): on
//! the device, or, when the weights stream, the transformer's and T5's matrices straight in
//! host memory; files are loaded with burn-diffusion's loaders (BFL single files, diffusers
//! folders, FP8 files). Every float parameter is brought to the model's dtype, except the VAE's.

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_diffusion::BlockTape;
use burn_diffusion::clip::{ClipActivation, ClipTextConfig, ClipTextModel};
use burn_diffusion::flux::{Flux, FluxCheckpoint, FluxConfig, FluxInput};
use burn_diffusion::materialize;
use burn_diffusion::pipeline::{encode_clip_pooled, encode_t5, image_ids, pack_latents, text_ids};
use burn_diffusion::t5::{T5Config, T5Encoder};
use burn_diffusion::tokenize::CaptionTokenizer;
use burn_diffusion::vae::VaeConfig;
use burn_kernels::FusedOps;
use burn_lora::LayoutNames;
use burn_offload::{Offload, StreamTarget, WeightStream};

use super::flow::FlowPair;
use super::{
    Encoded, Family, Sample, Schema, TrainBackend, check_caption, encode_vae_latents,
    encoder_stream, into_stream, load_denoiser, mse_gradients, random_model, source_name, streamed,
    vae,
};
use crate::config::{ModelSource, TrainPlan};
use crate::dataset::Dataset;
use crate::error::TrainError;
use crate::models::{built_on_host, float_dtype};
use crate::rng::Rng;

/// Caption length of the tiny model's CLIP and T5.
const TINY_TOKENS: usize = 16;
/// CLIP's caption length in the FLUX.1 pipeline.
const CLIP_TOKENS: usize = 77;
/// Captions encoded per batch.
const TEXT_BATCH: usize = 8;

/// An image's encoding: the VAE latent, normalized, `[16, h/8, w/8]`, in the model's dtype.
const LATENT: &str = "latent";
/// A caption's encodings: CLIP's pooled output `[768]`.
const POOLED: &str = "pooled";
/// And T5's last hidden state `[tokens, 4096]`.
const STATES: &str = "states";

/// The components, as `model.<component>` and diffusers folders name them.
pub(super) const COMPONENTS: &[&str] = &["transformer", "vae", "text_encoder", "text_encoder_2"];
/// The `random:` shapes: FLUX.1-dev's (guidance-distilled) and schnell's.
pub(super) const RANDOM_SHAPES: &[&str] = &["flux1-dev", "flux1-schnell"];
/// The tokenizers: CLIP's and T5's, as in a diffusers folder.
pub(super) const TOKENIZERS: &[&str] = &["tokenizer", "tokenizer_2"];

/// CLIP-L and T5-XXL.
type TextEncoders<B> = (ClipTextModel<B>, T5Encoder<B>);

/// The FLUX.1 family, for one model source.
#[derive(Clone, Debug)]
pub struct Flux1 {
    config: FluxConfig,
}

impl Flux1 {
    /// The family of `source`'s transformer, its configuration read without loading weights.
    pub fn of(source: &ModelSource) -> Result<Self, TrainError> {
        let config = match source {
            ModelSource::Tiny => FluxConfig::new(64, 64, 32, 32, 32, 2, 2, 2, vec![4, 6, 6], true),
            ModelSource::Random(shape) if shape == "flux1-schnell" => FluxConfig::schnell(),
            ModelSource::Random(_) => FluxConfig::dev(),
            ModelSource::Files(files) => FluxCheckpoint::open(files.get("transformer"))?
                .config()
                .clone(),
        };
        Ok(Self { config })
    }

    /// T5's caption length: FluxPipeline's `max_sequence_length` (512 for dev, 256 for
    /// schnell).
    fn t5_tokens(&self, plan: &TrainPlan) -> usize {
        match &plan.model.source {
            ModelSource::Tiny => TINY_TOKENS,
            _ if self.config.guidance_embed => 512,
            _ => 256,
        }
    }

    fn clip_tokens(plan: &TrainPlan) -> usize {
        match plan.model.source {
            ModelSource::Tiny => TINY_TOKENS,
            _ => CLIP_TOKENS,
        }
    }

    /// CLIP-L and T5 in the model's dtype, on `device`; with a `stream`, T5's `Linear` weights
    /// are streamed weights in host memory instead (loaded or, for `random:`, made there
    /// directly).
    fn text_encoders<B: StreamTarget>(
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<Offload<B>>>,
    ) -> Result<TextEncoders<Offload<B>>, TrainError> {
        let dtype = float_dtype(plan);
        let seed = plan.train.seed;
        let (clip, t5) = match &plan.model.source {
            ModelSource::Tiny => {
                let clip = ClipTextConfig {
                    vocab_size: 4096,
                    hidden_size: 32,
                    intermediate_size: 64,
                    num_hidden_layers: 2,
                    num_attention_heads: 2,
                    max_position_embeddings: TINY_TOKENS,
                    hidden_act: ClipActivation::QuickGelu,
                    layer_norm_eps: 1e-5,
                    eos_token_id: 2,
                    projection_dim: None,
                };
                let clip =
                    built_on_host(seed ^ 2, dtype, |h| clip.init::<Flex>(h), clip.init(device));
                let t5 = T5Config {
                    vocab_size: 4096,
                    d_model: 32,
                    d_kv: 8,
                    d_ff: 64,
                    num_layers: 2,
                    num_heads: 4,
                    relative_attention_num_buckets: 8,
                    relative_attention_max_distance: 16,
                    layer_norm_epsilon: 1e-6,
                    position_bias_per_layer: false,
                };
                let t5 = built_on_host(seed ^ 3, dtype, |h| t5.init::<Flex>(h), t5.init(device));
                (clip, t5)
            }
            ModelSource::Random(_) => {
                Offload::<B>::seed(device, seed ^ 2);
                let clip = materialize(ClipTextConfig::clip_l().init(device), dtype);
                Offload::<B>::seed(device, seed ^ 3);
                let t5 = random_model(T5Config::xxl().init(device), dtype, seed ^ 3, stream, "T5")?;
                (clip, t5)
            }
            ModelSource::Files(files) => {
                let clip = ClipTextModel::load(files.get("text_encoder"), device, dtype, None)?;
                let path = files.get("text_encoder_2");
                let t5 = match stream {
                    Some(stream) => {
                        T5Encoder::load_with(path, device, dtype, &mut into_stream(stream))?
                    }
                    None => T5Encoder::load(path, device, dtype)?,
                };
                (clip, t5)
            }
        };
        let t5 = match stream {
            Some(stream) => stream.stream_frozen(t5)?,
            None => t5,
        };
        Ok((clip, t5))
    }
}

impl Family for Flux1 {
    type Model<B: Backend> = Flux<B>;

    fn new(plan: &TrainPlan) -> Result<Self, TrainError> {
        Self::of(&plan.model.source)
    }

    fn lora_names(&self) -> LayoutNames {
        burn_diffusion::flux::lora_names(&self.config)
    }

    fn base_model_name(&self, plan: &TrainPlan) -> String {
        source_name(plan, "tiny", "transformer")
    }

    fn schema(&self) -> Schema {
        Schema {
            image: &[LATENT],
            caption: &[POOLED, STATES],
        }
    }

    fn encode_images<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        dataset: &Dataset,
        items: &[usize],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let vae = vae::<Offload<B>>(plan, device, VaeConfig::flux())?;
        encode_vae_latents(vae, plan, dataset, items, LATENT, device)
    }

    /// When the transformer streams its weights, T5 streams too ([`encoder_stream`]).
    fn encode_captions<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        texts: &[&str],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let folder = &plan.model.tokenizers;
        let clip_tokenizer =
            CaptionTokenizer::clip(&folder.join("tokenizer"), Self::clip_tokens(plan))?;
        let t5_tokenizer = CaptionTokenizer::t5(&folder.join("tokenizer_2"), self.t5_tokens(plan))?;
        let stream = encoder_stream::<B>(plan, device)?;
        let (clip, t5) = Self::text_encoders::<B>(plan, device, stream.as_ref())?;
        let pooled = encode_clip_pooled(&clip_tokenizer, clip, texts, TEXT_BATCH)?;
        let states = streamed(stream.as_ref(), "T5", || {
            encode_t5(&t5_tokenizer, t5, texts, TEXT_BATCH)
        })?;
        pooled
            .into_iter()
            .zip(states)
            .zip(texts)
            .map(|((pooled, states), text)| {
                check_caption("CLIP", text, &pooled)?;
                check_caption("T5", text, &states)?;
                Ok(Encoded::from([
                    (POOLED.to_string(), pooled),
                    (STATES.to_string(), states),
                ]))
            })
            .collect()
    }

    /// With a `stream`, the `Linear` weights of files load, and those of `random:` are made,
    /// straight in host memory.
    fn load<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<TrainBackend<B>>>,
    ) -> Result<Flux<TrainBackend<B>>, TrainError> {
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
                    Some(place) => FluxCheckpoint::open(path)?.load_with(device, dtype, place)?,
                    None => Flux::load(path, device, dtype)?,
                })
            },
        )
    }

    /// Flow matching: σ drawn for each sample, then the batch's noise on the CPU (`Flex` seeded
    /// with `rng.next_u64()`); the model sees `x_t = (1 − σ)·x₀ + σ·noise` at
    /// timestep σ and is trained to predict `noise − x₀` (mean squared error over the packed
    /// latents, in f32).
    fn loss<B: FusedOps>(
        &self,
        plan: &TrainPlan,
        flux: &Flux<Autodiff<B>>,
        batch: &[Sample<'_>],
        rng: &mut Rng,
        device: &B::Device,
    ) -> (f64, GradientsParams) {
        let tensor = |encoded: &Encoded, name: &str| encoded[name].clone();
        let latents = batch
            .iter()
            .map(|s| Tensor::<B, 3>::from_data(tensor(s.image, LATENT), device).cast(DType::F32))
            .collect();
        let pooled = batch
            .iter()
            .map(|s| Tensor::<B, 1>::from_data(tensor(s.caption, POOLED), device))
            .collect();
        let states = batch
            .iter()
            .map(|s| Tensor::<B, 2>::from_data(tensor(s.caption, STATES), device))
            .collect();
        let latents = Tensor::stack::<4>(latents, 0);
        let [n, _, h, w] = latents.dims();
        let x0 = pack_latents(latents);

        let sigmas: Vec<f32> = (0..n)
            .map(|_| {
                plan.train
                    .timestep_range
                    .sample(plan.train.timestep, h * w / 4, rng) as f32
            })
            .collect();
        let pair = FlowPair::new(x0, sigmas, rng, device);

        let dtype = plan.model.dtype;
        let txt: Tensor<B, 3> = Tensor::stack(states, 0).cast(dtype);
        let txt_len = txt.dims()[1];
        let input = FluxInput {
            img: Tensor::from_inner(pair.x_t.cast(dtype)),
            txt: Tensor::from_inner(txt),
            y: Tensor::from_inner(Tensor::stack::<2>(pooled, 0).cast(dtype)),
            timesteps: Tensor::from_inner(pair.sigma.cast(dtype)),
            guidance: self.config.guidance_embed.then(|| {
                Tensor::from_inner(
                    Tensor::<B, 1>::full([n], plan.train.guidance_scale, device).cast(dtype),
                )
            }),
            img_ids: image_ids(h, w),
            txt_ids: text_ids(txt_len),
        };
        let mut tape = BlockTape::new(plan.train.gradient_checkpointing);
        let prediction = flux.forward_with(input, &mut tape);
        mse_gradients(prediction, pair.target, None, tape, flux)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use burn::module::Module;
    use burn_offload::OffloadConfig;

    use super::*;

    /// A `random:` transformer whose weights stream is made in host memory: every matrix the
    /// stream would have taken from the device (`stream_frozen` of the same model made on the
    /// device) was handed to it as it was made, so none is left for `stream_frozen`.
    #[test]
    fn a_random_transformer_that_streams_is_made_in_host_memory() {
        let device = Default::default();
        let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny");
        let mut plan = TrainPlan::load(&examples.join("config.yaml")).unwrap();
        plan.model.source = ModelSource::Random("flux1-dev".into());
        // The tiny shape, loaded as `random:` is.
        let family = Flux1::of(&ModelSource::Tiny).unwrap();
        let names = |stream: &WeightStream<TrainBackend<Flex>>| -> Vec<String> {
            stream.routes().into_iter().map(|(name, _)| name).collect()
        };

        let placed = WeightStream::new(&device, OffloadConfig::default()).unwrap();
        let flux = family.load::<Flex>(&plan, &device, Some(&placed)).unwrap();
        let made_in_host_memory = names(&placed);
        let flux = placed.stream_frozen(flux).unwrap();
        assert_eq!(names(&placed), made_in_host_memory, "nothing left to move");

        let moved = WeightStream::new(&device, OffloadConfig::default()).unwrap();
        let on_device = family.load::<Flex>(&plan, &device, None).unwrap();
        let on_device = moved.stream_frozen(on_device).unwrap();
        assert_eq!(made_in_host_memory, names(&moved));
        assert!(
            made_in_host_memory
                .iter()
                .any(|name| name == "double_blocks.0.img_attn.qkv.weight"),
            "{made_in_host_memory:?}"
        );
        assert_eq!(flux.num_params(), on_device.num_params());
    }
}
