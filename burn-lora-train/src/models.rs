//! The models of a run, by [`ModelSource`]: the frozen encoders, used once to fill the caches
//! and dropped, and the transformer that gets the adapters.
//!
//! `tiny` builds small random models seeded from the run's seed; `random:` builds full-size ones
//! on the device (random weights, for measuring speed and memory without the real files);
//! a diffusers folder is loaded with burn-diffusion's loaders. Every float parameter is brought
//! to the model's dtype.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};
use burn_diffusion::clip::{ClipActivation, ClipTextConfig, ClipTextModel};
use burn_diffusion::flux::{Flux, FluxCheckpoint, FluxConfig};
use burn_diffusion::materialize;
use burn_diffusion::t5::{T5Config, T5Encoder};
use burn_diffusion::tokenize::CaptionTokenizer;
use burn_diffusion::vae::{AutoencoderKl, VaeCheckpoint, VaeConfig};
use burn_kernels::Kernels;
use burn_lora::LayoutNames;
use burn_offload::{Offload, OffloadConfig, StreamTarget, WeightStream, WireFormat};
use burn_quant::Fp8Format;

use crate::config::{ModelSource, TrainPlan};
use crate::train::{TrainBackend, TrainError};

/// Caption length of the tiny model's CLIP and T5.
const TINY_TOKENS: usize = 16;
/// CLIP's caption length in the FLUX.1 pipeline.
const CLIP_TOKENS: usize = 77;

/// CLIP-L and T5 with their tokenizers.
pub(crate) struct TextEncoders<B: Backend> {
    pub clip: ClipTextModel<B>,
    pub t5: T5Encoder<B>,
    pub clip_tokenizer: CaptionTokenizer,
    pub t5_tokenizer: CaptionTokenizer,
}

/// The transformer's configuration, without loading its weights.
pub(crate) fn flux_config(plan: &TrainPlan) -> Result<FluxConfig, TrainError> {
    source_config(&plan.model.source)
}

/// The names the adapted layers of `source`'s transformer take in every LoRA file layout,
/// read without loading its weights.
pub fn lora_names(source: &ModelSource) -> Result<LayoutNames, TrainError> {
    Ok(burn_diffusion::flux::lora_names(&source_config(source)?))
}

fn source_config(source: &ModelSource) -> Result<FluxConfig, TrainError> {
    Ok(match source {
        ModelSource::Tiny => FluxConfig::new(64, 64, 32, 32, 32, 2, 2, 2, vec![4, 6, 6], true),
        ModelSource::Random { guidance: true } => FluxConfig::dev(),
        ModelSource::Random { guidance: false } => FluxConfig::schnell(),
        ModelSource::Files(files) => FluxCheckpoint::open(&files.transformer)?.config().clone(),
    })
}

/// The text encoders in the model's dtype, on `device`; with a `stream`, T5's `Linear` weights
/// are streamed weights in host memory instead (loaded there directly from files).
pub(crate) fn text_encoders<B: StreamTarget>(
    plan: &TrainPlan,
    device: &B::Device,
    stream: Option<&WeightStream<Offload<B>>>,
) -> Result<TextEncoders<Offload<B>>, TrainError> {
    let t5_tokens = match &plan.model.source {
        ModelSource::Tiny => TINY_TOKENS,
        // FluxPipeline's max_sequence_length: 512 for dev, 256 for schnell.
        _ if flux_config(plan)?.guidance_embed => 512,
        _ => 256,
    };
    let clip_tokens = match plan.model.source {
        ModelSource::Tiny => TINY_TOKENS,
        _ => CLIP_TOKENS,
    };
    let folder = &plan.model.tokenizers;
    let clip_tokenizer = CaptionTokenizer::clip(&folder.join("tokenizer"), clip_tokens)?;
    let t5_tokenizer = CaptionTokenizer::t5(&folder.join("tokenizer_2"), t5_tokens)?;
    let dtype = float_dtype(plan);
    let seed = plan.train.seed;
    let (clip, t5) = match &plan.model.source {
        ModelSource::Tiny => {
            Offload::<B>::seed(device, seed ^ 2);
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
            }
            .init(device);
            let clip = materialize(clip, dtype);
            Offload::<B>::seed(device, seed ^ 3);
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
            }
            .init(device);
            (clip, materialize(t5, dtype))
        }
        ModelSource::Random { .. } => {
            Offload::<B>::seed(device, seed ^ 2);
            let clip = materialize(ClipTextConfig::clip_l().init(device), dtype);
            Offload::<B>::seed(device, seed ^ 3);
            (clip, materialize(T5Config::xxl().init(device), dtype))
        }
        ModelSource::Files(files) => {
            let clip = ClipTextModel::load(&files.text_encoder, device, dtype)?;
            let path = &files.text_encoder_2;
            let t5 = match stream {
                Some(stream) => T5Encoder::load_with(path, device, dtype, &mut |name, data| {
                    stream
                        .streamed_tensor::<2>(name, data)
                        .map_err(|e| e.to_string())
                })?,
                None => T5Encoder::load(path, device, dtype)?,
            };
            (clip, t5)
        }
    };
    let t5 = match stream {
        Some(stream) => stream.stream_frozen(t5)?,
        None => t5,
    };
    Ok(TextEncoders {
        clip,
        t5,
        clip_tokenizer,
        t5_tokenizer,
    })
}

