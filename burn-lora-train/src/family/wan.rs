//! Wan 2.1 text-to-video (and each expert of Wan 2.2 A14B) on Wan 2.1's VAE, and Wan 2.2
//! TI2V-5B on Wan 2.2's 48-channel VAE: the video transformer trained by flow matching with a
//! discrete shift on the causal 3-D VAE's normalized latents, conditioned on umT5's states. An
//! image trains as a one-frame clip.
//!
//! Sources: `tiny` builds small random models seeded from the run's seed (on the CPU, then
//! copied to the device); `random:wan2.1-14b` / `random:wan2.1-1.3b` / `random:wan2.2-5b` the
//! full-size shapes with random weights; files are a diffusers pipeline folder
//! (`transformer/`, `vae/`, `text_encoder/`, tokenizer in `tokenizer/`), each component also
//! given on its own: the transformer as Wan-Video's or ComfyUI's single file, the VAE as
//! `Wan2.1_VAE` converted to safetensors (ComfyUI's `wan_2.1_vae.safetensors`) or a diffusers
//! VAE file (Wan 2.2's), umT5 as a transformers folder or single file. The VAE runs in f32, as
//! the other families' do.

use burn::backend::{Autodiff, Flex};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_diffusion::LoadError;
use burn_diffusion::pipeline::encode_wan_prompt;
use burn_diffusion::t5::{T5Config, T5Encoder};
use burn_diffusion::tokenize::CaptionTokenizer;
use burn_diffusion::wan::{
    WanCheckpoint, WanConfig, WanInput, WanTransformer3D, WanVae, WanVaeConfig,
};
use burn_diffusion::{BlockTape, materialize};
use burn_kernels::FusedOps;
use burn_lora::LayoutNames;
use burn_offload::{Offload, StreamTarget, WeightStream};

use super::flow::FlowPair;
use super::{
    Encoded, Family, Sample, Schema, TrainBackend, check_caption, encode_clips_by_bucket,
    encoder_stream, into_stream, load_denoiser, mse_gradients, random_model, source_name, streamed,
};
use crate::config::{ModelSource, TrainPlan};
use crate::dataset::Dataset;
use crate::error::TrainError;
use crate::models::{built_on_host, float_dtype};
use crate::rng::Rng;

/// umT5's caption length (`max_sequence_length` of Wan's pipeline).
const TEXT_TOKENS: usize = 512;
/// Caption length of the tiny model.
const TINY_TOKENS: usize = 16;
/// Captions encoded per batch.
const TEXT_BATCH: usize = 8;

/// A clip's encoding: the VAE's normalized latent, `[z, 1 + (frames − 1) / 4, h/c, w/c]` (`z`
/// 16 and `c` 8 for Wan 2.1's VAE, 48 and 16 for Wan 2.2's), in the model's dtype.
const LATENT: &str = "latent";
/// A caption's encoding: umT5's states over the caption's own tokens, `[tokens, 4096]`.
const STATES: &str = "states";

/// The components, as `model.<component>` and diffusers folders name them.
pub(super) const COMPONENTS: &[&str] = &["transformer", "vae", "text_encoder"];
/// The `random:` shapes.
pub(super) const RANDOM_SHAPES: &[&str] = &["wan2.1-14b", "wan2.1-1.3b", "wan2.2-5b"];
/// The tokenizer: umT5's, as in a diffusers folder.
pub(super) const TOKENIZERS: &[&str] = &["tokenizer"];

/// Latent channels of the tiny VAE and transformer.
const TINY_LATENT: usize = 4;
/// Width of the tiny umT5's states.
const TINY_TEXT: usize = 32;

/// The Wan family, for one model source.
#[derive(Clone, Debug)]
pub struct Wan {
    config: WanConfig,
    vae: WanVaeConfig,
}

