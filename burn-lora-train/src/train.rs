//! The training loop of `burnlora train`: flow matching on FLUX.1 with LoRA adapters, from a
//! [`TrainPlan`] to LoRA files in the run folder.
//!
//! Each optimizer step runs `gradient_accumulation_steps` micro-batches. For each micro-batch
//! the images are encoded by the VAE (the distribution's mode, normalized, packed 2×2 into
//! tokens), then σ is drawn for each sample and the noise for the batch, both from the run's
//! [`Rng`] in that order (noise through `B::seed(device, rng.next_u64())`), so that a resumed
//! run draws what the uninterrupted one would have drawn. The model sees
//! `x_t = (1 − σ)·x₀ + σ·noise` at timestep σ and is trained to predict `noise − x₀` (mean
//! squared error over the packed latents). Captions are encoded once, before the first step.
//!
//! A step whose loss or gradient is not finite is skipped; after `train.max_nan_steps` of them
//! in a row the run stops. A checkpoint (LoRA file plus optimizer and data state) is written
//! every `save.save_every` steps, at the last step, and when the run stops early; resuming
//! restores the adapters from the optimizer's exact f32 copies, never from the (possibly bf16)
//! LoRA file.
//!
//! So far the loop trains the `tiny` model only (in f32, the encoders on the same device), and
//! latents are not cached on disk (`cache_latents_to_disk` is ignored with a warning).

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::backend::Autodiff;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, ElementConversion, Tensor, TensorData};
use burn_diffusion::clip::{ClipActivation, ClipTextConfig, ClipTextModel};
use burn_diffusion::flux::{Flux, FluxConfig, FluxInput};
use burn_diffusion::pipeline::{encode_clip_pooled, encode_t5, image_ids, pack_latents, text_ids};
use burn_diffusion::t5::{T5Config, T5Encoder};
use burn_diffusion::tokenize::CaptionTokenizer;
use burn_diffusion::vae::{AutoencoderKl, VaeConfig};
use burn_diffusion::{BlockTape, Checkpointing, LoadError};
use burn_lora::{LoraError, LoraMetadata, SaveOptions};

use crate::checkpoint::{CheckpointError, RunDir, TrainingState};
use crate::config::{ModelSource, TrainPlan};
use crate::dataset::{Batch, DataPosition, Dataset, DatasetError};
use crate::optim::{AdamW, AdamWConfig, LrSchedule, OptimError};
use crate::report::{LossLog, LossRow, Progress, ReportError, StopFlag, plot_loss};
use crate::rng::Rng;

/// Folder of the tiny model's tokenizers, next to the configuration file: `clip/` and `t5/`,
/// each with a `tokenizer.json`.
pub const TINY_TOKENIZERS: &str = "tokenizers";
/// Caption length of the tiny model's CLIP and T5.
const TINY_TOKENS: usize = 16;

/// Why a training run failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The run folder or a checkpoint.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The images or captions.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The saved optimizer state does not fit the model.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// Logs, loss CSV or plot.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// The adapters (plan or LoRA file).
    #[error(transparent)]
    Lora(#[from] LoraError),
    /// Tokenizers or encoders.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// `--resume` was asked for but the run folder has no valid checkpoint.
    #[error("{dir}: no checkpoint to resume from")]
    NothingToResume {
        /// The run folder.
        dir: PathBuf,
    },
    /// The newest checkpoint was made with settings that shape training differently.
    #[error(
        "{dir}: the checkpoint was made with another configuration (fingerprint {found}, this one is {expected}); use another run name"
    )]
    ConfigChanged {
        /// The run folder.
        dir: PathBuf,
        /// Fingerprint of this configuration.
        expected: String,
        /// Fingerprint saved with the checkpoint.
        found: String,
    },
    /// The model source is not supported by this loop yet.
    #[error("model.path {0}: only `tiny` can be trained so far")]
    UnsupportedModel(PathBuf),
    /// Too many consecutive steps had a non-finite loss or gradient (a checkpoint of the last
    /// step was written).
    #[error("{0} consecutive steps with a non-finite loss or gradient")]
    NonFinite(usize),
}

