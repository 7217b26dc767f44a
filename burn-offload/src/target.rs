//! The device side of the mechanism, per inner backend: host memory, ring slots, uploads and
//! fences. `Flex` (CPU) implements it here; `CubeBackend<CudaRuntime>` in `cuda.rs`.

use std::alloc::Layout;
use std::convert::Infallible;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use burn::backend::Flex;
use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Bytes, DType, FloatDType, TensorData};
use cubecl_common::bytes::{AllocationController, AllocationProperty};

use burn_kernels::FusedOps;

use crate::error::OffloadError;
use crate::weight::{Encoding, HostMemory, HostWeight};

/// A backend whose device can host the offload ring: [`Flex`] (on the CPU, for tests) and, with
/// the `cuda` feature, Burn's CUDA backend without fusion. Its fused kernels
/// ([`FusedOps`]) serve the decorator's models.
///
/// The engine calls these functions; it decides when, they do the work. `fill`, `poison` and
/// `prepare` run on the loader thread (the first two also on the compute thread, for on-demand
/// fetches), all others on the compute thread.
pub trait StreamTarget: FusedOps {
    /// The slots of one ring on one device.
    type Ring: Send + Sync + 'static;
    /// A point in the device's compute order: once it has passed, a slot read before it may be
    /// overwritten.
    type Fence: Send + 'static;

    /// Moves a weight's wire bytes into host memory the device copies from.
    fn host_memory(
        bytes: Vec<u8>,
        device: &Self::Device,
    ) -> Result<Box<dyn HostMemory>, OffloadError>;

    /// Bytes `weight` occupies in a ring slot.
    fn slot_bytes(weight: &HostWeight) -> usize;