impl Wan {
    /// The family of `source`'s transformer and VAE, their configurations read without loading
    /// weights; a VAE whose latent channels are not the transformer's is refused.
    pub fn of(source: &ModelSource) -> Result<Self, TrainError> {
        let (config, vae) = match source {
            ModelSource::Tiny => (tiny_transformer(), tiny_vae()),
            ModelSource::Random(shape) => match shape.as_str() {
                "wan2.1-1.3b" => (WanConfig::wan21_1_3b(), WanVaeConfig::wan21()),
                "wan2.2-5b" => (WanConfig::wan22_5b(), WanVaeConfig::wan22()),
                _ => (WanConfig::wan21_14b(), WanVaeConfig::wan21()),
            },
            ModelSource::Files(files) => {
                let transformer = WanCheckpoint::open(files.get("transformer"))?
                    .config()
                    .clone();
                let vae_path = files.get("vae");
                let vae = WanVaeConfig::of(vae_path)?;
                if vae.z_dim != transformer.in_channels {
                    return Err(LoadError::Config {
                        file: vae_path.to_path_buf(),
                        message: format!(
                            "a VAE of {} latent channels, but the transformer reads {}: Wan \
                             2.1's VAE (16) goes with Wan 2.1 and Wan 2.2 A14B, Wan 2.2's (48) \
                             with TI2V-5B",
                            vae.z_dim, transformer.in_channels
                        ),
                    }
                    .into());
                }
                (transformer, vae)
            }
        };
        Ok(Self { config, vae })
    }

    /// umT5 in the model's dtype on `device`; with a `stream`, its `Linear` weights are
    /// streamed weights in host memory instead (loaded or, for `random:`, made there).
    fn text_encoder<B: StreamTarget>(
        plan: &TrainPlan,
        device: &B::Device,
        stream: Option<&WeightStream<Offload<B>>>,
    ) -> Result<T5Encoder<Offload<B>>, TrainError> {
        let dtype = float_dtype(plan);
        let seed = plan.train.seed ^ 3;
        let umt5 = match &plan.model.source {
            ModelSource::Tiny => {
                let config = T5Config {
                    vocab_size: 4096,
                    d_model: TINY_TEXT,
                    d_kv: 8,
                    d_ff: 64,
                    num_layers: 2,
                    num_heads: 4,
                    relative_attention_num_buckets: 8,
                    relative_attention_max_distance: 16,
                    layer_norm_epsilon: 1e-6,
                    position_bias_per_layer: true,
                };
                built_on_host(seed, dtype, |h| config.init::<Flex>(h), config.init(device))
            }
            ModelSource::Random(_) => {
                Offload::<B>::seed(device, seed);
                random_model(
                    T5Config::umt5_xxl().init(device),
                    dtype,
                    seed,
                    stream,
                    "umT5",
                )?
            }
            ModelSource::Files(files) => {
                let path = files.get("text_encoder");
                match stream {
                    Some(stream) => {
                        T5Encoder::load_with(path, device, dtype, &mut into_stream(stream))?
                    }
                    None => T5Encoder::load(path, device, dtype)?,
                }
            }
        };
        Ok(match stream {
            Some(stream) => stream.stream_frozen(umt5)?,
            None => umt5,
        })
    }

    /// The VAE on `device` in `model.vae_dtype`: tiny, the model's shape with random weights,
    /// or the `vae` component.
    fn vae<B: FusedOps>(
        &self,
        plan: &TrainPlan,
        device: &B::Device,
    ) -> Result<WanVae<B>, TrainError> {
        let dtype = plan.model.vae_dtype;
        let seed = plan.train.seed ^ 1;
        B::seed(device, seed);
        let config = &self.vae;
        Ok(match &plan.model.source {
            ModelSource::Tiny => {
                built_on_host(seed, dtype, |h| config.init::<Flex>(h), config.init(device))
            }
            ModelSource::Random(_) => materialize(config.init::<B>(device), dtype),
            ModelSource::Files(files) => WanVae::load(files.get("vae"), device, dtype)?,
        })
    }
}

impl Family for Wan {
    type Model<B: Backend> = WanTransformer3D<B>;

    fn new(plan: &TrainPlan) -> Result<Self, TrainError> {
        Self::of(&plan.model.source)
    }

    fn lora_names(&self) -> LayoutNames {
        burn_diffusion::wan::lora_names(&self.config)
    }

