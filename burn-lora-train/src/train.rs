//! The training loop of `burnlora train`: flow matching on FLUX.1 with LoRA adapters, from a
//! [`TrainPlan`] to LoRA files in the run folder.
//!
//! Before the first step the images and captions become latents and text encodings
//! ([`crate::cache`]: read from the caches beside the images, or computed with the VAE and the
//! text encoders, which are dropped before the transformer is loaded). The transformer runs on
//! `Autodiff<Offload<B>>`: with `model.offload` or `model.quantize` set, its frozen weights move
//! to host memory and stream to the device through burn-offload (within the VRAM budget, FP8 on
//! the bus when asked); otherwise they stay on the device and the decorator only forwards.
//!
//! Each optimizer step runs `gradient_accumulation_steps` micro-batches. For each, σ is drawn
//! for each sample and the noise for the batch, both from the run's [`Rng`] in that order
//! (noise through `B::seed(device, rng.next_u64())`), so that a resumed run draws what the
//! uninterrupted one would have drawn. The model sees `x_t = (1 − σ)·x₀ + σ·noise` at timestep
//! σ and is trained to predict `noise − x₀` (mean squared error over the packed latents, in
//! f32).
//!
//! A step whose loss or gradient is not finite is skipped; after `train.max_nan_steps` of them
//! in a row the run stops. A checkpoint (LoRA file plus optimizer and data state) is written
//! every `save.save_every` steps, at the last step, and when the run stops early; resuming
//! restores the adapters from the optimizer's exact f32 copies, never from the (possibly bf16)
//! LoRA file.

use burn_kernels::FusedOps;
use std::path::PathBuf;
use std::time::Instant;

use burn::backend::Autodiff;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, ElementConversion, Tensor, TensorData};
use burn_diffusion::flux::{Flux, FluxInput};
use burn_diffusion::pipeline::{image_ids, pack_latents, text_ids};
use burn_diffusion::{BlockTape, Checkpointing, LoadError};
use burn_lora::{LoraError, LoraMetadata, SaveOptions};
use burn_offload::{Offload, OffloadError, StreamTarget, WeightStream};

use crate::cache::{self, Prepared};
use crate::checkpoint::{CheckpointError, RunDir, TrainingState};
use crate::config::{ModelSource, TrainPlan};
use crate::dataset::{Batch, DataPosition, Dataset, DatasetError};
use crate::models;
use crate::optim::{AdamW, AdamWConfig, LrSchedule, OptimError};
use crate::report::{LossLog, LossRow, Progress, ReportError, StopFlag, plot_loss};
use crate::rng::Rng;

/// The backend the transformer trains on, over the computing backend `B`.
pub type TrainBackend<B> = Autodiff<Offload<B>>;

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
    /// Tokenizers or model files.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Streaming the frozen weights.
    #[error(transparent)]
    Offload(#[from] OffloadError),
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
    /// An encoder turned an image or a caption into non-finite values: every step that drew
    /// it would be skipped. Nothing is cached.
    #[error(
        "{encoder} produced non-finite values for {input}; check the model files and their dtype"
    )]
    NonFiniteEncoding {
        /// "the VAE", "CLIP" or "T5".
        encoder: &'static str,
        /// The image file, or the caption.
        input: String,
    },
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

