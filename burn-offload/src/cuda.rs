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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, FloatDType};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::Runtime;
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::{Handle, ServerError};
use cubecl_common::future::{DynFut, block_on};
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaModule, CudaStream, DriverError, result};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use crate::error::OffloadError;
use crate::norm_rope::NormRope;
use crate::target::{FusedAttention, StreamTarget};
use crate::unary::UnaryOp;
use crate::weight::{Encoding, HostMemory, HostWeight};

fn device_error(action: &'static str) -> impl Fn(DriverError) -> OffloadError {
    move |e| OffloadError::Device {
        action,
        reason: e.to_string(),
    }
}

/// The CUDA context and a copy stream per device, shared by the rings and the direct path.
fn copy_stream(device: &CudaDevice) -> Result<(Arc<CudaContext>, Arc<CudaStream>), OffloadError> {
    type Streams = Mutex<HashMap<usize, (Arc<CudaContext>, Arc<CudaStream>)>>;
    static STREAMS: OnceLock<Streams> = OnceLock::new();
    let mut streams = STREAMS.get_or_init(Default::default).lock().unwrap();
    if let Some(entry) = streams.get(&device.index) {
        return Ok(entry.clone());
    }
    // Retains the primary context, the one CubeCL uses.
    let ctx = CudaContext::new(device.index).map_err(device_error("opening the CUDA context"))?;
    let stream = ctx
        .new_stream()
        .map_err(device_error("creating the copy stream"))?;
    streams.insert(device.index, (ctx.clone(), stream.clone()));
    Ok((ctx, stream))
}

/// Page-locked host memory.
pub struct PinnedMemory {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a plain host allocation, never written after it was filled at creation.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above: shared reads only.
unsafe impl Sync for PinnedMemory {}

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

/// The slots of a ring: Burn-owned device buffers and their addresses.
pub struct CudaRing {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    slots: Vec<(Handle, u64)>,
    slot_bytes: usize,
}

/// Copies `bytes` (page-locked) to device address `dst` on the copy stream and waits for it.
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
    // (the engine's fences guarantee it); `bytes` is page-locked and outlives the copy, which is
    // complete when `synchronize` returns.
    unsafe { result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }
        .map_err(device_error("copying a weight to the device"))?;
    stream
        .synchronize()
        .map_err(device_error("waiting for a weight copy"))
}

/// Weights at most this large are uploaded through Burn's own (stream-ordered) path.
const SMALL: usize = 1 << 20;

/// Waits until the compute stream has run everything submitted to it so far.
///
/// Needed around raw copies into memory Burn hands out: a freshly allocated buffer may still be
/// read by kernels queued for its previous tenant, and a staging buffer must outlive the kernel
/// that decodes it. Burn orders its own uses of a buffer on its stream; the copy stream is
/// outside that order.
pub(crate) fn drain(client: &ComputeClient<CudaRuntime>) {
    block_on(client.sync()).unwrap_or_else(|e| panic!("waiting for the compute stream: {e:?}"));
}

/// Whether the fused elementwise kernels take `x`: a plain (not quantized) f32, bf16 or f16
/// tensor.
fn elementwise_input(x: &CubeTensor<CudaRuntime>) -> bool {
    matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) && x.qparams.is_none()
}