    fn base_model_name(&self, plan: &TrainPlan) -> String {
        source_name(plan, "tiny", "transformer")
    }

    fn schema(&self) -> Schema {
        Schema {
            image: &[LATENT],
            caption: &[STATES],
        }
    }

    /// The VAE's downsampling times the patch: 16 pixels for Wan 2.1's VAE, 32 for Wan 2.2's.
    fn pixel_multiple(&self) -> usize {
        self.vae.spatial_compression() * self.config.patch_size[1]
    }

    /// Each clip through the VAE, one at a time: the latents of 81 frames at 480p are made
    /// chunk by chunk with the VAE's causal cache.
    fn encode_images<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        dataset: &Dataset,
        items: &[usize],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let vae = self.vae::<Offload<B>>(plan, device)?;
        let encoded = encode_clips_by_bucket::<Offload<B>>(dataset, items, device, |clip| {
            let latent = vae
                .encode_latents(clip.cast(DType::F32))
                .cast(plan.model.dtype)
                .squeeze_dim::<4>(0)
                .into_data();
            Encoded::from([(LATENT.to_string(), latent)])
        });
        drop(vae);
        Offload::<B>::memory_cleanup(device);
        encoded
    }

    fn encode_captions<B: StreamTarget>(
        &self,
        plan: &TrainPlan,
        texts: &[&str],
        device: &B::Device,
    ) -> Result<Vec<Encoded>, TrainError> {
        let tokenizer =
            CaptionTokenizer::t5(&plan.model.tokenizers.join("tokenizer"), text_tokens(plan))?;
        let stream = encoder_stream::<B>(plan, device)?;
        let umt5 = Self::text_encoder::<B>(plan, device, stream.as_ref())?;
        let states = streamed(stream.as_ref(), "umT5", || {
            encode_wan_prompt(&tokenizer, umt5, texts, TEXT_BATCH)
        })?;
        states
            .into_iter()
            .zip(texts)
            .map(|(states, text)| {
                check_caption("umT5", text, &states)?;
                Ok(Encoded::from([(STATES.to_string(), states)]))
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
    ) -> Result<WanTransformer3D<TrainBackend<B>>, TrainError> {
        load_denoiser(
            plan,
            device,
            stream,
            "transformer",
            |host| self.config.init::<Flex>(host),
            || self.config.init(device),
            |files, dtype, place| {
                let checkpoint = WanCheckpoint::open(files.get("transformer"))?;
                Ok(match place {
                    Some(place) => checkpoint.load_with(device, dtype, place)?,
                    None => checkpoint.load(device, dtype)?,
                })
            },
        )
    }

    /// Flow matching: σ drawn for each sample (by default uniform, shifted by
    /// `train.timestep_shift`, musubi-tuner's `discrete_flow_shift`), the noise on the CPU; the
    /// model sees `x_t = (1 − σ)·x₀ + σ·noise` at timestep `1000·σ` and the caption's states
    /// padded with zeros to the pipeline's length, and is trained to predict `noise − x₀`
    /// (mean squared error over the latent, in f32).
    fn loss<B: FusedOps>(
        &self,
        plan: &TrainPlan,
        transformer: &WanTransformer3D<Autodiff<B>>,
        batch: &[Sample<'_>],
        rng: &mut Rng,
        device: &B::Device,
    ) -> (f64, GradientsParams) {
        let latents = batch
            .iter()
            .map(|s| Tensor::<B, 4>::from_data(s.image[LATENT].clone(), device).cast(DType::F32))
            .collect();
        let x0 = Tensor::stack::<5>(latents, 0);
        let shape = x0.dims();
        let [n, channels, frames, h, w] = shape;
        let [pt, ph, pw] = self.config.patch_size;
        let tokens = frames / pt * (h / ph) * (w / pw);
        let sigmas: Vec<f32> = (0..n)
            .map(|_| {
                plan.train
                    .timestep_range
                    .sample(plan.train.timestep, tokens, rng) as f32
            })
            .collect();
        let pair = FlowPair::new(
            x0.reshape([n, channels, frames * h * w]),
            sigmas,
            rng,
            device,
        );

        let dtype = plan.model.dtype;
        let text_length = text_tokens(plan);
        let states = batch
            .iter()
            .map(|s| padded_states::<B>(&s.caption[STATES], text_length, device))
            .collect();
        let input = WanInput {
            hidden_states: Tensor::from_inner(pair.x_t.reshape(shape).cast(dtype)),
            timestep: Tensor::from_inner(pair.sigma * 1000.0),
            encoder_hidden_states: Tensor::from_inner(Tensor::stack::<3>(states, 0).cast(dtype)),
        };
        let mut tape = BlockTape::new(plan.train.gradient_checkpointing);
        let prediction = transformer.forward_with(input, &mut tape);
        mse_gradients(
            prediction,
            pair.target.reshape(shape),
            None,
            tape,
            transformer,
        )
    }
}

/// The caption length: umT5's 512, or the tiny model's.
fn text_tokens(plan: &TrainPlan) -> usize {
    match plan.model.source {
        ModelSource::Tiny => TINY_TOKENS,
        _ => TEXT_TOKENS,
    }
}

/// A caption's states `[tokens, width]` padded with zero rows to `length`.
fn padded_states<B: Backend>(
    states: &TensorData,
    length: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
    let states = Tensor::<B, 2>::from_data(states.clone(), device);
    let [tokens, width] = states.dims();
    if tokens >= length {
        return states.narrow(0, 0, length);
    }
    let zeros = Tensor::zeros([length - tokens, width], (device, states.dtype()));
    Tensor::cat(vec![states, zeros], 0)
}

/// The VAE of `model.path: tiny`: Wan 2.1's at base width 8, with as many latent channels as
/// the tiny transformer reads.
fn tiny_vae() -> WanVaeConfig {
    let wan21 = WanVaeConfig::wan21();
    WanVaeConfig {
        base_dim: 8,
        z_dim: TINY_LATENT,
        latents_mean: wan21.latents_mean[..TINY_LATENT].to_vec(),
        latents_std: wan21.latents_std[..TINY_LATENT].to_vec(),
        ..wan21
    }
}

/// The transformer of `model.path: tiny`: Wan's blocks at width 24 (two heads of 12), on the
/// tiny VAE's latents and the tiny umT5's states.
fn tiny_transformer() -> WanConfig {
    WanConfig {
        num_attention_heads: 2,
        attention_head_dim: 12,
        in_channels: TINY_LATENT,
        out_channels: TINY_LATENT,
        text_dim: TINY_TEXT,
        freq_dim: 16,
        ffn_dim: 32,
        num_layers: 2,
        rope_max_seq_len: 64,
        ..WanConfig::wan21_14b()
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::config::ModelFiles;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../burn-diffusion/tests/fixtures")
            .join(name)
    }

    #[test]
    fn ti2v_5b_takes_wan_2_2s_vae_and_buckets_of_32_pixels() {
        let of = |shape: &str| Wan::of(&ModelSource::Random(shape.into())).unwrap();
        let five = of("wan2.2-5b");
        assert_eq!(
            (five.config.num_layers, five.config.inner_dim()),
            (30, 3072)
        );
        assert_eq!((five.config.in_channels, five.vae.z_dim), (48, 48));
        assert_eq!(five.pixel_multiple(), 32);
        let fourteen = of("wan2.1-14b");
        assert_eq!((fourteen.config.in_channels, fourteen.vae.z_dim), (16, 16));
        assert_eq!(fourteen.pixel_multiple(), 16);
    }

    #[test]
    fn a_vae_of_other_latent_channels_than_the_transformer_is_refused_by_name() {
        let vae = fixture("wan_vae22");
        let files = ModelFiles::pipeline(&fixture("wan"), COMPONENTS).with("vae", vae.clone());
        let error = Wan::of(&ModelSource::Files(files)).unwrap_err().to_string();
        assert!(error.contains(&vae.display().to_string()), "{error}");
        assert!(error.contains("8 latent channels"), "{error}");
    }
}