    /// Allocates `slots` slots of `slot_bytes` bytes each.
    fn new_ring(
        device: &Self::Device,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Self::Ring, OffloadError>;

    /// Copies `weight` into `slot`, returning once the copy has completed.
    fn fill(ring: &Self::Ring, slot: usize, weight: &HostWeight) -> Result<(), OffloadError>;

    /// Overwrites `slot` with `0xFF` bytes: NaN in every float format.
    fn poison(ring: &Self::Ring, slot: usize) -> Result<(), OffloadError>;

    /// The weight in `slot` as a tensor of this backend, in the weight's dtype.
    fn view(
        ring: &Self::Ring,
        slot: usize,
        weight: &HostWeight,
        device: &Self::Device,
    ) -> FloatTensor<Self>;

    /// Device bytes the [`prepare`](Self::prepare)d form of `weight` takes beside its slot: its
    /// decoded size where its [`view`](Self::view) is a tensor of its own, else none.
    fn prepared_bytes(weight: &HostWeight) -> usize {
        if Self::view_reads_slot(weight) {
            0
        } else {
            weight.device_bytes()
        }
    }

    /// Runs on the loader thread once `slot` holds `weight`: the weight as ops read it, made
    /// ahead of its use, or `None` where ops read the slot in place. Returns once the slot's
    /// bytes are no longer read, so the slot may be refilled whatever becomes of the tensor; the
    /// engine keeps the tensor alive until a fence after the ops that read it has passed. By
    /// default the [`view`](Self::view) of a weight decoded into a tensor of its own, made on
    /// the loader thread (on CUDA, on its own stream, off the compute's) and waited for.
    fn prepare(
        ring: &Self::Ring,
        slot: usize,
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<Option<FloatTensor<Self>>, OffloadError> {
        if Self::view_reads_slot(weight) {
            return Ok(None);
        }
        let decoded = Self::view(ring, slot, weight, device);
        Self::sync(device).map_err(|e| OffloadError::Device {
            action: "decoding a weight on the loader thread",
            reason: format!("{e:?}"),
        })?;
        Ok(Some(decoded))
    }

    /// Whether the [`view`](Self::view) of `weight` reads its slot while the op runs; a view
    /// decoded into a tensor of its own lets the slot go as soon as the decode was submitted.
    fn view_reads_slot(_weight: &HostWeight) -> bool {
        true
    }

    /// Bytes `weight` occupies on the device as [`upload_compact`](Self::upload_compact) keeps
    /// it. By default the decoded size.
    fn compact_bytes(weight: &HostWeight) -> usize {
        weight.device_bytes()
    }

    /// Uploads `weight` in the form [`expand`](Self::expand) decodes at each use. By default
    /// decoded, as [`upload`](Self::upload).
    fn upload_compact(
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        Self::upload(weight, device)
    }

    /// `weight` as a tensor of its dtype, from `stored`, what
    /// [`upload_compact`](Self::upload_compact) returned (read only by this function). By
    /// default `stored` itself.
    fn expand(
        stored: &FloatTensor<Self>,
        _weight: &HostWeight,
        _device: &Self::Device,
    ) -> FloatTensor<Self> {
        stored.clone()
    }

    /// `weight` in a tensor of its own that no later fill of a slot changes, given `view`, its
    /// [`view`](Self::view) of a slot: what the engine keeps between two uses.
    fn keep(
        view: FloatTensor<Self>,
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, OffloadError>;

    /// Uploads `weight` into a tensor of its own.
    fn upload(
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, OffloadError>;

    /// A fence after the work this thread has submitted so far, or `None` when that work has
    /// already completed.
    fn fence(device: &Self::Device) -> Option<Self::Fence>;

    /// Blocks until `fence` has passed.
    fn wait(fence: Self::Fence);

    /// `data` as a tensor on `device`: what `float_from_data` of the decorator runs. By default
    /// the backend's own upload.
    fn upload_data(data: TensorData, device: &Self::Device) -> FloatTensor<Self> {
        Self::float_from_data(data, device)
    }

    /// The values of `tensor`: what `float_into_data` of the decorator runs. By default the
    /// backend's own read.
    fn read_data(
        tensor: FloatTensor<Self>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        Self::float_into_data(tensor)
    }

    /// A copy of a device tensor into host memory, begun by
    /// [`start_download`](Self::start_download).
    type Download: Send + 'static;
    /// What the thread that finishes downloads reads them through (page-locked memory on CUDA).
    type Staging: Send + 'static;

    /// The staging memory of one downloading thread.
    fn download_staging(device: &Self::Device) -> Result<Self::Staging, OffloadError>;

    /// Begins copying `tensor` into host memory once the work submitted so far has run, on the
    /// compute thread; the tensor's memory is kept until the copy is done.
    fn start_download(tensor: FloatTensor<Self>) -> Result<Self::Download, OffloadError>;

    /// Completes `download` on another thread: hands its bytes (row-major, in the tensor's
    /// dtype) to `read` in consecutive pieces of whole values.
    fn finish_download(
        download: Self::Download,
        staging: &mut Self::Staging,
        read: &mut dyn FnMut(&[u8]),
    ) -> Result<(), OffloadError>;

    /// Device bytes in use, where the backend reports them (on CUDA, everything the driver
    /// counts as used on the device, the pages an allocator keeps after freeing included).
    fn memory_in_use(device: &Self::Device) -> Option<u64>;

    /// Device bytes the backend's allocator has handed out and not taken back, where it
    /// reports them: memory that a later step cannot reuse. By default
    /// [`memory_in_use`](Self::memory_in_use).
    fn memory_handed_out(device: &Self::Device) -> Option<u64> {
        Self::memory_in_use(device)
    }

    /// Device bytes the backend's allocator holds in pages for the calling thread's work, handed
    /// out or kept free for reuse, where it reports them: beside
    /// [`memory_in_use`](Self::memory_in_use), what the rest (the runtime, libraries' workspaces,
    /// other threads' pools) takes.
    fn memory_pooled(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// Returns to the system the device memory that freed allocations left in the backend's
    /// pool, where it is kept for reuse; called once the work that freed it has completed.
    fn trim_freed(_device: &Self::Device) {}
}

/// A reading of the device memory in use, in place of the backend's own
/// ([`StreamTarget::memory_in_use`]): for a backend that reports none (the CPU), so that what
/// depends on the reading (the trainer's measured budget) can run and be tested there.
///
/// Any `Fn(u64) -> Option<u64> + Send + Sync` is a probe.
pub trait MemoryProbe: Send + Sync {
    /// Bytes in use on the device now, or `None` when unknown. `weights` is what the engine
    /// itself holds there at that moment (resident copies, the ring, a weight being uploaded),
    /// for a probe that models a device rather than asking one. Called with the engine's lock
    /// held: a probe must not call back into its weight stream.
    fn in_use(&self, weights: u64) -> Option<u64>;
}

impl<F: Fn(u64) -> Option<u64> + Send + Sync> MemoryProbe for F {
    fn in_use(&self, weights: u64) -> Option<u64> {
        self(weights)
    }
}

/// Memory of one CPU ring slot, aligned for any element type.
struct SlotMemory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the memory is a plain heap allocation; the engine serializes access to it (a slot is
// written only while no tensor reads it: after the previous lease's release).
unsafe impl Send for SlotMemory {}
// SAFETY: as above.
unsafe impl Sync for SlotMemory {}

impl SlotMemory {
    const ALIGN: usize = 64;

    fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), Self::ALIGN).expect("slot layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, layout }
    }

    /// # Safety
    /// No write to the slot may happen while the returned slice is alive.
    unsafe fn bytes(&self, len: usize) -> &[u8] {
        assert!(len <= self.layout.size(), "slot too small");
        // SAFETY: in bounds; the absence of writers is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }

    /// # Safety
    /// No tensor may read the slot while the returned slice is alive.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self, len: usize) -> &mut [u8] {
        assert!(len <= self.layout.size(), "slot too small");
        // SAFETY: in bounds; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
    }
}

impl Drop for SlotMemory {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// A view of the first `len` bytes of a slot, handed to Flex as the storage of a tensor: the
/// tensor reads the slot in place, so a read after the slot was reused sees the new content.
struct SlotView {
    memory: Arc<SlotMemory>,
    len: usize,
}

impl AllocationController for SlotView {
    fn alloc_align(&self) -> usize {
        SlotMemory::ALIGN
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Other
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: in bounds of the allocation; the tensor owning this view is the slot's only
        // reader while its lease lasts.
        unsafe { std::slice::from_raw_parts_mut(self.memory.ptr.as_ptr().cast(), self.len) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        // SAFETY: in bounds of the allocation, which `self.memory` keeps alive.
        unsafe { std::slice::from_raw_parts(self.memory.ptr.as_ptr().cast(), self.len) }
    }
}

/// The slots of a CPU ring.
pub struct HostRing {
    slots: Vec<Arc<SlotMemory>>,
    slot_bytes: usize,
}

impl StreamTarget for Flex {
    type Ring = HostRing;
    type Fence = Infallible;

    fn host_memory(
        bytes: Vec<u8>,
        _device: &Self::Device,
    ) -> Result<Box<dyn HostMemory>, OffloadError> {
        Ok(Box::new(bytes))
    }

    /// The slot holds the wire payload, as on CUDA: a weight in its own dtype is computed on in
    /// place, another is decoded from it.
    fn slot_bytes(weight: &HostWeight) -> usize {
        weight.wire_bytes()
    }

    fn new_ring(
        _device: &Self::Device,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<HostRing, OffloadError> {
        Ok(HostRing {
            slots: (0..slots)
                .map(|_| Arc::new(SlotMemory::new(slot_bytes)))
                .collect(),
            slot_bytes,
        })
    }

    fn fill(ring: &HostRing, slot: usize, weight: &HostWeight) -> Result<(), OffloadError> {
        let payload = weight.memory.bytes();
        // SAFETY: the engine fills a slot only after the lease that read it was released.
        let dst = unsafe { ring.slots[slot].bytes_mut(payload.len()) };
        dst.copy_from_slice(payload);
        Ok(())
    }

    fn poison(ring: &HostRing, slot: usize) -> Result<(), OffloadError> {
        // SAFETY: the engine poisons a slot only once its lease was released.
        unsafe { ring.slots[slot].bytes_mut(ring.slot_bytes) }.fill(0xFF);
        Ok(())
    }

    fn view(
        ring: &HostRing,
        slot: usize,
        weight: &HostWeight,
        device: &Self::Device,
    ) -> FloatTensor<Self> {
        if weight.encoding != Encoding::Native {
            // SAFETY: the slot holds this weight's payload, and the engine fills it again only
            // after this use's lease was released.
            let payload = unsafe { ring.slots[slot].bytes(weight.wire_bytes()) };
            return Flex::float_from_data(weight.decode_bytes(payload), device);
        }
        let len = weight.device_bytes();
        let view = SlotView {
            memory: ring.slots[slot].clone(),
            len,
        };
        // SAFETY: the slot holds `len` initialized bytes (filled with this weight).
        let bytes = unsafe { Bytes::from_controller(Box::new(view), len) };
        let data = TensorData::from_bytes(bytes, weight.shape.clone(), weight.dtype);
        Flex::float_from_data(data, device)
    }

    /// Only a weight in its own dtype: another is decoded into a tensor of its own.
    fn view_reads_slot(weight: &HostWeight) -> bool {
        weight.encoding == Encoding::Native
    }

    /// A weight sent as bfloat16 stays so, and is cast at each use.
    fn compact_bytes(weight: &HostWeight) -> usize {
        match weight.encoding {
            Encoding::Bf16 => weight.wire_bytes(),
            _ => weight.device_bytes(),
        }
    }

    fn upload_compact(
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        if weight.encoding != Encoding::Bf16 {
            return Self::upload(weight, device);
        }
        let bytes = weight.memory.bytes().to_vec();
        let data = TensorData::from_bytes_vec(bytes, weight.shape.clone(), DType::BF16);
        Ok(Flex::float_from_data(data, device))
    }

    fn expand(
        stored: &FloatTensor<Self>,
        weight: &HostWeight,
        _device: &Self::Device,
    ) -> FloatTensor<Self> {
        match weight.encoding {
            Encoding::Bf16 => Flex::float_cast(stored.clone(), FloatDType::from(weight.dtype)),
            _ => stored.clone(),
        }
    }

    /// Decodes `weight` from host memory again: on the CPU, copying the slot costs as much.
    fn keep(
        _view: FloatTensor<Self>,
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        Self::upload(weight, device)
    }

    fn upload(
        weight: &HostWeight,
        device: &Self::Device,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        Ok(Flex::float_from_data(weight.decode(), device))
    }

    fn fence(_device: &Self::Device) -> Option<Infallible> {
        None
    }

    fn wait(fence: Infallible) {
        match fence {}
    }

    fn memory_in_use(_device: &Self::Device) -> Option<u64> {
        None
    }

    downloads_read_at_once!();
}

/// The download methods of [`StreamTarget`] for a backend without a copy engine of its own:
/// the values are read at once, through the backend's own path, when the download starts.
macro_rules! downloads_read_at_once {
    () => {
        type Download = burn::tensor::TensorData;
        type Staging = ();

        fn download_staging(_device: &Self::Device) -> Result<(), $crate::OffloadError> {
            Ok(())
        }

        fn start_download(
            tensor: burn::tensor::ops::FloatTensor<Self>,
        ) -> Result<burn::tensor::TensorData, $crate::OffloadError> {
            cubecl_common::future::block_on(Self::float_into_data(tensor)).map_err(|e| {
                $crate::OffloadError::Device {
                    action: "reading a tensor back from the device",
                    reason: format!("{e:?}"),
                }
            })
        }

        fn finish_download(
            download: burn::tensor::TensorData,
            _staging: &mut (),
            read: &mut dyn FnMut(&[u8]),
        ) -> Result<(), $crate::OffloadError> {
            read(download.as_bytes());
            Ok(())
        }
    };
}
pub(crate) use downloads_read_at_once;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight::Encoding;
    use burn::tensor::{DType, Shape};

    fn weight(values: Vec<f32>) -> Arc<HostWeight> {
        let n = values.len();
        let data = TensorData::new(values, [n]);
        HostWeight::new(
            "w".into(),
            Shape::new([n]),
            DType::F32,
            Encoding::Native,
            Box::new(data.bytes.to_vec()),
        )
    }

    fn read(t: FloatTensor<Flex>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    #[test]
    fn a_view_reads_the_slot_in_place() {
        let device = Default::default();
        let ring = Flex::new_ring(&device, 2, 16).unwrap();
        let a = weight(vec![1.0, 2.0, 3.0]);
        let b = weight(vec![4.0, 5.0, 6.0, 7.0]);
        Flex::fill(&ring, 0, &a).unwrap();
        Flex::fill(&ring, 1, &b).unwrap();
        let view = Flex::view(&ring, 0, &a, &device);
        assert_eq!(read(view.clone()), vec![1.0, 2.0, 3.0]);
        assert_eq!(
            read(Flex::view(&ring, 1, &b, &device)),
            vec![4.0, 5.0, 6.0, 7.0]
        );
        // Reusing slot 0 changes what an outstanding view reads: this is why the engine
        // never lets a view outlive its lease, and why poisoning makes such a read visible.
        Flex::fill(&ring, 0, &b).unwrap();
        assert_eq!(read(view.clone()), vec![4.0, 5.0, 6.0]);
        Flex::poison(&ring, 0).unwrap();
        assert!(read(view).iter().all(|v| v.is_nan()));
        // An uploaded copy does not depend on the ring.
        let owned = Flex::upload(&a, &device).unwrap();
        Flex::poison(&ring, 1).unwrap();
        assert_eq!(read(owned), vec![1.0, 2.0, 3.0]);
    }
}