/// Whether to continue from a checkpoint of the run folder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// From the newest valid checkpoint when there is one, else from the start.
    Auto,
    /// From the newest valid checkpoint; [`TrainError::NothingToResume`] when there is none.
    Required,
}

/// What a run did.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSummary {
    /// The step the run began at (0, or the resumed checkpoint's).
    pub started_at: u64,
    /// The last step done.
    pub step: u64,
    /// The loss of each step this run did (not finite for skipped steps).
    pub losses: Vec<f64>,
    /// The newest LoRA file.
    pub lora: Option<PathBuf>,
}

/// The frozen encoders and the transformer of one run.
struct Models<B: Backend> {
    flux: Flux<Autodiff<B>>,
    vae: AutoencoderKl<B>,
    clip: ClipTextModel<B>,
    t5: T5Encoder<B>,
    clip_tokenizer: CaptionTokenizer,
    t5_tokenizer: CaptionTokenizer,
}

/// A caption's encodings: pooled CLIP vector `[vec_in_dim]`, T5 states `[tokens, context]`.
#[derive(Clone)]
struct Caption {
    pooled: TensorData,
    states: TensorData,
}

/// Trains the adapters of `plan` on `device` (the loop of `burnlora train`): creates or resumes
/// the run folder, writes checkpoints and the loss CSV and plot, and stops early, with a
/// checkpoint, when `stop` is set.
///
/// The noise comes from the backend's random generator, which is global to the process: a
/// run is reproducible (and its resumption exact) only while no other code draws from that
/// generator at the same time.
pub fn train<B: Backend>(
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    device: &B::Device,
) -> Result<TrainSummary, TrainError> {
    let run = RunDir::create(plan.run_dir(), &plan.name)?;
    if plan.datasets.iter().any(|d| d.cache_to_disk) {
        tracing::warn!("cache_latents_to_disk is not supported yet: images are encoded each step");
    }
    let dataset = Dataset::scan(&plan.datasets)?;
    let models = tiny_models::<B>(plan, device)?;
    B::seed(device, plan.train.seed);
    let (mut flux, applied) = plan.network.lora.apply(models.flux);
    initialize(&flux);
    tracing::info!(
        "{} layers adapted, {} trainable parameters",
        applied.count(),
        applied.params()
    );

    let mut texts: Vec<&str> = dataset.items().iter().map(|i| i.caption.as_str()).collect();
    texts.push("");
    let pooled = encode_clip_pooled(&models.clip_tokenizer, models.clip, &texts, 8)?;
    let states = encode_t5(&models.t5_tokenizer, models.t5, &texts, 8)?;
    let captions: Vec<Caption> = pooled
        .into_iter()
        .zip(states)
        .map(|(pooled, states)| Caption { pooled, states })
        .collect();

    let schedule = LrSchedule::from_settings(&plan.train);
    let mut optimizer = AdamW::<B>::new(AdamWConfig::from_settings(&plan.train));
    let mut rng = Rng::seeded(plan.train.seed);
    let mut position = DataPosition::default();
    let mut step = 0;
    match run.resume()? {
        Some((checkpoint, state)) => {
            if state.config_fingerprint != plan.resume_fingerprint() {
                return Err(TrainError::ConfigChanged {
                    dir: run.path().to_path_buf(),
                    expected: plan.resume_fingerprint(),
                    found: state.config_fingerprint,
                });
            }
            flux = optimizer.restore(flux, state.optimizer_steps, state.optimizer)?;
            rng = Rng::from_state(state.rng);
            position = state.data;
            step = state.step;
            tracing::info!("resuming from {} (step {step})", checkpoint.state.display());
        }
        None if resume == Resume::Required => {
            return Err(TrainError::NothingToResume {
                dir: run.path().to_path_buf(),
            });
        }
        None => {}
    }

    let started_at = step;
    let mut batches = dataset.batches(plan.train.seed, plan.train.batch_size, position);
    let mut loss_log = LossLog::open(run.path(), started_at)?;
    let mut progress = Progress::new(plan.train.steps, started_at, plan.logging.progress_bar);
    let mut summary = TrainSummary {
        started_at,
        step,
        losses: Vec::new(),
        lora: None,
    };
    let mut non_finite = 0;
    while step < plan.train.steps {
        let start = Instant::now();
        let lr = schedule.lr(step);
        let mut accumulator = GradientsAccumulator::<Flux<Autodiff<B>>>::new();
        let mut loss_sum = 0.0;
        for _ in 0..plan.train.gradient_accumulation_steps {
            let batch = batches.next().expect("a scanned dataset yields batches");
            let (loss, grads) = micro_step(
                plan,
                &dataset,
                &models.vae,
                &captions,
                &flux,
                &batch,
                &mut rng,
                device,
            )?;
            loss_sum += loss;
            accumulator.accumulate(&flux, grads);
        }
        let loss = loss_sum / plan.train.gradient_accumulation_steps as f64;
        let (updated, stepped) = optimizer.step(flux, accumulator.grads(), lr);
        flux = updated;
        step += 1;
        if stepped.applied && loss.is_finite() {
            non_finite = 0;
        } else {
            non_finite += 1;
            tracing::warn!(
                "step {step}: loss {loss}, gradient norm {}: skipped",
                stepped.grad_norm
            );
        }
        let seconds = start.elapsed().as_secs_f64();
        summary.losses.push(loss);
        summary.step = step;
        progress.step(step, loss, lr, seconds, "");
        if step % plan.logging.every == 0 || step == plan.train.steps {
            tracing::info!("step {step}: loss {loss:.5}, lr {lr:.3e}, {seconds:.2} s");
            loss_log.append(LossRow {
                step,
                loss,
                lr,
                seconds,
            })?;
        }
        let diverged = non_finite >= plan.train.max_nan_steps;
        let stopping = stop.is_set() || diverged;
        if step % plan.save.every == 0 || step == plan.train.steps || stopping {
            let state = TrainingState {
                step,
                data: batches.position(),
                rng: rng.state(),
                config_fingerprint: plan.resume_fingerprint(),
                extra: serde_json::json!({ "loss": loss }),
                optimizer_steps: optimizer.steps(),
                optimizer: optimizer.to_tensors(&flux),
            };
            let set = burn_lora::export(
                &flux,
                LoraMetadata {
                    base_model: Some(base_model_name(plan)),
                    step: Some(step),
                    extra: [("burnlora.config".to_string(), plan.to_json())].into(),
                },
            );
            let options = SaveOptions {
                dtype: Some(plan.save.dtype),
                ..SaveOptions::for_format(plan.save.format)
            };
            let saved = run.save(&state, plan.save.keep, |tmp| {
                burn_lora::save(&set, tmp, &options)
            })?;
            loss_log.sync()?;
            plot_loss(loss_log.rows(), &run.path().join(crate::report::LOSS_PNG))?;
            tracing::info!("saved {}", saved.lora.display());
            summary.lora = Some(saved.lora);
        }
        if diverged {
            return Err(TrainError::NonFinite(non_finite));
        }
        if stopping {
            tracing::warn!("stopped at step {step}");
            break;
        }
    }
    progress.finish();
    Ok(summary)
}

