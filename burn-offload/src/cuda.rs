//! The CUDA mechanism (`CubeBackend<CudaRuntime>`, Burn's `Cuda` without fusion).
//!
//! Host payloads live in page-locked memory (`cuMemHostAlloc`). Ring slots are buffers that
//! Burn allocates (`ComputeClient::empty`) and keeps, so Burn kernels read them as ordinary
//! tensors; the loader copies into them with raw `cuMemcpyHtoDAsync` on a CUDA stream of its own
//! and waits for the copy before marking the slot ready, so an op never starts before its weight
//! has arrived. The compute thread releases a slot with a fence (`ComputeClient::sync`, an event
//! on its stream, taken after the op was submitted); the loader waits on it before overwriting.
//! CubeCL 0.10's own upload path copies through pageable memory on the device-runner thread
//! (0.62 GB/s measured), which is why the copies bypass it. See `DESIGN.md`.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{Bytes, DType, FloatDType, Shape, TensorData};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use burn_kernels::cuda::{HostCopy, SideContext, address, drain};
use cubecl::Runtime;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::{Handle, ServerError};
use cubecl_common::bytes::{AllocationController, AllocationProperty};
use cubecl_common::future::{DynFut, block_on};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, result, sys};
use rayon::prelude::*;

use crate::error::OffloadError;
use crate::target::StreamTarget;
use crate::weight::{Encoding, HostMemory, HostWeight};

fn device_error(action: &'static str) -> impl Fn(DriverError) -> OffloadError {
    move |e| OffloadError::Device {
        action,
        reason: e.to_string(),
    }
}

/// `device`'s side context (burn-kernels'): its CUDA context and streams.
fn side_context(device: &CudaDevice) -> Result<Arc<SideContext>, OffloadError> {
    SideContext::of(device).map_err(|e| OffloadError::Device {
        action: "opening the CUDA side context",
        reason: e.to_string(),
    })
}

/// `device`'s side context and a new stream of its own (`action` names its creation in errors).
fn side_stream(
    device: &CudaDevice,
    action: &'static str,
) -> Result<(Arc<SideContext>, Arc<CudaStream>), OffloadError> {
    let side = side_context(device)?;
    let stream = side.context().new_stream().map_err(device_error(action))?;
    Ok((side, stream))
}

/// The CUDA context and the copy stream of `device`, shared by the rings and the direct path.
fn copy_stream(device: &CudaDevice) -> Result<(Arc<CudaContext>, Arc<CudaStream>), OffloadError> {
    let side = side_context(device)?;
    Ok((side.context().clone(), side.copy_stream().clone()))
}

/// The entry of `device` in a per-device registry, made by `make` on the device's first use.
fn per_device<'a, T>(
    all: &'a mut Vec<(usize, T)>,
    device: &CudaDevice,
    make: impl FnOnce() -> Result<T, OffloadError>,
) -> Result<&'a mut T, OffloadError> {
    let at = match all.iter().position(|(index, _)| *index == device.index) {
        Some(at) => at,
        None => {
            all.push((device.index, make()?));
            all.len() - 1
        }
    };
    Ok(&mut all[at].1)
}

