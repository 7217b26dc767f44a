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
//! With a VRAM budget (`model.offload.vram_budget_gb`, neither absent nor 0) on a device that
//! reports its memory, the budget covers everything the run keeps on the device: the first step
//! streams every frozen weight and measures what the run needs beside them, then the weights
//! are planned within the rest of the budget, or the run stops when the budget cannot hold even
//! that (burn-offload/DESIGN.md, "A budget for the whole run").
//!
//! With `train.devices` above 1 the loop runs as one replica per device, each in its own
//! thread, computing its share of each step's micro-batches; their gradients are averaged
//! before every replica applies the same update (`replicas.rs`, burn-lora-train's
//! DESIGN.md, "Several GPUs").
//!
//! A step whose loss or gradient is not finite is skipped; after `train.max_nan_steps` of them
//! in a row the run stops. A checkpoint (LoRA file plus optimizer and data state) is written
//! every `save.save_every` steps, at the last step, and when the run stops early; resuming
//! restores the adapters from the optimizer's exact f32 copies, never from the (possibly bf16)
//! LoRA file.

use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::Instant;

use burn::module::{AutodiffModule, Module};
use burn::optim::GradientsAccumulator;
use burn::tensor::backend::{Backend, Device as _, DeviceId};
use burn_diffusion::Checkpointing;
use burn_lora::{ApplyReport, LayoutNames, LoraMetadata, SaveOptions};
use burn_offload::{
    GradientSink, MemoryMeasurement, MemoryPlan, MemoryProbe, Offload, OffloadError, StepStats,
    StreamTarget, WeightStream,
};

use crate::cache;
use crate::checkpoint::{RunDir, StateTensor, TrainingState};
use crate::config::{GradientPlacement, OptimizerState, TrainPlan};
use crate::dataset::{DataPosition, Dataset};
pub use crate::error::TrainError;
use crate::error::gb;
use crate::experts::{self, Expert, Experts};
use crate::family::{Arch, Family, Flux1, Flux2Family, Sample, Sdxl, TrainBackend, Wan};
use crate::models;
use crate::optim::{AdamWConfig, LrSchedule, PlacedAdamW};
use crate::replicas::{Group, Replica};
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
    /// How the VRAM budget was last divided: after the run's first step was measured, or
    /// after a later step needed more. `None` where nothing was measured (no budget, a budget
    /// of 0, a device that reports no memory) or no step ran.
    pub memory: Option<MemoryPlan>,
    /// The expert each micro-batch of this run trained, with a second expert
    /// (`model.transformer_2`); empty otherwise.
    pub experts: Vec<Expert>,
}

/// Trains the adapters of `plan` on `devices` (the loop of `burnlora train`): creates or
/// resumes the run folder, writes checkpoints and the loss CSV and plot, and stops early, with
/// a checkpoint, when `stop` is set. `devices` holds one device per replica (`train.devices`
/// of them, [`TrainError::Devices`] otherwise; [`devices`] finds them).
///
/// The adapters are initialized from the backend's random generator, which is global to the
/// process: a run is reproducible (and its resumption exact) only while no other code draws
/// from that generator at the same time.
pub fn train<B: StreamTarget>(
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    devices: &[B::Device],
) -> Result<TrainSummary, TrainError> {
    train_probed::<B>(plan, resume, stop, devices, None)
}

/// The first `count` devices of the backend's default kind, one per replica of a
/// data-parallel run; [`TrainError::Devices`] when there are fewer.
pub fn devices<B: Backend>(count: usize) -> Result<Vec<B::Device>, TrainError> {
    let first = B::Device::default().to_id();
    let found = B::device_count(first.type_id);
    if found < count {
        return Err(TrainError::Devices {
            configured: count,
            found,
        });
    }
    Ok((first.index_id..)
        .take(count)
        .map(|index_id| {
            B::Device::from_id(DeviceId {
                type_id: first.type_id,
                index_id,
            })
        })
        .collect())
}

/// [`train`], reading the device memory in use from `probe` instead of asking the backend: on
/// a backend that reports none (the CPU), the budget is then measured and planned as on a GPU,
/// which is how the tests exercise it. The text encoders ask the backend.
pub fn train_with_memory_probe<B: StreamTarget>(
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    devices: &[B::Device],
    probe: Arc<dyn MemoryProbe>,
) -> Result<TrainSummary, TrainError> {
    train_probed::<B>(plan, resume, stop, devices, Some(probe))
}