/// The name recorded as the LoRA file's base model.
fn base_model_name(plan: &TrainPlan) -> String {
    match &plan.model.source {
        ModelSource::Tiny => "tiny".to_string(),
        ModelSource::Path(path) => path.display().to_string(),
    }
}

/// One micro-batch: its loss and the gradients of the adapters.
#[allow(clippy::too_many_arguments)]
fn micro_step<B: Backend>(
    plan: &TrainPlan,
    dataset: &Dataset,
    vae: &AutoencoderKl<B>,
    captions: &[Caption],
    flux: &Flux<Autodiff<B>>,
    batch: &Batch,
    rng: &mut Rng,
    device: &B::Device,
) -> Result<(f64, GradientsParams), TrainError> {
    let empty = captions.len() - 1;
    let mut pixels = Vec::with_capacity(batch.samples.len());
    let (mut pooled, mut states) = (Vec::new(), Vec::new());
    for sample in &batch.samples {
        let item = &dataset.items()[sample.item];
        pixels.push(Tensor::<B, 3>::from_data(item.load_pixels()?, device));
        let caption = &captions[if sample.drop_caption {
            empty
        } else {
            sample.item
        }];
        pooled.push(Tensor::<B, 1>::from_data(caption.pooled.clone(), device));
        states.push(Tensor::<B, 2>::from_data(caption.states.clone(), device));
    }
    let latents = vae.normalize_latents(vae.encode(Tensor::stack(pixels, 0)).mode());
    let [n, _, h, w] = latents.dims();
    let x0 = pack_latents(latents);

    let sigmas: Vec<f32> = (0..n)
        .map(|_| plan.train.timestep.sample(rng) as f32)
        .collect();
    B::seed(device, rng.next_u64());
    let noise = Tensor::<B, 3>::random(x0.shape(), Distribution::Normal(0.0, 1.0), device);
    let sigma = Tensor::<B, 1>::from_data(TensorData::new(sigmas, [n]), device);
    let s = sigma.clone().reshape([n, 1, 1]);
    let x_t = x0.clone() * (s.clone().neg() + 1.0) + noise.clone() * s;
    let target = noise - x0;

    let txt: Tensor<B, 3> = Tensor::stack(states, 0);
    let txt_len = txt.dims()[1];
    let config = flux.config();
    let input = FluxInput {
        img: Tensor::from_inner(x_t),
        txt: Tensor::from_inner(txt),
        y: Tensor::from_inner(Tensor::stack(pooled, 0)),
        timesteps: Tensor::from_inner(sigma),
        guidance: config
            .guidance_embed
            .then(|| Tensor::from_inner(Tensor::full([n], plan.train.guidance_scale, device))),
        img_ids: image_ids(h, w),
        txt_ids: text_ids(txt_len),
    };
    let checkpointing = if plan.train.gradient_checkpointing {
        Checkpointing::Blocks
    } else {
        Checkpointing::Off
    };
    let mut tape = BlockTape::new(checkpointing);
    let prediction = flux.forward_with(input, &mut tape);
    let loss = (prediction - Tensor::from_inner(target))
        .powi_scalar(2)
        .mean();
    let value = loss.clone().into_scalar().elem::<f64>();
    let grads = GradientsParams::from_grads(tape.backward(&loss, flux), flux);
    Ok((value, grads))
}

