//! [`GradientSink`]: the gradients of trainable parameters taken to host memory as the backward
//! produces them, so that the device never holds them all at once.
//!
//! [`GradientSink::attach`] tags the parameters of a module; the model reads each through
//! `burn_kernels::trainable`, whose backward hands the gradient to the sink instead of the
//! autodiff graph. The compute thread only starts the copy ([`StreamTarget::start_download`]:
//! on CUDA an asynchronous copy after the work submitted so far, on a stream of its own); a
//! worker thread finishes it and adds the values, in f32, to the parameter's sum, so that the
//! gradients of several micro-batches (and of several uses in one) accumulate there.
//! [`GradientSink::take`] waits for the copies in flight and hands the sums over.

use std::collections::HashMap;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive, bf16, f16};
use rayon::prelude::*;

use crate::backend::OffloadBackend;
use crate::error::OffloadError;
use crate::target::StreamTarget;

/// Values per task when a piece of a gradient is added to its sum.
const SPAN: usize = 1 << 16;

/// Bytes of gradients that may wait on the device for their copy: beyond it, the compute
/// thread waits before it hands over another, so the device never holds more.
const IN_FLIGHT: usize = 2 << 30;

/// The sink a parameter's gradients go to, and its place there.
pub(crate) struct SinkTag<B: StreamTarget> {
    pub(crate) sink: Arc<GradientSink<B>>,
    pub(crate) index: usize,
}

impl<B: StreamTarget> Clone for SinkTag<B> {
    fn clone(&self) -> Self {
        Self {
            sink: self.sink.clone(),
            index: self.index,
        }
    }
}

/// Gradients of trainable parameters, summed in host memory as the backward produces them.
///
/// ```
/// use burn::backend::{Autodiff, Flex};
/// use burn::module::Param;
/// use burn::tensor::Tensor;
/// use burn_offload::{GradientSink, Offload};
///
/// type B = Autodiff<Offload<Flex>>;
/// #[derive(burn::module::Module, Debug)]
/// struct Net<B: burn::tensor::backend::Backend> {
///     w: Param<Tensor<B, 1>>,
/// }
/// let device = Default::default();
/// let sink = GradientSink::<Flex>::new(&device)?;
/// let net = Net::<B> {
///     w: Param::from_tensor(Tensor::from_floats([1.0, 2.0], &device).require_grad()),
/// };
/// let net = sink.attach(net);
/// let grads = (burn_kernels::trainable(net.w.val()) * 3.0).sum().backward();
/// assert!(net.w.grad(&grads).is_none());
/// let sums = sink.take()?;
/// assert_eq!(sums.iter().collect::<Vec<_>>(), vec![("w", &[3.0f32, 3.0][..])]);
/// # Ok::<(), burn_offload::OffloadError>(())
/// ```
pub struct GradientSink<B: StreamTarget> {
    shared: Arc<Shared>,
    jobs: Mutex<Option<Sender<Job<B>>>>,
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// A copy on its way to a parameter's sum.
struct Job<B: StreamTarget> {
    index: usize,
    dtype: DType,
    numel: usize,
    download: B::Download,
}

struct Shared {
    state: Mutex<Sums>,
    settled: Condvar,
}

/// The parameters known to the sink, and their sums.
#[derive(Default)]
struct Sums {
    paths: Vec<String>,
    by_path: HashMap<String, usize>,
    /// Per parameter, the buffer of its sum (kept from step to step, so that its pages are
    /// not faulted in again), `None` while the sink's thread adds to it.
    values: Vec<Option<Vec<f32>>>,
    /// Per parameter, whether its buffer holds a sum since the last `take` (or stale values).
    filled: Vec<bool>,
    /// Copies started and not yet added.
    pending: usize,
    /// Their bytes.
    pending_bytes: usize,
    /// The first copy that failed since the last `take`.
    error: Option<OffloadError>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Sums> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl<B: StreamTarget> GradientSink<B> {
    /// A sink for parameters on `device`, with its worker thread.
    pub fn new(device: &B::Device) -> Result<Arc<Self>, OffloadError> {
        let mut staging = B::download_staging(device)?;
        let shared = Arc::new(Shared {
            state: Mutex::new(Sums::default()),
            settled: Condvar::new(),
        });
        let (jobs, received) = channel::<Job<B>>();
        let worker = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("gradient-sink".into())
                .spawn(move || {
                    for job in received {
                        let (index, bytes) = (job.index, job.numel * job.dtype.size());
                        let (sum, fresh) = {
                            let mut state = shared.lock();
                            let fresh = !std::mem::replace(&mut state.filled[index], true);
                            (state.values[index].take(), fresh)
                        };
                        let (sum, result) = add_download::<B>(sum, fresh, job, &mut staging);
                        let mut state = shared.lock();
                        state.values[index] = Some(sum);
                        if let Err(error) = result {
                            state.error.get_or_insert(error);
                        }
                        state.pending -= 1;
                        state.pending_bytes -= bytes;
                        shared.settled.notify_all();
                    }
                })
                .map_err(|e| OffloadError::Device {
                    action: "starting the gradient sink's thread",
                    reason: e.to_string(),
                })?
        };
        Ok(Arc::new(Self {
            shared,
            jobs: Mutex::new(Some(jobs)),
            worker: Mutex::new(Some(worker)),
        }))
    }