/// Page-locked host memory.
pub struct PinnedMemory {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a plain host allocation; a weight's is never written after it was filled at
// creation, a staging buffer's only by the one thread that owns it.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above: shared reads only.
unsafe impl Sync for PinnedMemory {}

/// `bytes` in page-locked memory of `ctx`.
fn pinned(bytes: Vec<u8>, ctx: Arc<CudaContext>) -> Result<PinnedMemory, OffloadError> {
    page_locked(bytes.len(), ctx, |ptr, len| {
        // SAFETY: `ptr` holds `len` bytes, a fresh allocation that `bytes` does not overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, len) }
    })
}

/// `len` bytes of page-locked memory of `ctx`, zeroed.
fn pinned_zeros(len: usize, ctx: Arc<CudaContext>) -> Result<PinnedMemory, OffloadError> {
    page_locked(len, ctx, |ptr, len| {
        // SAFETY: `ptr` holds `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) }
    })
}

/// `len` bytes of page-locked memory of `ctx`, initialized by `fill(ptr, len)`, which must
/// write all of them.
fn page_locked(
    len: usize,
    ctx: Arc<CudaContext>,
    fill: impl FnOnce(*mut u8, usize),
) -> Result<PinnedMemory, OffloadError> {
    let ptr = if len == 0 {
        std::ptr::null_mut()
    } else {
        ctx.bind_to_thread()
            .map_err(device_error("binding the CUDA context"))?;
        // SAFETY: a fresh allocation of `len` bytes, which `fill` initializes right below.
        // Portable: every context of the process (every GPU's) copies from it as page-locked.
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(device_error("allocating page-locked host memory"))?
            .cast::<u8>();
        fill(ptr, len);
        ptr
    };
    Ok(PinnedMemory { ptr, len, ctx })
}

impl PinnedMemory {
    /// The bytes, to write.
    fn bytes_mut(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: `len` bytes allocated and initialized in `pinned`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl HostMemory for PinnedMemory {
    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` bytes allocated and initialized in `host_memory`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        if self.len > 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: allocated by `malloc_host` and not freed before.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// Bytes of page-locked memory a downloading thread reads gradients through.
const STAGING: usize = 64 << 20;

/// A device tensor on its way to host memory: the tensor (kept alive until the copy), its
/// address and size, and the point in the compute order after which it may be read.
pub struct CudaDownload {
    tensor: CubeTensor<CudaRuntime>,
    ptr: u64,
    len: usize,
    fence: DynFut<Result<(), ServerError>>,
}

/// The page-locked buffer and the stream of one downloading thread: device-to-host copies on
/// a stream of their own, so that they overlap the uploads of the copy stream.
pub struct CudaStaging {
    memory: PinnedMemory,
    stream: Arc<CudaStream>,
}

/// The page-locked buffers that uploads from ordinary host memory go through on one device,
/// taken in turn, and the stream of their copies (apart from the ring's, whose copies must not
/// wait behind the compute order).
struct Uploads {
    side: Arc<SideContext>,
    stream: Arc<CudaStream>,
    buffers: Vec<Option<StagedUpload>>,
    next: usize,
    /// Page-locked data copied from in place, and the event after its copy.
    held: Vec<(TensorData, CudaEvent)>,
}

/// A staging buffer and the event after its last copy, before which it is not rewritten.
struct StagedUpload {
    memory: PinnedMemory,
    copied: CudaEvent,
}

impl Uploads {
    /// Staging buffers per device: an upload waits only when the one before the previous is
    /// still waiting for the GPU.
    const BUFFERS: usize = 2;

    /// Copies `bytes` into `handle` on `device` through a staging buffer, in the calling
    /// thread's compute order (`burn_kernels::cuda::copy_in_order`).
    fn copy(
        device: &CudaDevice,
        client: &ComputeClient<CudaRuntime>,
        handle: &Handle,
        bytes: &[u8],
    ) -> Result<(), OffloadError> {
        Self::on(device, |uploads| {
            uploads.stage_and_copy(client, handle, bytes)
        })
    }

    /// Runs `work` with `device`'s uploads, made on the device's first upload.
    fn on<R>(
        device: &CudaDevice,
        work: impl FnOnce(&mut Self) -> Result<R, OffloadError>,
    ) -> Result<R, OffloadError> {
        static ALL: Mutex<Vec<(usize, Uploads)>> = Mutex::new(Vec::new());
        let mut all = ALL.lock().unwrap_or_else(|p| p.into_inner());
        work(per_device(&mut all, device, || Self::new(device))?)
    }

    fn new(device: &CudaDevice) -> Result<Self, OffloadError> {
        let (side, stream) = side_stream(device, "creating the upload stream")?;
        Ok(Self {
            side,
            stream,
            buffers: (0..Self::BUFFERS).map(|_| None).collect(),
            next: 0,
            held: Vec::new(),
        })
    }

    /// Copies `data`, whose bytes are page-locked, into `handle` on `device` in the calling
    /// thread's compute order, straight from its memory; `data` is kept until the copy is done.
    fn copy_pinned(
        device: &CudaDevice,
        client: &ComputeClient<CudaRuntime>,
        handle: &Handle,
        data: TensorData,
    ) -> Result<(), OffloadError> {
        Self::on(device, |uploads| {
            uploads.held.retain(|(_, copied)| !copied.is_complete());
            let copy = HostCopy::ToDevice(data.as_bytes());
            let copied = copy_in_order(client, &uploads.side, &uploads.stream, handle, copy)?;
            uploads.held.push((data, copied));
            Ok(())
        })
    }

    fn stage_and_copy(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        handle: &Handle,
        bytes: &[u8],
    ) -> Result<(), OffloadError> {
        let slot = &mut self.buffers[self.next];
        self.next = (self.next + 1) % Self::BUFFERS;
        let reused = match slot.take() {
            Some(staged) => {
                staged
                    .copied
                    .synchronize()
                    .map_err(device_error("waiting for an earlier upload"))?;
                Some(staged.memory).filter(|memory| memory.len >= bytes.len())
            }
            None => None,
        };
        let mut memory = match reused {
            Some(memory) => memory,
            None => pinned_zeros(bytes.len(), self.side.context().clone())?,
        };
        let staged = &mut memory.bytes_mut()[..bytes.len()];
        staged
            .par_chunks_mut(COPY_PIECE)
            .zip(bytes.par_chunks(COPY_PIECE))
            .for_each(|(to, from)| to.copy_from_slice(from));
        let copy = HostCopy::ToDevice(staged);
        let copied = copy_in_order(client, &self.side, &self.stream, handle, copy)?;
        *slot = Some(StagedUpload { memory, copied });
        Ok(())
    }
}

/// Large reads of one device: page-locked buffers they land in, kept for reuse once the data
/// read into them is dropped, and the stream of their copies. A checkpointed block's input
/// goes to host memory and back every step; reused page-locked memory spares it a staging copy,
/// the page faults of fresh memory and a second staging copy on the way back
/// ([`Uploads::copy_pinned`]).
struct Reads {
    side: Arc<SideContext>,
    stream: Arc<CudaStream>,
    free: Arc<Mutex<Vec<PinnedMemory>>>,
}

impl Reads {
    fn new(device: &CudaDevice) -> Result<Self, OffloadError> {
        let (side, stream) = side_stream(device, "creating the read stream")?;
        Ok(Self {
            side,
            stream,
            free: Arc::default(),
        })
    }

    /// Starts copying `tensor` into page-locked memory in the calling thread's compute order;
    /// returns the memory and the event after the copy.
    fn start(tensor: CubeTensor<CudaRuntime>) -> Result<(ReadPages, CudaEvent), OffloadError> {
        static ALL: Mutex<Vec<(usize, Reads)>> = Mutex::new(Vec::new());
        let tensor = into_contiguous(tensor);
        let len = tensor.meta.shape().num_elements() * tensor.dtype.size();
        let mut all = ALL.lock().unwrap_or_else(|p| p.into_inner());
        let reads = per_device(&mut all, &tensor.device, || Self::new(&tensor.device))?;
        // Resolving the buffer first puts this thread's stream after the one that wrote it, when
        // another thread did: the copy's ordering below covers only this thread's work.
        address(&tensor.client, &tensor.handle).ok_or_else(|| OffloadError::Device {
            action: "locating a tensor to read",
            reason: "CubeCL does not resolve its buffer".into(),
        })?;
        let mut memory = reads.take(len)?;
        let copy = HostCopy::ToHost(&mut memory.bytes_mut()[..len]);
        let copied = copy_in_order(
            &tensor.client,
            &reads.side,
            &reads.stream,
            &tensor.handle,
            copy,
        )?;
        let pages = ReadPages {
            memory: Some(memory),
            len,
            free: reads.free.clone(),
        };
        Ok((pages, copied))
    }

    /// A free buffer of at least `len` bytes (and at most twice that), else a new one.
    fn take(&self, len: usize) -> Result<PinnedMemory, OffloadError> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let fitting = free
            .iter()
            .enumerate()
            .filter(|(_, memory)| memory.len >= len && memory.len <= 2 * len)
            .min_by_key(|(_, memory)| memory.len)
            .map(|(at, _)| at);
        match fitting {
            Some(at) => Ok(free.swap_remove(at)),
            None => pinned_zeros(len, self.side.context().clone()),
        }
    }
}

/// The page-locked memory of a read tensor's bytes, back among its device's free buffers when
/// the bytes are dropped.
struct ReadPages {
    memory: Option<PinnedMemory>,
    len: usize,
    free: Arc<Mutex<Vec<PinnedMemory>>>,
}

impl ReadPages {
    fn memory(&self) -> &PinnedMemory {
        self.memory.as_ref().expect("held until dropped")
    }
}

impl AllocationController for ReadPages {
    /// `cuMemHostAlloc` returns page-aligned memory.
    fn alloc_align(&self) -> usize {
        4096
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Pinned
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: in bounds of the allocation, which `self` owns.
        unsafe { std::slice::from_raw_parts_mut(self.memory().ptr.cast(), self.len) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        // SAFETY: in bounds of the allocation, which `self` owns.
        unsafe { std::slice::from_raw_parts(self.memory().ptr.cast(), self.len) }
    }
}

impl Drop for ReadPages {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.take() {
            self.free
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(memory);
        }
    }
}

/// Runs `copy` on `stream` in the calling thread's compute order
/// ([`burn_kernels::cuda::copy_in_order`]); returns the event after it.
fn copy_in_order(
    client: &ComputeClient<CudaRuntime>,
    side: &SideContext,
    stream: &CudaStream,
    handle: &Handle,
    copy: HostCopy<'_>,
) -> Result<CudaEvent, OffloadError> {
    burn_kernels::cuda::copy_in_order(client, side, stream, handle, copy).map_err(|e| {
        OffloadError::Device {
            action: "copying between host and device memory",
            reason: e.to_string(),
        }
    })?;
    stream
        .record_event(None)
        .map_err(device_error("recording a copy's event"))
}

/// The device's default memory pool, which CubeCL's stream-ordered allocations come from.
fn memory_pool(ctx: &CudaContext) -> Result<sys::CUmemoryPool, DriverError> {
    ctx.bind_to_thread()?;
    let mut pool = std::ptr::null_mut();
    // SAFETY: `pool` is written by the call; the device is the context's.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    Ok(pool)
}

/// Keeps the memory of freed allocations in the device's pool until
/// [`StreamTarget::trim_freed`]: the engine hands CubeCL's free pages back often
/// ([`OffloadConfig::release_pages_every`](crate::OffloadConfig::release_pages_every)), and
/// without this the pool would return them to the system at every synchronization and map
/// them again at the next allocation.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), OffloadError> {
    let pool = memory_pool(ctx).map_err(device_error("finding the device's memory pool"))?;
    let mut threshold = u64::MAX;
    // SAFETY: the attribute takes a `u64`, which `threshold` is, read during the call.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(device_error("keeping freed memory in the device's pool"))
}

/// Bytes each core copies at a time into a staging buffer.
const COPY_PIECE: usize = 4 << 20;

/// The slots of a ring: Burn-owned device buffers and their addresses.
pub struct CudaRing {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    slots: Vec<(Handle, u64)>,
    slot_bytes: usize,
}

/// Copies `bytes` to device address `dst` on the copy stream and waits for it: asynchronously
/// from page-locked memory, through the driver's own staging from pageable memory.
fn copy(
    ctx: &CudaContext,
    stream: &CudaStream,
    dst: u64,
    bytes: &[u8],
) -> Result<(), OffloadError> {
    if bytes.is_empty() {
        return Ok(());
    }
    ctx.bind_to_thread()
        .map_err(device_error("binding the CUDA context"))?;
    // SAFETY: `dst` is a live Burn buffer of at least `bytes.len()` bytes that no kernel reads
    // (the engine's fences guarantee it); `bytes` outlives the copy, which is complete when
    // `synchronize` returns.
    unsafe { result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }
        .map_err(device_error("copying a weight to the device"))?;
    stream
        .synchronize()
        .map_err(device_error("waiting for a weight copy"))
}

/// Weights at most this large are uploaded through Burn's own (stream-ordered) path.
const SMALL: usize = 1 << 20;

/// A Burn buffer of `bytes` bytes on `device` and its address.
fn device_buffer(
    client: &ComputeClient<CudaRuntime>,
    bytes: usize,
) -> Result<(Handle, u64), OffloadError> {
    let handle = client.empty(bytes.max(1));
    let ptr = client
        .get_resource(handle.clone())
        .map_err(|e| OffloadError::Device {
            action: "locating a ring slot",
            reason: format!("{e:?}"),
        })?
        .resource()
        .ptr;
    Ok((handle, ptr))
}

/// Whether a resident `weight` is kept as its wire payload and decoded at each use.
fn stays_compact(weight: &HostWeight) -> bool {
    weight.encoding != Encoding::Native && weight.wire_bytes() > SMALL
}

/// The bytes `[start, start + len)` of a buffer.
fn sub_handle(handle: &Handle, start: usize, len: usize) -> Handle {
    let size = handle.size() as usize;
    handle
        .clone()
        .offset_start(start as u64)
        .offset_end((size - start - len) as u64)
}

/// The weight in `handle` (its wire payload) as a tensor of its dtype.
fn decode<F: FloatElement, I: IntElement, BT: BoolElement>(
    handle: &Handle,
    weight: &HostWeight,
    device: &CudaDevice,
) -> CubeTensor<CudaRuntime> {
    let client = CudaRuntime::client(device);
    let dtype = FloatDType::from(weight.dtype);
    match &weight.encoding {
        Encoding::Native => CubeTensor::new_contiguous(
            client,
            device.clone(),
            weight.shape.clone(),
            sub_handle(handle, 0, weight.device_bytes()),
            weight.dtype,
        ),
        Encoding::Bf16 => {
            let len = weight.shape.num_elements() * 2;
            let bf16 = CubeTensor::new_contiguous(
                client,
                device.clone(),
                weight.shape.clone(),
                sub_handle(handle, 0, len),
                DType::BF16,
            );
            CubeBackend::<CudaRuntime, F, I, BT>::float_cast(bf16, dtype)
        }
        Encoding::Fp8(spec) => {
            let codes_len = HostWeight::codes_len(spec);
            let scales_len = spec.layout().count() * 4;
            burn_quant::dequantize_codes(
                &client,
                device,
                sub_handle(handle, 0, spec.numel().div_ceil(4) * 4),
                sub_handle(handle, codes_len, scales_len),
                spec,
                dtype,
            )
        }
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> StreamTarget
    for CubeBackend<CudaRuntime, F, I, BT>
{
    type Ring = CudaRing;
    type Fence = DynFut<Result<(), ServerError>>;

    fn host_memory(
        bytes: Vec<u8>,
        device: &CudaDevice,
    ) -> Result<Box<dyn HostMemory>, OffloadError> {
        let (ctx, _) = copy_stream(device)?;
        Ok(Box::new(pinned(bytes, ctx)?))
    }

    /// The wire payload: the codes and scales of an FP8 weight, decoded when an op reads it.
    fn slot_bytes(weight: &HostWeight) -> usize {
        weight.wire_bytes()
    }

    fn new_ring(
        device: &CudaDevice,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<CudaRing, OffloadError> {
        let (ctx, stream) = copy_stream(device)?;
        if let Err(e) = keep_freed_memory(&ctx) {
            // A device without stream-ordered pools allocates synchronously (CubeCL falls back
            // to it), and there is nothing to keep.
            tracing::warn!("freed device memory goes back to the system at once: {e}");
        }
        let client = CudaRuntime::client(device);
        let slots = (0..slots)
            .map(|_| device_buffer(&client, slot_bytes))
            .collect::<Result<_, _>>()?;
        drain(&client);
        Ok(CudaRing {
            ctx,
            stream,
            slots,
            slot_bytes,
        })
    }

    fn fill(ring: &CudaRing, slot: usize, weight: &HostWeight) -> Result<(), OffloadError> {
        copy(
            &ring.ctx,
            &ring.stream,
            ring.slots[slot].1,
            weight.memory.bytes(),
        )
    }

    fn poison(ring: &CudaRing, slot: usize) -> Result<(), OffloadError> {
        ring.ctx
            .bind_to_thread()
            .map_err(device_error("binding the CUDA context"))?;
        // SAFETY: the slot holds `slot_bytes` bytes and no kernel reads it (its fence passed).
        unsafe {
            result::memset_d8_async(
                ring.slots[slot].1,
                0xFF,
                ring.slot_bytes,
                ring.stream.cu_stream(),
            )
        }
        .map_err(device_error("poisoning a ring slot"))?;
        ring.stream
            .synchronize()
            .map_err(device_error("waiting for a slot poisoning"))
    }

    fn view(
        ring: &CudaRing,
        slot: usize,
        weight: &HostWeight,
        device: &CudaDevice,
    ) -> FloatTensor<Self> {
        decode::<F, I, BT>(&ring.slots[slot].0, weight, device)
    }

    /// Only a weight sent in its own dtype is read in place; any other is decoded into a tensor
    /// of its own.
    fn view_reads_slot(weight: &HostWeight) -> bool {
        weight.encoding == Encoding::Native
    }

    /// The wire payload, for a weight sent in another format than its dtype and larger than
    /// [`SMALL`].
    fn compact_bytes(weight: &HostWeight) -> usize {
        if stays_compact(weight) {
            weight.wire_bytes()
        } else {
            weight.device_bytes()
        }
    }

    /// The wire payload in a buffer of its own, as bytes (see [`compact_bytes`](Self::compact_bytes)).
    fn upload_compact(
        weight: &HostWeight,
        device: &CudaDevice,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        if !stays_compact(weight) {
            return Self::upload(weight, device);
        }
        let (ctx, stream) = copy_stream(device)?;
        let client = CudaRuntime::client(device);
        let size = weight.wire_bytes();
        let (handle, ptr) = device_buffer(&client, size)?;
        drain(&client);
        copy(&ctx, &stream, ptr, weight.memory.bytes())?;
        Ok(CubeTensor::new_contiguous(
            client,
            device.clone(),
            Shape::new([size]),
            handle,
            DType::U8,
        ))
    }

    fn expand(
        stored: &FloatTensor<Self>,
        weight: &HostWeight,
        device: &CudaDevice,
    ) -> FloatTensor<Self> {
        if stays_compact(weight) {
            decode::<F, I, BT>(&stored.handle, weight, device)
        } else {
            stored.clone()
        }
    }

    /// A weight sent in its own dtype is read in place from the slot and copied on the
    /// device; the decode of any other wire format already wrote a tensor of its own.
    fn keep(
        view: FloatTensor<Self>,
        weight: &HostWeight,
        _device: &CudaDevice,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        Ok(match weight.encoding {
            Encoding::Native => view.copy(),
            _ => view,
        })
    }

    /// Small weights go through Burn's own upload (ordered on the compute stream, so it needs
    /// no wait). Larger ones get a buffer of their own, filled by the same pinned copy as the
    /// ring (Burn's `from_data` would go through pageable memory), then decoded if the wire
    /// format needs it; this drains the compute stream twice, which residency (once per weight)
    /// and materialization (counted as a slow path) can afford.
    fn upload(weight: &HostWeight, device: &CudaDevice) -> Result<FloatTensor<Self>, OffloadError> {
        let size = weight.wire_bytes();
        if size <= SMALL {
            return Ok(Self::float_from_data(weight.decode(), device));
        }
        let (ctx, stream) = copy_stream(device)?;
        let client = CudaRuntime::client(device);
        let (handle, ptr) = device_buffer(&client, size)?;
        drain(&client);
        copy(&ctx, &stream, ptr, weight.memory.bytes())?;
        let tensor = decode::<F, I, BT>(&handle, weight, device);
        if weight.encoding != Encoding::Native {
            drain(&client);
        }
        Ok(tensor)
    }

    /// Small payloads through Burn's own upload; larger ones staged in page-locked memory and
    /// copied by the driver into a buffer of their own in the compute stream's order
    /// ([`Uploads`]), several times faster than CubeCL's path, and without the host waiting
    /// for the GPU.
    fn upload_data(data: TensorData, device: &CudaDevice) -> FloatTensor<Self> {
        let bytes = data.as_bytes();
        if bytes.len() <= SMALL {
            return Self::float_from_data(data, device);
        }
        let client = CudaRuntime::client(device);
        let handle = client.empty(bytes.len());
        let (shape, dtype) = (data.shape.clone(), data.dtype);
        let copied = if data.bytes.property() == AllocationProperty::Pinned {
            Uploads::copy_pinned(device, &client, &handle, data)
        } else {
            Uploads::copy(device, &client, &handle, bytes)
        };
        copied.unwrap_or_else(|e| panic!("{e}"));
        CubeTensor::new_contiguous(client, device.clone(), shape, handle, dtype)
    }

    /// Small tensors through Burn's own read; larger ones copied in the calling thread's compute
    /// order, when this is called, straight into reused page-locked memory ([`Reads`]) that the
    /// returned data keeps: several times faster than CubeCL's path, and the host waits for the
    /// copy only when it awaits the data.
    fn read_data(
        tensor: FloatTensor<Self>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        let len = tensor.meta.shape().num_elements() * tensor.dtype.size();
        let read: DynFut<Result<TensorData, ExecutionError>> = if len <= SMALL {
            Box::pin(Self::float_into_data(tensor))
        } else {
            let (shape, dtype) = (tensor.meta.shape().clone(), tensor.dtype);
            let started = Reads::start(tensor);
            Box::pin(async move {
                let failed = |e: OffloadError| ExecutionError::WithContext {
                    reason: e.to_string(),
                };
                let (pages, copied) = started.map_err(failed)?;
                copied
                    .synchronize()
                    .map_err(device_error("waiting for a read"))
                    .map_err(failed)?;
                // SAFETY: the copy, complete now, wrote all `len` bytes of the pages.
                let bytes = unsafe { Bytes::from_controller(Box::new(pages), len) };
                Ok(TensorData::from_bytes(bytes, shape, dtype))
            })
        };
        read
    }

    fn fence(device: &CudaDevice) -> Option<Self::Fence> {
        Some(CudaRuntime::client(device).sync())
    }

    fn wait(fence: Self::Fence) {
        block_on(fence).unwrap_or_else(|e| panic!("waiting for a compute fence: {e:?}"));
    }

    /// The device's used memory as the driver counts it, which is what `nvidia-smi` shows:
    /// CubeCL's pools with the pages they keep reserved, the CUDA context, cuBLAS's and cuDNN's
    /// workspaces (and any other process on the same GPU), not only the bytes CubeCL has handed
    /// out.
    fn memory_in_use(device: &CudaDevice) -> Option<u64> {
        let side = SideContext::of(device).ok()?;
        side.context().bind_to_thread().ok()?;
        let (free, total) = result::mem_get_info().ok()?;
        Some(total.saturating_sub(free) as u64)
    }

    type Download = CudaDownload;
    type Staging = CudaStaging;

    fn download_staging(device: &CudaDevice) -> Result<CudaStaging, OffloadError> {
        let (ctx, _) = copy_stream(device)?;
        let stream = ctx
            .new_stream()
            .map_err(device_error("creating the download stream"))?;
        let memory = pinned_zeros(STAGING, ctx)?;
        Ok(CudaStaging { memory, stream })
    }

    fn start_download(tensor: FloatTensor<Self>) -> Result<CudaDownload, OffloadError> {
        let tensor = into_contiguous(tensor);
        let client = tensor.client.clone();
        let ptr = address(&client, &tensor.handle).ok_or_else(|| OffloadError::Device {
            action: "locating a gradient on the device",
            reason: "CubeCL does not resolve its buffer".into(),
        })?;
        let len = tensor.meta.shape().num_elements() * tensor.dtype.size();
        let fence = client.sync();
        Ok(CudaDownload {
            tensor,
            ptr,
            len,
            fence,
        })
    }

    fn finish_download(
        download: CudaDownload,
        staging: &mut CudaStaging,
        read: &mut dyn FnMut(&[u8]),
    ) -> Result<(), OffloadError> {
        block_on(download.fence).map_err(|e| OffloadError::Device {
            action: "waiting for a gradient",
            reason: format!("{e:?}"),
        })?;
        staging
            .memory
            .ctx
            .bind_to_thread()
            .map_err(device_error("binding the CUDA context"))?;
        let mut offset = 0;
        while offset < download.len {
            let len = (download.len - offset).min(staging.memory.len);
            // SAFETY: the staging memory holds `STAGING` page-locked bytes that only this
            // thread uses; the source is `len` bytes of a live buffer (the download holds its
            // tensor), complete since the fence passed.
            let piece = unsafe { std::slice::from_raw_parts_mut(staging.memory.ptr, len) };
            // SAFETY: as above; the copy is complete when `synchronize` returns.
            unsafe {
                result::memcpy_dtoh_async(
                    &mut *piece,
                    download.ptr + offset as u64,
                    staging.stream.cu_stream(),
                )
            }
            .map_err(device_error("copying a gradient to host memory"))?;
            staging
                .stream
                .synchronize()
                .map_err(device_error("waiting for a gradient copy"))?;
            read(piece);
            offset += len;
        }
        drop(download.tensor);
        Ok(())
    }

    fn memory_handed_out(device: &CudaDevice) -> Option<u64> {
        CudaRuntime::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_in_use)
    }

    fn trim_freed(device: &CudaDevice) {
        if let Ok(side) = SideContext::of(device) {
            // A failure leaves the memory in the pool, where it is still reused.
            let _ = memory_pool(side.context()).and_then(|pool| {
                // SAFETY: `pool` is the device's default pool; trimming frees only unused memory.
                unsafe { sys::cuMemPoolTrimTo(pool, 0) }.result()
            });
        }
    }

    fn memory_pooled(device: &CudaDevice) -> Option<u64> {
        CudaRuntime::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_reserved)
    }
}
