//! The decorator type, its prefetch policies and its float primitive.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::{
    AutodiffBackend, Backend, BackendTypes, DTypeUsageSet, ExecutionError,
};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorData, TensorMetadata};

use crate::engine::Engine;
use crate::sink::SinkTag;
use crate::target::StreamTarget;
use crate::weight::HostWeight;

/// A backend decorator that streams frozen weights to `B`'s device through a prefetch ring.
///
/// Every op is forwarded to `B` (its own kernels stay in use); `ModuleOps::linear` and
/// `linear_x_backward` fetch a streamed weight just before they run. Any other op that meets a
/// streamed weight materializes it (counted in [`StepStats::materialized`](crate::StepStats)).
/// `P` says how far ahead the loader fetches. Use it under autodiff:
/// `Autodiff<Offload<Cuda>>` in production, `Autodiff<Offload<Flex>>` on the CPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct Offload<B, P = Lookahead>(PhantomData<(B, P)>);

/// How far ahead of the compute the loader thread fetches weights.
pub trait PrefetchPolicy: Clone + Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// Weight uses the loader may fill ahead of the compute, for a ring of `ring_slots`.
    fn depth(ring_slots: usize) -> usize;
}

/// Replays the recorded order of weight uses, keeping every slot of the ring busy.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lookahead;

impl PrefetchPolicy for Lookahead {
    fn depth(ring_slots: usize) -> usize {
        ring_slots
    }
}

/// Fetches each weight when an op needs it, without overlap: the baseline that shows what the
/// lookahead buys.
#[derive(Clone, Copy, Debug, Default)]
pub struct OnDemand;

impl PrefetchPolicy for OnDemand {
    fn depth(_ring_slots: usize) -> usize {
        0
    }
}

/// The float primitive of [`Offload`]: a tensor on `B`'s device, or a streamed weight (a cheap
/// handle to host memory that autodiff may keep until backward without holding device memory).
/// A trainable parameter may carry the [`GradientSink`](crate::GradientSink) its gradients go
/// to.
pub struct OffloadTensor<B: StreamTarget> {
    repr: Repr<B>,
    pub(crate) sink: Option<SinkTag<B>>,
}

enum Repr<B: StreamTarget> {
    Device(B::FloatTensorPrimitive),
    Streamed(Streamed<B>),
}

/// A weight in host memory and the engine that streams it.
pub(crate) struct Streamed<B: StreamTarget> {
    /// The host payload.
    pub(crate) weight: Arc<HostWeight>,
    /// The engine of its device.
    pub(crate) engine: Arc<Engine<B>>,
}

impl<B: StreamTarget> Clone for Streamed<B> {
    fn clone(&self) -> Self {
        Self {
            weight: self.weight.clone(),
            engine: self.engine.clone(),
        }
    }
}

impl<B: StreamTarget> Clone for OffloadTensor<B> {
    fn clone(&self) -> Self {
        let repr = match &self.repr {
            Repr::Device(t) => Repr::Device(t.clone()),
            Repr::Streamed(s) => Repr::Streamed(s.clone()),
        };
        Self {
            repr,
            sink: self.sink.clone(),
        }
    }
}

impl<B: StreamTarget> fmt::Debug for OffloadTensor<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.repr {
            Repr::Device(t) => f.debug_tuple("Device").field(t).finish(),
            Repr::Streamed(s) => f.debug_tuple("Streamed").field(&s.weight).finish(),
        }
    }
}

impl<B: StreamTarget> TensorMetadata for OffloadTensor<B> {
    fn dtype(&self) -> DType {
        match &self.repr {
            Repr::Device(t) => t.dtype(),
            Repr::Streamed(s) => s.weight.dtype,
        }
    }

    fn shape(&self) -> Shape {
        match &self.repr {
            Repr::Device(t) => t.shape(),
            Repr::Streamed(s) => s.weight.shape.clone(),
        }
    }
}

impl<B: StreamTarget> OffloadTensor<B> {
    /// Wraps a tensor of the inner backend.
    pub fn from_inner(tensor: B::FloatTensorPrimitive) -> Self {
        Self {
            repr: Repr::Device(tensor),
            sink: None,
        }
    }