    /// `module` with each parameter that requires a gradient tagged for this sink under its
    /// module path: the model's reads through `burn_kernels::trainable` then send their
    /// gradients here. The tags live in the parameters' tensors, so a module whose parameters
    /// were replaced (by an optimizer step) is attached again before its next forward.
    pub fn attach<AB, M>(self: &Arc<Self>, module: M) -> M
    where
        AB: AutodiffBackend + OffloadBackend<Target = B>,
        M: Module<AB>,
    {
        module.map(&mut Tagger {
            sink: self,
            path: Vec::new(),
        })
    }

    /// Waits for the copies in flight and returns the sum of each parameter's gradients since
    /// the last call, for the parameters that got any; once the returned sums are dropped,
    /// the next gradients start new ones. The first failed copy is the error (and the sums
    /// start again too).
    pub fn take(&self) -> Result<GradientSums<'_>, OffloadError> {
        let mut state = self.shared.lock();
        while state.pending > 0 {
            state = self
                .shared
                .settled
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        if let Some(error) = state.error.take() {
            state.filled.iter_mut().for_each(|filled| *filled = false);
            return Err(error);
        }
        Ok(GradientSums { state })
    }

    /// The index of the parameter at `path`, registering it on first sight.
    fn index(&self, path: String) -> usize {
        let mut state = self.shared.lock();
        if let Some(&index) = state.by_path.get(&path) {
            return index;
        }
        let index = state.paths.len();
        state.paths.push(path.clone());
        state.by_path.insert(path, index);
        state.values.push(None);
        state.filled.push(false);
        index
    }