/// Trains the adapters of `plan` on `device` (the loop of `burnlora train`): creates or resumes
/// the run folder, writes checkpoints and the loss CSV and plot, and stops early, with a
/// checkpoint, when `stop` is set.
///
/// The noise comes from the backend's random generator, which is global to the process: a
/// run is reproducible (and its resumption exact) only while no other code draws from that
/// generator at the same time.
pub fn train<B: StreamTarget>(
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    device: &B::Device,
) -> Result<TrainSummary, TrainError> {
    let _kernels = plan.kernels.install();
    tracing::info!("kernels: {}", plan.kernels);
    let run = RunDir::create(plan.run_dir(), &plan.name)?;
    let dataset = Dataset::scan(&plan.datasets)?;
    let prepared = cache::prepare::<B>(plan, &dataset, device)?;

    let start = Instant::now();
    let stream = models::offload_config(plan)
        .map(|config| WeightStream::<TrainBackend<B>>::new(device, config))
        .transpose()?;
    let flux = models::transformer::<B>(plan, device, stream.as_ref())?;
    let names = burn_diffusion::flux::lora_names(flux.config());
    let flux = match &plan.network.pretrained {
        Some(path) => {
            let set = names.load(path)?.with_dtype(plan.model.dtype);
            let (flux, report) = burn_lora::load_adapters(flux, set)?;
            tracing::info!("{}: {report}", path.display());
            flux
        }
        None => flux,
    };
    B::seed(device, plan.train.seed);
    let (mut flux, applied) = plan.network.lora.apply(flux);
    names.map(plan.save.format).check(&applied)?;
    models::initialize(&flux);
    tracing::info!(
        "{} layers adapted, {} trainable parameters",
        applied.count(),
        applied.params()
    );
    if let Some(stream) = &stream {
        flux = stream.stream_frozen(flux)?;
        TrainBackend::<B>::memory_cleanup(device);
    }
    tracing::info!(
        "transformer ready in {:.1} s{}",
        start.elapsed().as_secs_f64(),
        if stream.is_some() {
            ", frozen weights in host memory"
        } else {
            ""
        }
    );

    let schedule = LrSchedule::from_settings(&plan.train);
    let mut optimizer = AdamW::<Offload<B>>::new(AdamWConfig::from_settings(&plan.train));
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
        let mut accumulator = GradientsAccumulator::<Flux<TrainBackend<B>>>::new();
        let mut loss_sum = 0.0;
        let mut memory = String::new();
        for _ in 0..plan.train.gradient_accumulation_steps {
            let batch = batches.next().expect("a scanned dataset yields batches");
            if let Some(stream) = &stream {
                stream.begin_step();
            }
            let (loss, grads) = micro_step(plan, &prepared, &flux, &batch, &mut rng, device);
            if let Some(stream) = &stream {
                memory = describe(&stream.end_step());
            }
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
        if memory.is_empty() {
            memory = gigabytes(B::memory_in_use(device));
        }
        progress.step(step, loss, lr, seconds, &memory);
        if step % plan.logging.every == 0 || step == plan.train.steps {
            tracing::info!(
                "step {step}: loss {loss:.5}, lr {lr:.3e}, {seconds:.2} s, device memory {memory}"
            );
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
                    extra: [
                        ("burnlora.config".to_string(), plan.to_json()),
                        ("burnlora.kernels".to_string(), plan.kernels.to_string()),
                    ]
                    .into(),
                },
            );
            let options = SaveOptions {
                dtype: Some(plan.save.dtype),
                ..SaveOptions::for_format(plan.save.format)
            };
            let saved = run.save(&state, plan.save.keep, |tmp| {
                names.save(&set, tmp, &options)
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
        ModelSource::Random { guidance: true } => "random:flux1-dev".to_string(),
        ModelSource::Random { guidance: false } => "random:flux1-schnell".to_string(),
        ModelSource::Files(files) => files.transformer.display().to_string(),
    }
}

/// A step's streaming in a few words: device memory, upload volume and rate.
fn describe(stats: &burn_offload::StepStats) -> String {
    format!(
        "{} (streamed {:.1} GB at {:.1} GB/s)",
        gigabytes(stats.peak_device_bytes),
        stats.bytes_uploaded as f64 / 1e9,
        stats.upload_gbps()
    )
}

/// Device bytes as GB for the progress bar, `n/a` where the backend does not report them.
fn gigabytes(bytes: Option<u64>) -> String {
    bytes.map_or_else(
        || "n/a".to_string(),
        |b| format!("{:.1} GB", b as f64 / 1e9),
    )
}

/// One micro-batch: its loss and the gradients of the adapters.
fn micro_step<B: FusedOps>(
    plan: &TrainPlan,
    prepared: &Prepared,
    flux: &Flux<Autodiff<B>>,
    batch: &Batch,
    rng: &mut Rng,
    device: &B::Device,
) -> (f64, GradientsParams) {
    let mut latents = Vec::with_capacity(batch.samples.len());
    let (mut pooled, mut states) = (Vec::new(), Vec::new());
    for sample in &batch.samples {
        let latent = prepared.latents[sample.item].clone();
        latents.push(Tensor::<B, 3>::from_data(latent, device).cast(DType::F32));
        let caption = if sample.drop_caption {
            &prepared.empty
        } else {
            &prepared.captions[sample.item]
        };
        pooled.push(Tensor::<B, 1>::from_data(caption.pooled.clone(), device));
        states.push(Tensor::<B, 2>::from_data(caption.states.clone(), device));
    }
    let latents = Tensor::stack::<4>(latents, 0);
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

    let dtype = plan.model.dtype;
    let txt: Tensor<B, 3> = Tensor::stack(states, 0).cast(dtype);
    let txt_len = txt.dims()[1];
    let config = flux.config();
    let input = FluxInput {
        img: Tensor::from_inner(x_t.cast(dtype)),
        txt: Tensor::from_inner(txt),
        y: Tensor::from_inner(Tensor::stack::<2>(pooled, 0).cast(dtype)),
        timesteps: Tensor::from_inner(sigma.cast(dtype)),
        guidance: config.guidance_embed.then(|| {
            Tensor::from_inner(
                Tensor::<B, 1>::full([n], plan.train.guidance_scale, device).cast(dtype),
            )
        }),
        img_ids: image_ids(h, w),
        txt_ids: text_ids(txt_len),
    };
    let checkpointing = if plan.train.gradient_checkpointing {
        Checkpointing::Blocks
    } else {
        Checkpointing::Off
    };
    let mut tape = BlockTape::new(checkpointing);
    let prediction = flux.forward_with(input, &mut tape).cast(DType::F32);
    let loss = (prediction - Tensor::from_inner(target))
        .powi_scalar(2)
        .mean();
    let value = loss.clone().into_scalar().elem::<f64>();
    let grads = GradientsParams::from_grads(tape.backward(&loss, flux), flux);
    (value, grads)
}
