//! [`GradientSink`]: the gradients of trainable parameters taken to host memory as the backward
//! produces them, so that the device never holds them all at once.
//!
//! [`GradientSink::attach`] tags the parameters of a module; the model reads each through
//! `burn_kernels::trainable`, whose backward hands the gradient to the sink instead of the
//! autodiff graph. The compute thread only starts the copy ([`StreamTarget::start_download`]:
//! on CUDA an asynchronous copy after the work submitted so far, on a stream of its own); a
//! worker thread finishes it and adds the values to the parameter's sum, in the gradient's
//! dtype (each addition in f32, rounded to nearest even, as the device adds them), so that the
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
/// use burn_offload::{GradientSink, HostGradient, Offload};
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
/// let expected = HostGradient::F32(&[3.0, 3.0]);
/// assert_eq!(sums.iter().collect::<Vec<_>>(), vec![("w", expected)]);
/// # Ok::<(), burn_offload::OffloadError>(())
/// ```
pub struct GradientSink<B: StreamTarget> {
    shared: Arc<Shared>,
    /// Taken at drop, which ends the worker's loop.
    jobs: Option<Sender<Job<B>>>,
    worker: Option<JoinHandle<()>>,
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
    values: Vec<Option<SumBuffer>>,
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

    /// The sums, once `waiting` no longer holds of them (the sink's thread settles copies).
    fn wait_while(&self, waiting: impl FnMut(&mut Sums) -> bool) -> MutexGuard<'_, Sums> {
        self.settled
            .wait_while(self.lock(), waiting)
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
                        state.values[index] = sum;
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
            jobs: Some(jobs),
            worker: Some(worker),
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
        let mut state = self.shared.wait_while(|state| state.pending > 0);
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
        drop(
            self.shared
                .wait_while(|state| state.pending > 0 && state.pending_bytes + bytes > IN_FLIGHT),
        );
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
        let sent = self.jobs.as_ref().map(|jobs| {
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
        self.jobs.take();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// The values of a gradient sum, in the gradients' dtype.
enum SumBuffer {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

impl SumBuffer {
    /// Zeros (pages from the allocator, first written by the parallel copy that fills them).
    fn zeros(dtype: DType, numel: usize) -> Option<Self> {
        Some(match dtype {
            DType::F32 => Self::F32(bytemuck::zeroed_vec(numel)),
            DType::BF16 => Self::Bf16(bytemuck::zeroed_vec(numel)),
            DType::F16 => Self::F16(bytemuck::zeroed_vec(numel)),
            _ => return None,
        })
    }

    fn fits(&self, dtype: DType, numel: usize) -> bool {
        match self {
            Self::F32(v) => dtype == DType::F32 && v.len() == numel,
            Self::Bf16(v) => dtype == DType::BF16 && v.len() == numel,
            Self::F16(v) => dtype == DType::F16 && v.len() == numel,
        }
    }

    fn view(&self) -> HostGradient<'_> {
        match self {
            Self::F32(v) => HostGradient::F32(v),
            Self::Bf16(v) => HostGradient::Bf16(v),
            Self::F16(v) => HostGradient::F16(v),
        }
    }

    /// Writes (`fresh`) or adds `bytes`, values of the buffer's dtype, from value `at` on.
    fn add(&mut self, at: usize, bytes: &[u8], fresh: bool) -> usize {
        match self {
            Self::F32(v) => add_values(&mut v[at..], bytes, fresh),
            Self::Bf16(v) => add_values(&mut v[at..], bytes, fresh),
            Self::F16(v) => add_values(&mut v[at..], bytes, fresh),
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }
}

/// A float type a gradient sum holds.
trait SumValue: bytemuck::Pod + Send + Sync {
    fn add(self, other: Self) -> Self;
}

impl SumValue for f32 {
    fn add(self, other: Self) -> Self {
        self + other
    }
}

impl SumValue for bf16 {
    fn add(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32() + other.to_f32())
    }
}

impl SumValue for f16 {
    fn add(self, other: Self) -> Self {
        f16::from_f32(self.to_f32() + other.to_f32())
    }
}

/// Writes (`fresh`) or adds the values of `bytes` into the start of `target`, on all cores;
/// returns how many.
fn add_values<T: SumValue>(target: &mut [T], bytes: &[u8], fresh: bool) -> usize {
    let size = size_of::<T>();
    let count = (bytes.len() / size).min(target.len());
    target[..count]
        .par_chunks_mut(SPAN)
        .zip(bytes.par_chunks(SPAN * size))
        .for_each(|(target, bytes)| {
            for (t, b) in target.iter_mut().zip(bytes.chunks_exact(size)) {
                let v = bytemuck::pod_read_unaligned::<T>(b);
                *t = if fresh { v } else { t.add(v) };
            }
        });
    count
}

/// `sum` plus the downloaded gradient of `job`, piece by piece (the gradient itself when the
/// sum is `fresh`: its buffer holds a previous step's values, or none yet).
fn add_download<B: StreamTarget>(
    sum: Option<SumBuffer>,
    fresh: bool,
    job: Job<B>,
    staging: &mut B::Staging,
) -> (Option<SumBuffer>, Result<(), OffloadError>) {
    let unsupported = || OffloadError::Device {
        action: "adding a gradient to its sum",
        reason: format!("gradients of dtype {:?} are not summed", job.dtype),
    };
    let sum = sum
        .filter(|sum| sum.fits(job.dtype, job.numel))
        .or_else(|| SumBuffer::zeros(job.dtype, job.numel));
    let Some(mut sum) = sum else {
        return (None, Err(unsupported()));
    };
    let mut at = 0;
    let result = B::finish_download(job.download, staging, &mut |bytes: &[u8]| {
        at += sum.add(at, bytes, fresh);
    });
    let result = result.and_then(|()| {
        if at == sum.len() {
            Ok(())
        } else {
            Err(OffloadError::Device {
                action: "adding a gradient to its sum",
                reason: format!("{at} values for a sum of {} values", sum.len()),
            })
        }
    });
    (Some(sum), result)
}

/// The gradient sums of one step, by module path, as [`GradientSink::take`] hands them over;
/// the sink's next gradients wait until they are dropped.
pub struct GradientSums<'a> {
    state: MutexGuard<'a, Sums>,
}

impl GradientSums<'_> {
    /// Each parameter's module path and the sum of its gradients (flat, in the gradients'
    /// dtype), for the parameters that got any since the last step.
    pub fn iter(&self) -> impl Iterator<Item = (&str, HostGradient<'_>)> {
        let state = &*self.state;
        state
            .paths
            .iter()
            .zip(&state.values)
            .zip(&state.filled)
            .filter_map(|((path, sum), &filled)| match (sum, filled) {
                (Some(sum), true) => Some((path.as_str(), sum.view())),
                _ => None,
            })
    }
}

/// A gradient sum in host memory: flat values in the gradients' dtype.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostGradient<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// bfloat16 values.
    Bf16(&'a [bf16]),
    /// float16 values.
    F16(&'a [f16]),
}

impl HostGradient<'_> {
    /// Values in the sum.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    /// Whether the sum has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::tensor::{Distribution, Tensor};

    type B = Autodiff<crate::Offload<Flex>>;

    #[derive(burn::module::Module, Debug)]
    struct Net<B: burn::tensor::backend::Backend> {
        w: Param<Tensor<B, 2>>,
        frozen: Param<Tensor<B, 2>>,
    }

    /// Three micro-batches: the sum is the graph's, added in the same order; a frozen
    /// parameter sends nothing; once the sums are dropped, the next step starts anew.
    #[test]
    fn sums_are_the_graphs() {
        let device = Default::default();
        let random =
            |shape: [usize; 2]| Tensor::<B, 2>::random(shape, Distribution::Default, &device);
        let net = Net {
            w: Param::from_tensor(random([3, 70]).require_grad()),
            frozen: Param::from_tensor(random([70, 2])),
        };
        let x: Vec<Tensor<B, 2>> = (0..3).map(|_| random([5, 3])).collect();
        let loss = |w: Tensor<B, 2>, x: &Tensor<B, 2>, f: Tensor<B, 2>| {
            x.clone().matmul(w).matmul(f).powi_scalar(2).sum()
        };
        let mut expected: Option<Tensor<Flex, 2>> = None;
        for x in &x {
            let grads = loss(net.w.val(), x, net.frozen.val()).backward();
            let g = net.w.grad(&grads).unwrap().into_data();
            let g = Tensor::<Flex, 2>::from_data(g, &device);
            expected = Some(match expected {
                Some(sum) => sum + g,
                None => g,
            });
        }
        let expected: Vec<f32> = expected.unwrap().into_data().to_vec().unwrap();

        let sink = GradientSink::<Flex>::new(&device).unwrap();
        for round in 0..2 {
            let net = sink.attach(net.clone());
            for x in &x {
                let w = burn_kernels::trainable(net.w.val());
                let grads = loss(w, x, net.frozen.val()).backward();
                assert!(net.w.grad(&grads).is_none());
            }
            let sums = sink.take().unwrap();
            let taken: Vec<_> = sums.iter().collect();
            assert_eq!(
                taken,
                vec![("w", HostGradient::F32(&expected))],
                "round {round}"
            );
        }
    }
}