fn train_probed<B: StreamTarget>(
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    devices: &[B::Device],
    probe: Option<Arc<dyn MemoryProbe>>,
) -> Result<TrainSummary, TrainError> {
    let _kernels = plan.kernels.install();
    tracing::info!("{}; kernels: {}", plan.model.arch.name(), plan.kernels);
    match plan.model.arch {
        Arch::Flux1 => {
            let family = Flux1::new(plan)?;
            train_family::<_, B>(&family, plan, resume, stop, devices, probe)
        }
        Arch::Flux2 => {
            let family = Flux2Family::new(plan)?;
            train_family::<_, B>(&family, plan, resume, stop, devices, probe)
        }
        Arch::Sdxl => {
            let family = Sdxl::new(plan)?;
            train_family::<_, B>(&family, plan, resume, stop, devices, probe)
        }
        Arch::Wan => {
            let family = Wan::new(plan)?;
            train_family::<_, B>(&family, plan, resume, stop, devices, probe)
        }
    }
}

/// [`train`] with the family's model: the encodings prepared once (on the first device), then
/// one replica per device.
fn train_family<F: Family + Sync, B: StreamTarget>(
    family: &F,
    plan: &TrainPlan,
    resume: Resume,
    stop: &StopFlag,
    devices: &[B::Device],
    probe: Option<Arc<dyn MemoryProbe>>,
) -> Result<TrainSummary, TrainError>
where
    F::Model<TrainBackend<B>>: AutodiffModule<TrainBackend<B>>,
{
    if devices.len() != plan.train.devices {
        return Err(TrainError::Devices {
            configured: plan.train.devices,
            found: devices.len(),
        });
    }
    let run = RunDir::create(plan.run_dir(), &plan.name)?;
    let dataset = Dataset::scan(&plan.datasets, family.pixel_multiple())?;
    let prepared = cache::prepare::<F, B>(family, plan, &dataset, &devices[0])?;
    let shared = Shared {
        family,
        plan,
        resume,
        stop,
        run: &run,
        dataset: &dataset,
        prepared: &prepared,
    };
    let [_, _, ..] = devices else {
        let origin = Origin::Built(Vec::new());
        return train_replica::<F, B>(&shared, Replica::alone(), origin, &devices[0], probe);
    };
    burn::collective::reset_collective::<Offload<B>>();
    let group = Group::new(devices.len());
    tracing::info!("{} replicas train data-parallel", devices.len());
    let (copies, received): (Vec<_>, Vec<_>) = devices[1..].iter().map(|_| mpsc::channel()).unzip();
    let origins =
        std::iter::once(Origin::Built(copies)).chain(received.into_iter().map(Origin::Adopted));
    std::thread::scope(|scope| {
        let replicas: Vec<_> = devices
            .iter()
            .zip(origins)
            .enumerate()
            .map(|(rank, (device, origin))| {
                let (shared, group, probe) = (&shared, &group, probe.clone());
                let thread = std::thread::Builder::new()
                    .name(format!("replica {rank}"))
                    .stack_size(REPLICA_STACK);
                let spawned = thread.spawn_scoped(scope, move || {
                    let replica = Replica::of(group, rank);
                    let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
                        train_replica::<F, B>(shared, replica, origin, device, probe)
                    }));
                    if !matches!(outcome, Ok(Ok(_))) {
                        group.fail();
                    }
                    outcome.unwrap_or_else(|payload| panic::resume_unwind(payload))
                });
                spawned.expect("spawning a replica's thread")
            })
            .collect();
        let outcomes: Vec<Result<TrainSummary, TrainError>> = replicas
            .into_iter()
            .map(|r| {
                r.join()
                    .unwrap_or_else(|payload| panic::resume_unwind(payload))
            })
            .collect();
        first_cause(outcomes)
    })
}

/// The leader's summary when every replica finished, else the error of the replica that
/// failed first (the others stopped for it).
fn first_cause(
    outcomes: Vec<Result<TrainSummary, TrainError>>,
) -> Result<TrainSummary, TrainError> {
    let mut errors: Vec<TrainError> = Vec::new();
    let mut leader = None;
    for outcome in outcomes {
        match outcome {
            Ok(summary) => leader = leader.or(Some(summary)),
            Err(error) => errors.push(error),
        }
    }
    let cause = errors
        .iter()
        .position(|e| !matches!(e, TrainError::ReplicaFailed))
        .unwrap_or(0);
    match errors.is_empty() {
        true => Ok(leader.expect("a run has at least one replica")),
        false => Err(errors.swap_remove(cause)),
    }
}

