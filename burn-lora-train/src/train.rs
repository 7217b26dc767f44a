//! The training loop of `burnlora train`, the same for every model family (`model.arch`
//! selects a [`Family`]): from a [`TrainPlan`] to LoRA files in the run folder.
//!
//! Before the first step the images and captions become the family's encodings
//! ([`crate::cache`]: read from the caches beside the images, or computed with the family's
//! encoders, which are dropped before the denoiser is loaded). The denoiser runs on
//! `Autodiff<Offload<B>>`: with `model.offload` or `model.quantize` set, its frozen weights move
//! to host memory and stream to the device through burn-offload (within the VRAM budget, FP8 on
//! the bus when asked); otherwise they stay on the device and the decorator only forwards.
//!
//! Each optimizer step runs `gradient_accumulation_steps` micro-batches, each through the
//! family's objective ([`Family::loss`]), which draws everything random from the run's [`Rng`]
//! in a fixed order, so that a resumed run draws what the uninterrupted one would have drawn.
//!
//! A step whose loss or gradient is not finite is skipped; after `train.max_nan_steps` of them
//! in a row the run stops. A checkpoint (LoRA file plus optimizer and data state) is written
//! every `save.save_every` steps, at the last step, and when the run stops early; resuming
//! restores the adapters from the optimizer's exact f32 copies, never from the (possibly bf16)
//! LoRA file.

use std::path::PathBuf;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::Backend;
use burn_lora::{LoraMetadata, SaveOptions};
use burn_offload::{Offload, StreamTarget, WeightStream};

use crate::cache;
use crate::checkpoint::{RunDir, TrainingState};
use crate::config::TrainPlan;
use crate::dataset::{DataPosition, Dataset};
pub use crate::error::TrainError;
use crate::family::{Arch, Family, Flux1, Flux2Family, Sample, TrainBackend};
use crate::models;
use crate::optim::{AdamW, AdamWConfig, LrSchedule};
use crate::report::{LossLog, LossRow, Progress, StopFlag, plot_loss};
use crate::rng::Rng;

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
    tracing::info!("{}; kernels: {}", plan.model.arch.name(), plan.kernels);
    match plan.model.arch {
        Arch::Flux1 => train_family::<_, B>(&Flux1::new(plan)?, plan, resume, stop, device),
        Arch::Flux2 => train_family::<_, B>(&Flux2Family::new(plan)?, plan, resume, stop, device),
    }
}

/// [`train`] with the family's model.
fn train_family<F: Family, B: StreamTarget>(
    family: &F,
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    device: &B::Device,
) -> Result<TrainSummary, TrainError>
where
    F::Model<TrainBackend<B>>: AutodiffModule<TrainBackend<B>>,
{
    let run = RunDir::create(plan.run_dir(), &plan.name)?;
    let dataset = Dataset::scan(&plan.datasets)?;
    let prepared = cache::prepare::<F, B>(family, plan, &dataset, device)?;

    let start = Instant::now();
    let stream = models::offload_config(plan)
        .map(|config| WeightStream::<TrainBackend<B>>::new(device, config))
        .transpose()?;
    let flux = family.load::<B>(plan, device, stream.as_ref())?;
    let names = family.lora_names();
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
        "denoiser ready in {:.1} s{}",
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
        let mut accumulator = GradientsAccumulator::<F::Model<TrainBackend<B>>>::new();
        let mut loss_sum = 0.0;
        let mut memory = String::new();
        for _ in 0..plan.train.gradient_accumulation_steps {
            let batch = batches.next().expect("a scanned dataset yields batches");
            if let Some(stream) = &stream {
                stream.begin_step();
            }
            let samples: Vec<Sample<'_>> = batch
                .samples
                .iter()
                .map(|sample| Sample {
                    image: &prepared.images[sample.item],
                    caption: if sample.drop_caption {
                        &prepared.empty
                    } else {
                        &prepared.captions[sample.item]
                    },
                })
                .collect();
            let (loss, grads) = family.loss::<Offload<B>>(plan, &flux, &samples, &mut rng, device);
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
                    base_model: Some(family.base_model_name(plan)),
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
