//! The CUDA mechanism: [`FusedOps`] for Burn's CUDA backend (cuBLAS products in `blas.rs`,
//! cuDNN convolutions in `dnn.rs`, the NVRTC attention kernels in `flash.rs`, the CubeCL
//! elementwise kernels), the streams outside CubeCL's kept in its order (`order.rs`), and one
//! [`SideContext`] per device that holds everything those paths create once: the CUDA context
//! CubeCL uses, the copy stream of a streaming decorator, the cuBLAS and cuDNN handles, the
//! attention kernels per head size and the flag kernels.

mod blas;
mod dnn;
mod flash;
mod flash_plan;
mod order;
mod sdpa;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps};
use burn::tensor::{DType, FloatDType};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::client::ComputeClient;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::server::Handle;
use cubecl_common::future::block_on;
use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaModule, CudaStream};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use crate::cube::elementwise_ops;
use crate::error::KernelError;
use crate::fused::{ConvGrad, FusedOps, LoraProducts};
use crate::options::{BlasRoute, KernelOptions};

pub use flash::FlashSaved;

/// A part of a [`SideContext`], shared by the threads that use it, or why it could not be made.
type Shared<T> = Result<Arc<Mutex<T>>, KernelError>;

/// What the CUDA paths outside CubeCL hold for one device, created on first use and kept for
/// the process: a failure to create a part is kept too, and every call that needs the part
/// falls back (logged) instead of retrying.
pub struct SideContext {
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
    blas: OnceLock<Shared<blas::Blas>>,
    dnn: OnceLock<Shared<dnn::Dnn>>,
    flash: Mutex<HashMap<usize, Shared<flash::FlashKernels>>>,
    flags: OnceLock<Result<Arc<order::FlagKernels>, KernelError>>,
}

impl SideContext {
    /// `device`'s side context.
    pub fn of(device: &CudaDevice) -> Result<Arc<Self>, KernelError> {
        static ALL: Mutex<Option<HashMap<usize, Arc<SideContext>>>> = Mutex::new(None);
        let mut all = ALL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let all = all.get_or_insert_with(HashMap::new);
        if let Some(side) = all.get(&device.index) {
            return Ok(side.clone());
        }
        // Retains the primary context, the one CubeCL uses.
        let ctx = CudaContext::new(device.index)
            .map_err(KernelError::device("opening the CUDA context"))?;
        let copy = ctx
            .new_stream()
            .map_err(KernelError::device("creating the copy stream"))?;
        let side = Arc::new(Self {
            ctx,
            copy,
            blas: OnceLock::new(),
            dnn: OnceLock::new(),
            flash: Mutex::new(HashMap::new()),
            flags: OnceLock::new(),
        });
        all.insert(device.index, side.clone());
        Ok(side)
    }

    /// The CUDA context (the device's primary context, which CubeCL uses).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// A stream for copies into device memory, apart from every compute stream.
    pub fn copy_stream(&self) -> &Arc<CudaStream> {
        &self.copy
    }

    fn blas(&self) -> Shared<blas::Blas> {
        self.blas
            .get_or_init(|| blas::Blas::new(&self.ctx).map(|b| Arc::new(Mutex::new(b))))
            .clone()
    }

    fn dnn(&self) -> Shared<dnn::Dnn> {
        self.dnn
            .get_or_init(|| dnn::Dnn::new(&self.ctx).map(|d| Arc::new(Mutex::new(d))))
            .clone()
    }

    fn flash(&self, head_dim: usize) -> Shared<flash::FlashKernels> {
        let mut all = self.flash.lock().unwrap();
        all.entry(head_dim)
            .or_insert_with(|| {
                flash::FlashKernels::new(&self.ctx, head_dim).map(|k| Arc::new(Mutex::new(k)))
            })
            .clone()
    }

    fn flag_kernels(&self) -> Result<Arc<order::FlagKernels>, KernelError> {
        self.flags
            .get_or_init(|| order::FlagKernels::new(&self.ctx).map(Arc::new))
            .clone()
    }
}

/// Waits until the compute stream has run everything submitted to it so far.
///
/// Needed around raw copies into memory Burn hands out: a freshly allocated buffer may still be
/// read by kernels queued for its previous tenant, and a staging buffer must outlive the kernel
/// that decodes it. Burn orders its own uses of a buffer on its stream; other streams are
/// outside that order.
pub fn drain(client: &ComputeClient<CudaRuntime>) {
    block_on(client.sync()).unwrap_or_else(|e| panic!("waiting for the compute stream: {e:?}"));
}