/// The stack of each replica's thread: what a main thread gets (8 MiB) several times over,
/// as the model code recurses through module trees with large frames in debug builds.
const REPLICA_STACK: usize = 64 << 20;

/// Where a replica's model comes from.
enum Origin<M> {
    /// Built by this replica, which sends a copy to each of the others.
    Built(Vec<mpsc::Sender<M>>),
    /// The first replica's, adopted onto this replica's device: its frozen weights streamed
    /// from the same host memory, its adapters copied.
    Adopted(mpsc::Receiver<M>),
}

/// What every replica of a run reads.
struct Shared<'a, F> {
    family: &'a F,
    plan: &'a TrainPlan,
    resume: Resume,
    stop: &'a StopFlag,
    run: &'a RunDir,
    dataset: &'a Dataset,
    prepared: &'a cache::Prepared,
}

/// One replica's run on `device`: each step it computes its share of the micro-batches
/// (those whose index modulo the replica count is its rank), every replica drawing the same
/// random values in the same order; the leader logs and saves.
fn train_replica<F: Family, B: StreamTarget>(
    shared: &Shared<'_, F>,
    replica: Replica<'_>,
    origin: Origin<F::Model<TrainBackend<B>>>,
    device: &B::Device,
    probe: Option<Arc<dyn MemoryProbe>>,
) -> Result<TrainSummary, TrainError>
where
    F::Model<TrainBackend<B>>: AutodiffModule<TrainBackend<B>>,
{
    let Shared {
        family,
        plan,
        resume,
        stop,
        run,
        dataset,
        prepared,
    } = *shared;
    let start = Instant::now();
    let stream = models::weight_stream::<TrainBackend<B>>(plan, device, probe)?;
    let names = family.lora_names();
    let mut flux = replica_model::<F, B>(family, plan, &names, origin, device, stream.as_ref())?;
    let mut experts = match experts::second_plan(plan) {
        Some(second_plan) => {
            let mut second = family.load::<B>(&second_plan, device, stream.as_ref())?;
            if let Some(stream) = &stream {
                second = stream.stream_frozen(second)?;
                TrainBackend::<B>::memory_cleanup(device);
            }
            tracing::info!(
                "two experts train the adapters by turns: {} from timestep {:.0}, {} below",
                Expert::HighNoise.name(),
                plan.train.timestep_boundary * 1000.0,
                Expert::LowNoise.name()
            );
            Some(Experts::new(&flux, second, plan)?)
        }
        None => None,
    };
    replica.join::<Offload<B>>(device)?;
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
    let mut optimizer = PlacedAdamW::<Offload<B>>::new(
        AdamWConfig::from_settings(&plan.train),
        plan.train.optimizer_state,
    );
    let sink = match plan.train.gradients {
        GradientPlacement::Host => Some(GradientSink::<B>::new(device)?),
        GradientPlacement::Device => None,
    };
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
            let saved = state.optimizer.into_iter().map(StateTensor::into_named);
            flux = optimizer.restore(flux, state.optimizer_steps, saved.collect())?;
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

    let mut measured = stream
        .as_ref()
        .and_then(|stream| MeasuredBudget::new(plan, stream));
    let started_at = step;
    let mut batches = dataset.batches(plan.train.seed, plan.train.batch_size, position);
    let mut loss_log = replica
        .leads()
        .then(|| LossLog::open(run.path(), started_at))
        .transpose()?;
    let mut progress = replica
        .leads()
        .then(|| Progress::new(plan.train.steps, started_at, plan.logging.progress_bar));
    let mut summary = TrainSummary {
        started_at,
        step,
        losses: Vec::new(),
        lora: None,
        memory: None,
        experts: Vec::new(),
    };
    let mut non_finite = 0;
    while step < plan.train.steps {
        let start = Instant::now();
        let lr = schedule.lr(step);
        let mut accumulator = GradientsAccumulator::<F::Model<TrainBackend<B>>>::new();
        let mut loss_sum = 0.0;
        let mut memory = String::new();
        if let Some(measured) = &mut measured {
            measured.begin_step();
        }
        let accumulation = plan.train.gradient_accumulation_steps;
        for micro in 0..accumulation * replica.world {
            let batch = batches.next().expect("a scanned dataset yields batches");
            // Each micro-batch draws from its own generator, so that a replica draws what the
            // others' micro-batches leave untouched.
            let mut draws = Rng::seeded(rng.next_u64());
            if micro % replica.world != replica.rank {
                continue;
            }
            if let Some(stream) = &stream {
                stream.begin_step();
            }
            let mut micro_plan = plan;
            if let Some(experts) = &mut experts {
                let expert = experts.choose(plan, &mut draws);
                flux = experts.activate(flux, expert);
                micro_plan = experts.plan(expert);
                summary.experts.push(expert);
                tracing::debug!("step {}: the {}", step + 1, expert.name());
            }
            if let Some(sink) = &sink {
                flux = sink.attach(flux);
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
            let (loss, grads) =
                family.loss::<Offload<B>>(micro_plan, &flux, &samples, &mut draws, device);
            if let Some(stream) = &stream {
                let stats = stream.end_step();
                if let Some(measured) = &mut measured {
                    measured.add(&stats);
                }
                memory = describe(&stats);
            }
            loss_sum += loss;
            accumulator.accumulate(&flux, grads);
        }
        let grads = replica.mean_gradients(&flux, accumulator.grads())?;
        let [loss_sum, stops] =
            replica.sum::<Offload<B>, 2>([loss_sum, f64::from(u8::from(stop.is_set()))], device)?;
        let loss = loss_sum / (accumulation * replica.world) as f64;
        let losses_read = start.elapsed().as_secs_f64();
        let sums = sink.as_ref().map(|sink| sink.take()).transpose()?;
        let gradients_read = start.elapsed().as_secs_f64() - losses_read;
        let host_grads: Vec<_> = sums.iter().flat_map(|s| s.iter()).collect();
        let (updated, stepped) = optimizer.step(flux, grads, &host_grads, lr, accumulation);
        drop(sums);
        flux = updated;
        let optimizer_queued = start.elapsed().as_secs_f64() - losses_read - gradients_read;
        step += 1;
        if let Some(measured) = &mut measured {
            // Before anything of the step is saved: a budget too small stops the run here.
            if let Some(planned) = measured.end_step(plan, step)? {
                summary.memory = Some(planned);
            }
        }
        if stepped.applied && loss.is_finite() {
            non_finite = 0;
        } else {
            non_finite += 1;
            if replica.leads() {
                tracing::warn!(
                    "step {step}: loss {loss}, gradient norm {}: skipped",
                    stepped.grad_norm
                );
            }
        }
        let seconds = start.elapsed().as_secs_f64();
        summary.losses.push(loss);
        summary.step = step;
        if memory.is_empty() {
            memory = gigabytes(B::memory_in_use(device));
        }
        if let Some(progress) = &mut progress {
            progress.step(step, loss, lr, seconds, &memory);
        }
        // Host time, up to the loss's read (which waits for the backward to finish on the
        // device), for the last gradients to reach host memory (with `train.gradients: host`),
        // then for the optimizer (which waits for the gradients' norm and queues the update):
        // where the step's time goes beside the device's own work.
        tracing::debug!(
            "step {step}: to the loss {losses_read:.3} s, gradients to the host \
             {gradients_read:.3} s, optimizer {optimizer_queued:.3} s, rest {:.3} s",
            seconds - losses_read - gradients_read - optimizer_queued
        );
        let diverged = non_finite >= plan.train.max_nan_steps;
        let stopping = stops > 0.0 || diverged;
        let Some(loss_log) = &mut loss_log else {
            if stopping {
                break;
            }
            continue;
        };
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
        if step % plan.save.every == 0 || step == plan.train.steps || stopping {
            let state = TrainingState {
                step,
                data: batches.position(),
                rng: rng.state(),
                config_fingerprint: plan.resume_fingerprint(),
                extra: serde_json::json!({ "loss": loss }),
                optimizer_steps: optimizer.steps(),
                optimizer: optimizer.state_tensors(),
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
    if let Some(progress) = progress {
        progress.finish();
    }
    replica.leave::<Offload<B>>()?;
    Ok(summary)
}

/// A replica's denoiser with its adapters on `device`, its frozen weights in `stream` when
/// there is one: built, then a copy sent to each other replica, or adopted from the first.
fn replica_model<F: Family, B: StreamTarget>(
    family: &F,
    plan: &TrainPlan,
    names: &LayoutNames,
    origin: Origin<F::Model<TrainBackend<B>>>,
    device: &B::Device,
    stream: Option<&WeightStream<TrainBackend<B>>>,
) -> Result<F::Model<TrainBackend<B>>, TrainError>
where
    F::Model<TrainBackend<B>>: AutodiffModule<TrainBackend<B>>,
{
    match origin {
        Origin::Built(copies) => {
            let (mut flux, applied) = build::<F, B>(family, plan, names, device, stream)?;
            tracing::info!(
                "{} layers adapted, {} trainable parameters",
                applied.count(),
                applied.params()
            );
            if let Some(stream) = stream {
                flux = stream.stream_frozen(flux)?;
                TrainBackend::<B>::memory_cleanup(device);
            }
            for copy in copies {
                // A replica that is gone has failed, which the next meeting reports.
                copy.send(flux.clone()).ok();
            }
            Ok(flux)
        }
        Origin::Adopted(received) => {
            let flux = received.recv().map_err(|_| TrainError::ReplicaFailed)?;
            Ok(match stream {
                Some(stream) => stream.adopt(flux),
                None => flux.fork(device),
            })
        }
    }
}

/// The family's denoiser on `device` with its adapters (saved under `names`): loaded (or
/// made), the pretrained adapters applied, new ones made from the run's seed and initialized.
fn build<F: Family, B: StreamTarget>(
    family: &F,
    plan: &TrainPlan,
    names: &LayoutNames,
    device: &B::Device,
    stream: Option<&WeightStream<TrainBackend<B>>>,
) -> Result<(F::Model<TrainBackend<B>>, ApplyReport), TrainError>
where
    F::Model<TrainBackend<B>>: AutodiffModule<TrainBackend<B>>,
{
    let flux = family.load::<B>(plan, device, stream)?;
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
    let (flux, applied) = plan.network.lora.apply(flux);
    names.check(plan.save.format, &applied)?;
    models::initialize(&flux);
    Ok((flux, applied))
}

/// The share of a measured budget that resident and kept weights leave free: the steps after
/// the first need more beside the weights than it measured, as CUDA's pools grow over a few
/// steps (1.2–1.7 GB more for FLUX.1 by the third step on an H100, up to 2.7 % of a 12 GB
/// budget at nvidia-smi before they were planned again; with the pools' free pages handed
/// back, step 1 measures less and the first replayed step rose 1.28 GB above its plan, 5 MiB
/// over the budget with a 5 % share).
const MARGIN: f64 = 0.07;

/// The budget of a run whose weights are planned within what its steps measure
/// ([`models::measured_budget`]). The first step streams every frozen weight (as
/// `models::weight_stream` set the stream up); after it, the weights are planned within the
/// budget beside what it needed and a [`MARGIN`] share of the budget. A later step that needs
/// more (a larger bucket) raises the headroom to its need and the weights are planned again;
/// the headroom never shrinks.
struct MeasuredBudget<'a, B: StreamTarget> {
    stream: &'a WeightStream<TrainBackend<B>>,
    budget: u64,
    /// The step running.
    measured: MemoryMeasurement,
    /// The headroom planned, once a step has been measured.
    headroom: Option<u64>,
}

impl<'a, B: StreamTarget> MeasuredBudget<'a, B> {
    /// Where the budget is measured, the watch over `stream`'s steps.
    fn new(plan: &TrainPlan, stream: &'a WeightStream<TrainBackend<B>>) -> Option<Self> {
        let budget = models::measured_budget(plan, stream)?;
        tracing::info!(
            "the first step streams every frozen weight and measures the device memory the run \
             needs beside them; the weights are then planned within the {} budget",
            gb(budget)
        );
        Some(Self {
            stream,
            budget,
            measured: MemoryMeasurement::default(),
            headroom: None,
        })
    }

    /// Before a step's first micro-batch.
    fn begin_step(&mut self) {
        let before = self.stream.handed_out_beyond_weights().unwrap_or_default();
        self.measured = MemoryMeasurement {
            before,
            peak: self.stream.memory_beyond_weights().unwrap_or_default(),
            after: before,
            settled: 0,
        };
    }

    /// Takes in a micro-batch's peak.
    fn add(&mut self, stats: &StepStats) {
        if let Some(peak) = stats.peak_beyond_weights {
            self.measured.peak = self.measured.peak.max(peak);
        }
    }

    /// After the optimizer update of `step`: when the step needed more beside the weights than
    /// the headroom planned (or nothing was planned yet), plans the weights within the budget
    /// beside that need, logs the plan and returns it; [`TrainError::Budget`] when the budget
    /// cannot hold the need even with every weight streamed.
    fn end_step(&mut self, plan: &TrainPlan, step: u64) -> Result<Option<MemoryPlan>, TrainError> {
        if let Some(after) = self.stream.handed_out_beyond_weights() {
            self.measured.after = after;
        }
        // The update's own transients (new values uploaded while the old are alive) left
        // their pages in the pools, which the device's count still shows.
        if let Some(now) = self.stream.memory_beyond_weights() {
            self.measured.settled = now;
        }
        let need = self.measured.headroom();
        if self.headroom.is_some_and(|planned| need <= planned) {
            return Ok(None);
        }
        let config = self
            .stream
            .config()
            .with_vram_budget(self.budget)
            .with_activation_headroom(need)
            .with_margin((self.budget as f64 * MARGIN) as u64);
        let slots = config.ring_slots;
        let outcome = self.stream.reconfigure(config);
        let kept = self.stream.config().ring_slots;
        if kept < slots && outcome.is_ok() {
            tracing::warn!(
                "the ring keeps {kept} of its {slots} slots (`model.offload.ring_slots`) to fit \
                 the {} budget",
                gb(self.budget),
            );
        }
        match outcome {
            Ok(()) => {}
            Err(OffloadError::BudgetTooSmall {
                budget,
                headroom,
                ring,
                needed,
            }) => {
                return Err(TrainError::Budget {
                    file: plan.file.clone(),
                    step,
                    budget,
                    headroom,
                    ring,
                    needed,
                    advice: budget_advice(plan),
                });
            }
            Err(error) => return Err(error.into()),
        }
        let memory = self.stream.memory_plan();
        let split = format!(
            "within the {} budget, {} of it left free, {} of {} frozen weights stay resident \
             ({}), {} stream through a {} ring, keeping up to {} between two uses",
            gb(memory.vram_budget),
            gb(memory.margin),
            memory.resident_weights,
            memory.resident_weights + memory.streamed_weights,
            gb(memory.resident_bytes),
            memory.streamed_weights,
            gb(memory.ring_bytes),
            gb(memory.retained_bytes),
        );
        let m = &self.measured;
        match self.headroom {
            None => tracing::info!(
                "step {step} needed {} of device memory beside the frozen weights (peak {}, {} \
                 left by the optimizer update, {} in use after it); {split}",
                gb(need),
                gb(m.peak),
                gb(m.after.saturating_sub(m.before)),
                gb(m.settled),
            ),
            Some(planned) => tracing::warn!(
                "step {step} needed {} of device memory beside the frozen weights, more than \
                 the {} planned so far; {split}",
                gb(need),
                gb(planned),
            ),
        }
        self.headroom = Some(need);
        Ok(Some(memory))
    }
}

/// The settings not yet in force that take memory off the device, for [`TrainError::Budget`]:
/// empty when none is left.
fn budget_advice(plan: &TrainPlan) -> String {
    let settings = [
        (
            plan.train.gradient_checkpointing == Checkpointing::Off,
            "`train.gradient_checkpointing: true` (each block's activations recomputed)",
        ),
        (
            plan.train.gradient_checkpointing == Checkpointing::Blocks,
            "`train.gradient_checkpointing_cpu_offload: true` (the recomputed blocks' inputs in \
             host memory)",
        ),
        (
            plan.train.optimizer_state == OptimizerState::Device,
            "`train.optimizer_state: host` (the optimizer's moments and the gradients in host \
             memory)",
        ),
    ];
    let unused: Vec<&str> = settings
        .iter()
        .filter(|(unused, _)| *unused)
        .map(|(_, setting)| *setting)
        .collect();
    if unused.is_empty() {
        String::new()
    } else {
        format!(
            "; these need less beside the weights: {}",
            unused.join(", ")
        )
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