/// The VAE, on `device` in f32 whatever the model's dtype, as kohya's `--no_half_vae` and
/// diffusers' `force_upcast` run it: it encodes each image once (the latents are cached), and in
/// bf16 on CUDA Burn 0.21's convolution turns part of the first layer's output (3 input
/// channels) into NaN (benches/RESULTS.md, `examples/vae_check.rs`).
pub(crate) fn vae<B: Kernels>(
    plan: &TrainPlan,
    device: &B::Device,
) -> Result<AutoencoderKl<B>, TrainError> {
    let dtype = FloatDType::F32;
    B::seed(device, plan.train.seed ^ 1);
    Ok(match &plan.model.source {
        ModelSource::Tiny => {
            let config = VaeConfig {
                block_out_channels: vec![8, 8, 8, 8],
                layers_per_block: 1,
                norm_num_groups: 4,
                ..VaeConfig::flux()
            };
            materialize(config.init::<B>(device), dtype)
        }
        ModelSource::Random { .. } => materialize(VaeConfig::flux().init::<B>(device), dtype),
        ModelSource::Files(files) => VaeCheckpoint::open(&files.vae)?.load(device, dtype)?,
    })
}

/// The transformer in the model's dtype, every parameter frozen. Loaded from files with a
/// `stream`, its weight matrices go straight to host memory as streamed weights, so that a
/// model larger than the device loads; otherwise, and for random models (created on the
/// device), they are on `device`.
pub(crate) fn transformer<B: StreamTarget>(
    plan: &TrainPlan,
    device: &B::Device,
    stream: Option<&WeightStream<TrainBackend<B>>>,
) -> Result<Flux<TrainBackend<B>>, TrainError> {
    let dtype = float_dtype(plan);
    TrainBackend::<B>::seed(device, plan.train.seed ^ 4);
    let flux = match (&plan.model.source, stream) {
        (ModelSource::Files(files), Some(stream)) => FluxCheckpoint::open(&files.transformer)?
            .load_with(device, dtype, &mut |name, data| {
                stream
                    .streamed_tensor::<2>(name, data)
                    .map_err(|e| e.to_string())
            })?,
        (ModelSource::Files(files), None) => Flux::load(&files.transformer, device, dtype)?,
        _ => materialize(flux_config(plan)?.init(device), dtype),
    };
    Ok(flux.no_grad())
}

/// The weight stream's configuration, or `None` when every weight stays on the device.
pub(crate) fn offload_config(plan: &TrainPlan) -> Option<OffloadConfig> {
    let model = &plan.model;
    if model.vram_budget_bytes.is_none() && model.wire.is_none() {
        return None;
    }
    let wire = match model.wire {
        None => WireFormat::Native,
        Some(Fp8Format::E5M2) => WireFormat::E5M2,
        Some(Fp8Format::E4M3) => WireFormat::E4M3,
    };
    Some(
        OffloadConfig::default()
            .with_vram_budget(model.vram_budget_bytes.unwrap_or(u64::MAX))
            .with_ring_slots(model.ring_slots)
            .with_wire(wire),
    )
}

/// The base model's float dtype.
fn float_dtype(plan: &TrainPlan) -> FloatDType {
    match plan.model.dtype {
        DType::BF16 => FloatDType::BF16,
        DType::F16 => FloatDType::F16,
        _ => FloatDType::F32,
    }
}

/// Creates every lazily initialized parameter of `module` now.
pub(crate) fn initialize<B: Backend, M: Module<B>>(module: &M) {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}