    pub(crate) fn streamed(weight: Arc<HostWeight>, engine: Arc<Engine<B>>) -> Self {
        Self {
            repr: Repr::Streamed(Streamed { weight, engine }),
            sink: None,
        }
    }

    /// The device the tensor lives on (or is streamed to).
    pub fn device(&self) -> B::Device {
        match &self.repr {
            Repr::Device(t) => B::float_device(t),
            Repr::Streamed(s) => s.engine.device().clone(),
        }
    }

    /// The tensor on the device, unless this is a streamed weight.
    pub fn as_inner(&self) -> Option<&B::FloatTensorPrimitive> {
        match &self.repr {
            Repr::Device(t) => Some(t),
            Repr::Streamed(_) => None,
        }
    }

    /// The tensor on the device, or `Err(self)` for a streamed weight.
    pub fn try_into_inner(self) -> Result<B::FloatTensorPrimitive, Self> {
        match self.repr {
            Repr::Device(t) => Ok(t),
            repr => Err(Self {
                repr,
                sink: self.sink,
            }),
        }
    }

    /// Whether this is a streamed weight rather than a tensor on the device.
    pub fn is_streamed(&self) -> bool {
        matches!(self.repr, Repr::Streamed(_))
    }

    /// The streamed weight, if this is one.
    pub(crate) fn as_streamed(&self) -> Option<&Streamed<B>> {
        match &self.repr {
            Repr::Streamed(s) => Some(s),
            Repr::Device(_) => None,
        }
    }

    /// The tensor on the device: a streamed weight is materialized (and counted).
    pub fn into_inner(self) -> B::FloatTensorPrimitive {
        match self.repr {
            Repr::Device(t) => t,
            Repr::Streamed(s) => s.engine.materialize(&s.weight),
        }
    }

    /// The values, read from host memory for a streamed weight. A device tensor's read is
    /// started now, in the calling thread's order, and awaited with the returned future.
    pub(crate) fn into_data(
        self,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        let read = match self.repr {
            Repr::Device(t) => Ok(B::read_data(t)),
            Repr::Streamed(s) => Err(s.weight),
        };
        async move {
            match read {
                Ok(read) => read.await,
                Err(weight) => Ok(weight.decode()),
            }
        }
    }
}

impl<B: StreamTarget, P: PrefetchPolicy> BackendTypes for Offload<B, P> {
    type Device = B::Device;
    type FloatTensorPrimitive = OffloadTensor<B>;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: StreamTarget, P: PrefetchPolicy> Backend for Offload<B, P> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("offload<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}

/// A backend whose float tensors can be streamed weights: [`Offload`], and [`Autodiff`] over it.
pub trait OffloadBackend: Backend {
    /// The backend that computes.
    type Target: StreamTarget;

    /// `tensor` as a float primitive of this backend (untracked by autodiff).
    fn from_offload(tensor: OffloadTensor<Self::Target>) -> FloatTensor<Self>;

    /// The [`OffloadTensor`] under a float primitive of this backend.
    fn as_offload(tensor: &FloatTensor<Self>) -> &OffloadTensor<Self::Target>;

    /// The computing backend's device.
    fn target_device(device: &Self::Device) -> <Self::Target as BackendTypes>::Device;
}

impl<B: StreamTarget, P: PrefetchPolicy> OffloadBackend for Offload<B, P> {
    type Target = B;

    fn from_offload(tensor: OffloadTensor<B>) -> OffloadTensor<B> {
        tensor
    }

    fn as_offload(tensor: &OffloadTensor<B>) -> &OffloadTensor<B> {
        tensor
    }

    fn target_device(device: &B::Device) -> B::Device {
        device.clone()
    }
}

impl<B: StreamTarget, P: PrefetchPolicy, C: CheckpointStrategy> OffloadBackend
    for Autodiff<Offload<B, P>, C>
{
    type Target = B;

    fn from_offload(tensor: OffloadTensor<B>) -> FloatTensor<Self> {
        <Self as AutodiffBackend>::from_inner(tensor)
    }

    fn as_offload(tensor: &FloatTensor<Self>) -> &OffloadTensor<B> {
        &tensor.primitive
    }

    fn target_device(device: &B::Device) -> B::Device {
        device.clone()
    }
}