    /// Starts taking `grad`, a gradient of the parameter at `index`, to host memory, once the
    /// gradients waiting for their copy take less than [`IN_FLIGHT`] bytes.
    pub(crate) fn send(&self, index: usize, grad: FloatTensor<B>) {
        let dtype = burn::tensor::TensorMetadata::dtype(&grad);
        let numel = burn::tensor::TensorMetadata::shape(&grad).num_elements();
        let bytes = numel * dtype.size();
        {
            let mut state = self.shared.lock();
            while state.pending > 0 && state.pending_bytes + bytes > IN_FLIGHT {
                state = self
                    .shared
                    .settled
                    .wait(state)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        }
        let download = match B::start_download(grad) {
            Ok(download) => download,
            Err(error) => {
                self.shared.lock().error.get_or_insert(error);
                return;
            }
        };
        {
            let mut state = self.shared.lock();
            state.pending += 1;
            state.pending_bytes += bytes;
        }
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let sent = jobs.as_ref().map(|jobs| {
            jobs.send(Job {
                index,
                dtype,
                numel,
                download,
            })
        });
        if !matches!(sent, Some(Ok(()))) {
            let mut state = self.shared.lock();
            state.pending -= 1;
            state.pending_bytes -= bytes;
            state.error.get_or_insert(OffloadError::Device {
                action: "handing a gradient to the sink's thread",
                reason: "the thread has stopped".into(),
            });
        }
    }
}

impl<B: StreamTarget> Drop for GradientSink<B> {
    fn drop(&mut self) {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(worker) = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = worker.join();
        }
    }
}

/// `sum` plus the downloaded gradient of `job`, piece by piece (the gradient itself when the
/// sum is `fresh`: its buffer holds a previous step's values, or none yet).
fn add_download<B: StreamTarget>(
    sum: Option<Vec<f32>>,
    fresh: bool,
    job: Job<B>,
    staging: &mut B::Staging,
) -> (Vec<f32>, Result<(), OffloadError>) {
    // Zeroed pages from the allocator, first written by the parallel copy below.
    let mut sum = sum
        .filter(|sum| sum.len() == job.numel)
        .unwrap_or_else(|| vec![0.0; job.numel]);
    let mut at = 0;
    let size = job.dtype.size();
    let result = B::finish_download(job.download, staging, &mut |bytes: &[u8]| {
        let values = bytes.len() / size;
        let Some(target) = sum.get_mut(at..at + values) else {
            return;
        };
        match job.dtype {
            DType::F32 => add::<f32>(target, bytes, fresh),
            DType::BF16 => add::<bf16>(target, bytes, fresh),
            DType::F16 => add::<f16>(target, bytes, fresh),
            _ => {}
        }
        at += values;
    });
    let result = result.and_then(|()| {
        if at == sum.len() && matches!(job.dtype, DType::F32 | DType::BF16 | DType::F16) {
            Ok(())
        } else {
            Err(OffloadError::Device {
                action: "adding a gradient to its sum",
                reason: format!(
                    "{at} values of {:?} for a sum of {} values",
                    job.dtype,
                    sum.len()
                ),
            })
        }
    });
    (sum, result)
}

/// Adds (or, `fresh`, writes) the values of `bytes`, of type `E`, into `target`.
fn add<E: bytemuck::Pod + Send + Sync + Into<f32>>(target: &mut [f32], bytes: &[u8], fresh: bool) {
    let size = size_of::<E>();
    target
        .par_chunks_mut(SPAN)
        .zip(bytes.par_chunks(SPAN * size))
        .for_each(|(target, bytes)| {
            for (t, b) in target.iter_mut().zip(bytes.chunks_exact(size)) {
                let v: f32 = bytemuck::pod_read_unaligned::<E>(b).into();
                *t = if fresh { v } else { *t + v };
            }
        });
}

/// The gradient sums of one step, by module path, as [`GradientSink::take`] hands them over;
/// the sink's next gradients wait until they are dropped.
pub struct GradientSums<'a> {
    state: MutexGuard<'a, Sums>,
}

impl GradientSums<'_> {
    /// Each parameter's module path and the sum of its gradients (flat f32 values), for the
    /// parameters that got any since the last step.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &[f32])> {
        let state = &*self.state;
        state
            .paths
            .iter()
            .zip(&state.values)
            .zip(&state.filled)
            .filter_map(|((path, sum), &filled)| match (sum, filled) {
                (Some(sum), true) => Some((path.as_str(), sum.as_slice())),
                _ => None,
            })
    }
}

impl Drop for GradientSums<'_> {
    fn drop(&mut self) {
        self.state.filled.iter_mut().for_each(|f| *f = false);
    }
}

/// Tags the parameters that require a gradient with their index in the sink.
struct Tagger<'a, B: StreamTarget> {
    sink: &'a Arc<GradientSink<B>>,
    path: Vec<String>,
}

impl<AB, B> ModuleMapper<AB> for Tagger<'_, B>
where
    AB: AutodiffBackend + OffloadBackend<Target = B>,
    B: StreamTarget,
{
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        if !tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let index = self.sink.index(self.path.join("."));
        let primitive = tensor.into_primitive().tensor();
        let mut inner = AB::as_offload(&primitive).clone();
        inner.sink = Some(SinkTag {
            sink: self.sink.clone(),
            index,
        });
        let tagged = Tensor::from_primitive(TensorPrimitive::Float(AB::from_offload(inner)));
        Param::from_mapped_value(id, tagged.require_grad(), mapper)
    }
}