/// A copy between page-locked host memory and a Burn buffer.
pub enum HostCopy<'a> {
    /// These bytes into the buffer.
    ToDevice(&'a [u8]),
    /// The buffer's first bytes into these.
    ToHost(&'a mut [u8]),
}

/// Runs `copy` between host memory and the Burn buffer `handle` on `stream`, in the calling
/// thread's compute order (`order.rs`): the copy starts after every kernel this thread queued
/// before (those that wrote the buffer, or read its previous tenant, included), and every kernel
/// queued after waits for it, without the host waiting for the GPU; the buffer may be released
/// right after this returns. The host memory must be page-locked (from pageable memory the
/// driver would wait for the stream first), at most as long as the buffer, and left alone
/// (neither written, nor read after a copy to the host, nor freed) until `stream` has run the
/// copy.
pub fn copy_in_order(
    client: &ComputeClient<CudaRuntime>,
    side: &SideContext,
    stream: &CudaStream,
    handle: &Handle,
    copy: HostCopy<'_>,
) -> Result<(), KernelError> {
    order::ordered(
        client,
        side,
        stream,
        crate::StreamOrder::Device,
        [handle],
        |[buffer]| {
            let copied = match copy {
                // SAFETY: `buffer` is the address of `handle`, a live buffer at least as long as
                // the host memory, which no kernel reads or writes while the copy runs (the
                // ordering); the caller keeps the host memory until `stream` has run the copy.
                HostCopy::ToDevice(bytes) => unsafe {
                    cudarc::driver::result::memcpy_htod_async(buffer, bytes, stream.cu_stream())
                },
                // SAFETY: as above.
                HostCopy::ToHost(bytes) => unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(bytes, buffer, stream.cu_stream())
                },
            };
            copied.map_err(KernelError::device(
                "copying between host and device memory",
            ))
        },
    )
}

/// The device address of a Burn buffer, `None` when CubeCL cannot resolve it.
pub fn address(client: &ComputeClient<CudaRuntime>, handle: &Handle) -> Option<u64> {
    client
        .get_resource(handle.clone())
        .ok()
        .map(|resource| resource.resource().ptr)
}

/// The compute capability of `ctx`'s device, `(major, minor)`.
fn compute_capability(ctx: &CudaContext) -> Result<(i32, i32), KernelError> {
    let attribute = |a| {
        ctx.attribute(a)
            .map_err(KernelError::device("reading the compute capability"))
    };
    Ok((
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// CUDA C++ `source` (named `name` in NVRTC's messages) compiled by NVRTC for `ctx`'s device,
/// with the toolkit's headers (under `CUDA_PATH`, else `/usr/local/cuda`, where NVRTC itself
/// looks) and `options`, and loaded.
fn compile_module(
    ctx: &Arc<CudaContext>,
    name: &str,
    source: &str,
    options: Vec<String>,
) -> Result<Arc<CudaModule>, KernelError> {
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
    .map_err(|_| KernelError::Library("libnvrtc"))?
    .map_err(|e| KernelError::Device {
        action: "compiling with NVRTC",
        reason: format!("{e:?}"),
    })?;
    ctx.load_module(ptx)
        .map_err(KernelError::device("loading a compiled module"))
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> FusedOps
    for CubeBackend<CudaRuntime, F, I, BT>
{
    type Attention = FlashSaved;

    fn fused_attention(
        q: &FloatTensor<Self>,
        k: &FloatTensor<Self>,
        v: &FloatTensor<Self>,
        scale: f32,
        options: &KernelOptions,
    ) -> Option<(FloatTensor<Self>, FlashSaved)> {
        flash::forward(q, k, v, scale, options)
    }

    fn fused_attention_backward(
        qkv: [&FloatTensor<Self>; 3],
        saved: &FlashSaved,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> [FloatTensor<Self>; 3] {
        let grad = if grad.dtype == DType::BF16 {
            grad
        } else {
            Self::float_cast(grad, FloatDType::BF16)
        };
        flash::backward(
            qkv,
            saved,
            &burn_cubecl::kernel::into_contiguous(grad),
            scale,
        )
    }

    elementwise_ops!();

    fn blas_routes(options: &KernelOptions) -> bool {
        options.blas != BlasRoute::Off
    }

    fn blas_matmul(
        lhs: &CubeTensor<CudaRuntime>,
        rhs: &CubeTensor<CudaRuntime>,
        options: &KernelOptions,
    ) -> Option<CubeTensor<CudaRuntime>> {
        blas::matmul(lhs, rhs, options)
    }

    fn blas_matmul_add(
        lhs: &CubeTensor<CudaRuntime>,
        rhs: &CubeTensor<CudaRuntime>,
        addend: CubeTensor<CudaRuntime>,
        alpha: f32,
        options: &KernelOptions,
    ) -> Result<CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>> {
        blas::matmul_add(lhs, rhs, addend, alpha, options)
    }

    fn blas_lora(
        products: &LoraProducts<Self>,
        options: &KernelOptions,
    ) -> Option<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)> {
        let p = products;
        blas::lora([&p.x, &p.weight, &p.down, &p.up], p.alpha, options)
    }

    fn blas_lora_backward(
        products: &LoraProducts<Self>,
        h: &CubeTensor<CudaRuntime>,
        grad: &CubeTensor<CudaRuntime>,
        options: &KernelOptions,
    ) -> Option<[CubeTensor<CudaRuntime>; 3]> {
        let p = products;
        blas::lora_backward([&p.x, &p.weight, &p.down, &p.up], h, grad, p.alpha, options)
    }

    fn dnn_conv2d(
        x: &CubeTensor<CudaRuntime>,
        weight: &CubeTensor<CudaRuntime>,
        conv: &ConvOptions<2>,
        options: &KernelOptions,
    ) -> Option<CubeTensor<CudaRuntime>> {
        dnn::conv2d(x, weight, conv, options)
    }

    fn dnn_conv2d_backward(
        x: &CubeTensor<CudaRuntime>,
        weight: &CubeTensor<CudaRuntime>,
        output_grad: &CubeTensor<CudaRuntime>,
        conv: &ConvOptions<2>,
        wanted: ConvGrad,
        options: &KernelOptions,
    ) -> Option<CubeTensor<CudaRuntime>> {
        dnn::conv2d_backward(x, weight, output_grad, conv, wanted, options)
    }
}