/// The tiny model: a small random FLUX.1 (guidance-distilled, as dev) with a small random VAE,
/// CLIP and T5, each seeded from the run's seed; the tokenizers are read from
/// [`TINY_TOKENIZERS`] next to the configuration file.
fn tiny_models<B: Backend>(plan: &TrainPlan, device: &B::Device) -> Result<Models<B>, TrainError> {
    let folder = match &plan.model.source {
        ModelSource::Tiny => plan
            .file
            .parent()
            .unwrap_or(Path::new("."))
            .join(TINY_TOKENIZERS),
        ModelSource::Path(path) => return Err(TrainError::UnsupportedModel(path.clone())),
    };
    let clip_tokenizer = CaptionTokenizer::clip(&folder.join("clip"), TINY_TOKENS)?;
    let t5_tokenizer = CaptionTokenizer::t5(&folder.join("t5"), TINY_TOKENS)?;
    let seed = plan.train.seed;

    B::seed(device, seed ^ 1);
    let vae = VaeConfig {
        block_out_channels: vec![8, 8, 8, 8],
        layers_per_block: 1,
        norm_num_groups: 4,
        ..VaeConfig::flux()
    }
    .init::<B>(device);
    initialize(&vae);
    B::seed(device, seed ^ 2);
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
    .init::<B>(device);
    initialize(&clip);
    B::seed(device, seed ^ 3);
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
    .init::<B>(device);
    initialize(&t5);
    B::seed(device, seed ^ 4);
    let flux = FluxConfig::new(64, 64, 32, 32, 32, 2, 2, 2, vec![4, 6, 6], true)
        .init::<Autodiff<B>>(device);
    initialize(&flux);
    Ok(Models {
        flux,
        vae,
        clip,
        t5,
        clip_tokenizer,
        t5_tokenizer,
    })
}

/// Creates every lazily initialized parameter of `module` now, so that the values do not
/// depend on when the device's random generator is next reseeded.
fn initialize<B: Backend, M: Module<B>>(module: &M) {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}
