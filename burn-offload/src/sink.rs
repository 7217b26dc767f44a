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
use burn::tensor::{DType, Tensor, TensorData, TensorPrimitive, bf16, f16};
use rayon::prelude::*;

use crate::backend::OffloadBackend;
use crate::error::OffloadError;
use crate::target::StreamTarget;

/// Values per task when a piece of a gradient is added to its sum.
const SPAN: usize = 1 << 16;

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
/// let taken = sink.take()?;
/// assert_eq!(taken[0].0, "w");
/// assert_eq!(taken[0].1.to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
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
    /// Per parameter, the sum of the gradients since the last `take`, once one came.
    values: Vec<Option<Vec<f32>>>,
    /// Copies started and not yet added.
    pending: usize,
    /// The first copy that failed since the last `take`.
    error: Option<OffloadError>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Sums> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
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
                        let index = job.index;
                        let sum = shared.lock().values[index].take();
                        let (sum, result) = add_download::<B>(sum, job, &mut staging);
                        let mut state = shared.lock();
                        state.values[index] = Some(sum);
                        if let Err(error) = result {
                            state.error.get_or_insert(error);
                        }
                        state.pending -= 1;
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
    /// the last call, by module path, as flat f32 values, for the parameters that got any; the
    /// sums start again from nothing. The first failed copy is the error.
    pub fn take(&self) -> Result<Vec<(String, TensorData)>, OffloadError> {
        let mut state = self.shared.lock();
        while state.pending > 0 {
            state = self
                .shared
                .settled
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        let failed = state.error.take();
        let sums = std::mem::take(&mut state.values);
        state.values = vec![None; sums.len()];
        if let Some(error) = failed {
            return Err(error);
        }
        Ok(state
            .paths
            .iter()
            .zip(sums)
            .filter_map(|(path, sum)| {
                let sum = sum?;
                let len = sum.len();
                Some((path.clone(), TensorData::new(sum, [len])))
            })
            .collect())
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
        index
    }

    /// Starts taking `grad`, a gradient of the parameter at `index`, to host memory.
    pub(crate) fn send(&self, index: usize, grad: FloatTensor<B>) {
        let dtype = burn::tensor::TensorMetadata::dtype(&grad);
        let download = match B::start_download(grad) {
            Ok(download) => download,
            Err(error) => {
                self.shared.lock().error.get_or_insert(error);
                return;
            }
        };
        self.shared.lock().pending += 1;
        let jobs = self.jobs.lock().unwrap_or_else(|p| p.into_inner());
        let sent = jobs.as_ref().map(|jobs| {
            jobs.send(Job {
                index,
                dtype,
                download,
            })
        });
        if !matches!(sent, Some(Ok(()))) {
            let mut state = self.shared.lock();
            state.pending -= 1;
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

/// `sum` plus the downloaded gradient of `job`, piece by piece (the gradient itself when there
/// is no sum yet).
fn add_download<B: StreamTarget>(
    sum: Option<Vec<f32>>,
    job: Job<B>,
    staging: &mut B::Staging,
) -> (Vec<f32>, Result<(), OffloadError>) {
    let fresh = sum.is_none();
    let mut sum = sum.unwrap_or_default();
    let mut at = 0;
    let size = job.dtype.size();
    let result = B::finish_download(job.download, staging, &mut |bytes: &[u8]| {
        let values = bytes.len() / size;
        if fresh {
            sum.resize(at + values, 0.0);
        }
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
    let values: Vec<E> = bytemuck::pod_collect_to_vec(bytes);
    target
        .par_chunks_mut(SPAN)
        .zip(values.par_chunks(SPAN))
        .for_each(|(target, values)| {
            for (t, &v) in target.iter_mut().zip(values) {
                let v: f32 = v.into();
                *t = if fresh { v } else { *t + v };
            }
        });
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