/// The compute capability of `ctx`'s device, `(major, minor)`.
pub(crate) fn compute_capability(ctx: &CudaContext) -> Result<(i32, i32), String> {
    let attribute = |a| ctx.attribute(a).map_err(|e| e.to_string());
    Ok((
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// CUDA C++ `source` (named `name` in NVRTC's messages) compiled by NVRTC for `ctx`'s device,
/// with the toolkit's headers and `options`, and loaded.
pub(crate) fn compile_module(
    ctx: &Arc<CudaContext>,
    name: &str,
    source: &str,
    options: Vec<String>,
) -> Result<Arc<CudaModule>, String> {
    let (major, minor) = compute_capability(ctx)?;
    let cuda = std::env::var("CUDA_PATH").unwrap_or_else(|_| "/usr/local/cuda".into());
    let mut all = vec![format!("--gpu-architecture=sm_{major}{minor}")];
    all.extend(options);
    let ptx = std::panic::catch_unwind(|| {
        compile_ptx_with_opts(
            source,
            CompileOptions {
                include_paths: vec![format!("{cuda}/include")],
                options: all,
                name: Some(name.into()),
                ..Default::default()
            },
        )
    })
    .map_err(|_| "libnvrtc could not be loaded".to_string())?
    .map_err(|e| format!("NVRTC: {e:?}"))?;
    ctx.load_module(ptx).map_err(|e| e.to_string())
}

/// The device address of a Burn buffer, `None` when CubeCL cannot resolve it.
pub(crate) fn address(client: &ComputeClient<CudaRuntime>, handle: &Handle) -> Option<u64> {
    client
        .get_resource(handle.clone())
        .ok()
        .map(|resource| resource.resource().ptr)
}

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
        let len = bytes.len();
        let ptr = if len == 0 {
            std::ptr::null_mut()
        } else {
            ctx.bind_to_thread()
                .map_err(device_error("binding the CUDA context"))?;
            // SAFETY: a fresh allocation of `len` bytes, filled right below.
            let ptr = unsafe { result::malloc_host(len, 0) }
                .map_err(device_error("allocating page-locked host memory"))?
                .cast::<u8>();
            // SAFETY: `ptr` holds `len` bytes and does not overlap `bytes`.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr, len) };
            ptr
        };
        Ok(Box::new(PinnedMemory { ptr, len, ctx }))
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

    fn fence(device: &CudaDevice) -> Option<Self::Fence> {
        Some(CudaRuntime::client(device).sync())
    }

    fn wait(fence: Self::Fence) {
        block_on(fence).unwrap_or_else(|e| panic!("waiting for a compute fence: {e:?}"));
    }

    fn memory_in_use(device: &CudaDevice) -> Option<u64> {
        CudaRuntime::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_in_use)
    }

    fn blas_enabled() -> bool {
        crate::blas::enabled()
    }

    fn blas_matmul(
        lhs: &CubeTensor<CudaRuntime>,
        rhs: &CubeTensor<CudaRuntime>,
    ) -> Option<CubeTensor<CudaRuntime>> {
        crate::blas::matmul(lhs, rhs)
    }

    fn fused_attention(
        q: &CubeTensor<CudaRuntime>,
        k: &CubeTensor<CudaRuntime>,
        v: &CubeTensor<CudaRuntime>,
        scale: f32,
    ) -> Option<FusedAttention<Self>> {
        let (output, row_stats) = crate::flash::forward(q, k, v, scale)?;
        Some(FusedAttention { output, row_stats })
    }

    fn fused_attention_backward(
        qkv: [&CubeTensor<CudaRuntime>; 3],
        forward: &FusedAttention<Self>,
        grad: CubeTensor<CudaRuntime>,
        scale: f32,
    ) -> [CubeTensor<CudaRuntime>; 3] {
        let grad = if grad.dtype == DType::BF16 {
            grad
        } else {
            Self::float_cast(grad, FloatDType::BF16)
        };
        crate::flash::backward(
            qkv,
            &forward.output,
            &forward.row_stats,
            &burn_cubecl::kernel::into_contiguous(grad),
            scale,
        )
    }

    fn fused_unary(op: UnaryOp, x: &CubeTensor<CudaRuntime>) -> Option<CubeTensor<CudaRuntime>> {
        elementwise_input(x).then(|| crate::unary_kernel::unary(op, x.clone()))
    }

    fn fused_unary_backward(
        op: UnaryOp,
        x: &CubeTensor<CudaRuntime>,
        grad: CubeTensor<CudaRuntime>,
    ) -> CubeTensor<CudaRuntime> {
        crate::unary_kernel::unary_backward(op, x.clone(), grad)
    }

    fn fused_norm_rope(o: &NormRope<Self>) -> Option<CubeTensor<CudaRuntime>> {
        elementwise_input(&o.x).then(|| {
            crate::norm_rope_kernel::norm_rope(
                o.x.clone(),
                o.scale.clone(),
                o.cos.clone(),
                o.sin.clone(),
                o.eps,
            )
        })
    }

    fn fused_norm_rope_backward(
        o: &NormRope<Self>,
        grad: CubeTensor<CudaRuntime>,
    ) -> CubeTensor<CudaRuntime> {
        crate::norm_rope_kernel::norm_rope_backward(
            o.x.clone(),
            o.scale.clone(),
            o.cos.clone(),
            o.sin.clone(),
            grad,
            o.eps,
        )
    }
}
