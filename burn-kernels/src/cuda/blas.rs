//! Matrix products through cuBLAS on Burn-owned buffers: the CUDA mechanism behind
//! [`FusedOps::blas_matmul`](crate::FusedOps::blas_matmul); the layouts are planned in
//! `gemm.rs`, the route chosen by [`BlasRoute`].
//!
//! cuBLAS runs on a CUDA stream of its own, since CubeCL 0.10 hands out no handle to its
//! streams; `order.rs` keeps each product in its place in CubeCL's stream.

use std::ffi::c_void;
use std::sync::Arc;

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::server::Handle;
use cudarc::cublas::result as cublas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType,
};
use cudarc::driver::{CudaContext, CudaStream};

use crate::cuda::SideContext;
use crate::cuda::order::ordered;
use crate::error::{KernelError, fell_back};
use crate::gemm::{GemmPlan, Layout, Operand, plan};
use crate::options::{BlasRoute, KernelOptions, StreamOrder};

/// Whether `plan` goes to cuBLAS under `options` (given that the route is not off).
fn routed(plan: &GemmPlan, options: &KernelOptions) -> bool {
    match options.blas {
        BlasRoute::Off => false,
        BlasRoute::All => true,
        BlasRoute::Large => plan.worth_routing(),
        BlasRoute::Auto => options.order == StreamOrder::Device || plan.worth_routing(),
    }
}

/// A cuBLAS handle bound to its own stream on one device.
pub(crate) struct Blas {
    stream: Arc<CudaStream>,
    handle: cublasHandle_t,
}

// SAFETY: the handle is only used under the mutex that owns the `Blas`.
unsafe impl Send for Blas {}

impl Blas {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        let stream = ctx
            .new_stream()
            .map_err(KernelError::device("creating the cuBLAS stream"))?;
        // cudarc loads libcublas on first use and panics when it is missing.
        let handle = std::panic::catch_unwind(cublas::create_handle)
            .map_err(|_| KernelError::Library("libcublas"))?
            .map_err(KernelError::device("creating the cuBLAS handle"))?;
        // SAFETY: a live handle and a live stream of the same context.
        unsafe { cublas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(KernelError::device("binding cuBLAS to its stream"))?;
        Ok(Self { stream, handle })
    }

    /// Queues `plan` on the cuBLAS stream: `C ← alpha · op(A) · op(B) + beta · C`.
    fn gemm(
        &self,
        plan: &GemmPlan,
        [a, b, c]: [u64; 3],
        dtype: cudaDataType,
        (alpha, beta): (f32, f32),
    ) -> Result<(), KernelError> {
        let op = |operand: &Operand| {
            if operand.transpose {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        // Checked by `plan`: every size fits in an i32.
        let int = |v: usize| v as i32;
        // SAFETY: `a`, `b` and `c` are live Burn buffers holding the extents `plan` describes
        // (it was made from their layouts, `c` was allocated for `out_shape`); the ordering
        // keeps every other use of them out of the product's way.
        unsafe {
            cublas::gemm_strided_batched_ex(
                self.handle,
                op(&plan.a),
                op(&plan.b),
                int(plan.m),
                int(plan.n),
                int(plan.k),
                (&alpha as *const f32).cast::<c_void>(),
                a as *const c_void,
                dtype,
                int(plan.a.ld),
                plan.a.batch_stride as i64,
                b as *const c_void,
                dtype,
                int(plan.b.ld),
                plan.b.batch_stride as i64,
                (&beta as *const f32).cast::<c_void>(),
                c as *mut c_void,
                dtype,
                int(plan.ldc),
                plan.stride_c as i64,
                int(plan.batch),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(KernelError::device("cublasGemmStridedBatchedEx"))
    }
}

fn data_type(dtype: DType) -> Option<cudaDataType> {
    match dtype {
        DType::F32 => Some(cudaDataType::CUDA_R_32F),
        DType::F16 => Some(cudaDataType::CUDA_R_16F),
        DType::BF16 => Some(cudaDataType::CUDA_R_16BF),
        _ => None,
    }
}

fn layout(tensor: &CubeTensor<CudaRuntime>) -> Layout<'_> {
    Layout {
        shape: tensor.meta.shape(),
        strides: tensor.meta.strides(),
    }
}

/// `lhs · rhs` through cuBLAS, or `None` when `options` leave the product to Burn (see
/// `routed`), the dtypes or layouts do not fit (see [`plan`]), or cuBLAS fails (logged).
pub(crate) fn matmul(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    options: &KernelOptions,
) -> Option<CubeTensor<CudaRuntime>> {
    if options.blas == BlasRoute::Off || lhs.dtype != rhs.dtype || lhs.qparams.is_some() {
        return None;
    }
    let dtype = data_type(lhs.dtype)?;
    let (lhs, rhs, plan) = match plan(layout(lhs), layout(rhs)) {
        Some(plan) => (lhs.clone(), rhs.clone(), plan),
        // Layouts cuBLAS cannot take (batch dimensions that do not collapse into one stride,
        // as attention's heads split from a projection) are copied to contiguous ones: a copy
        // costs less than Burn's matmul, which compiles and times kernels for every new shape.
        None => {
            let (lhs, rhs) = (into_contiguous(lhs.clone()), into_contiguous(rhs.clone()));
            let plan = plan(layout(&lhs), layout(&rhs))?;
            (lhs, rhs, plan)
        }
    };
    if !routed(&plan, options) {
        return None;
    }
    let client = &lhs.client;
    let out_shape = Shape::from(plan.out_shape.clone());
    let out = client.empty(out_shape.num_elements() * lhs.dtype.size());
    if !run(
        &lhs,
        &plan,
        [&rhs.handle, &lhs.handle, &out],
        dtype,
        (1.0, 0.0),
        options,
    ) {
        return None;
    }
    Some(CubeTensor::new_contiguous(
        client.clone(),
        lhs.device.clone(),
        out_shape,
        out,
        lhs.dtype,
    ))
}

/// Runs `plan` on the `[A, B, C]` buffers on the cuBLAS stream, in its place in CubeCL's order;
/// `false` (logged) when it could not.
fn run(
    lhs: &CubeTensor<CudaRuntime>,
    plan: &GemmPlan,
    buffers: [&Handle; 3],
    dtype: cudaDataType,
    scales: (f32, f32),
    options: &KernelOptions,
) -> bool {
    let done = SideContext::of(&lhs.device).and_then(|side| {
        let blas = side.blas()?;
        let blas = blas.lock().unwrap();
        ordered(
            &lhs.client,
            &side,
            &blas.stream,
            options.order,
            buffers,
            |addresses| blas.gemm(plan, addresses, dtype, scales),
        )
    });
    if let Err(error) = done {
        fell_back("cuBLAS product", &error);
        return false;
    }
    true
}

/// `alpha · lhs · rhs + addend` through cuBLAS, written into `addend`'s memory (`beta = 1`);
/// `Err(addend)` where [`matmul`] would decline without copying an operand, `addend` is not a
/// contiguous tensor of the product's shape and dtype, or something else holds its memory.
// The addend goes back whole when cuBLAS declines, so that the caller can add it another way.
#[allow(clippy::result_large_err)]
pub(crate) fn matmul_add(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
    addend: CubeTensor<CudaRuntime>,
    alpha: f32,
    options: &KernelOptions,
) -> Result<CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>> {
    if options.blas == BlasRoute::Off
        || lhs.dtype != rhs.dtype
        || addend.dtype != lhs.dtype
        || lhs.qparams.is_some()
        || !addend.can_mut()
        || !addend.is_contiguous()
    {
        return Err(addend);
    }
    let Some(dtype) = data_type(lhs.dtype) else {
        return Err(addend);
    };
    let Some(plan) = plan(layout(lhs), layout(rhs)) else {
        return Err(addend);
    };
    if !routed(&plan, options) || addend.meta.shape().as_slice() != plan.out_shape.as_slice() {
        return Err(addend);
    }
    let buffers = [&rhs.handle, &lhs.handle, &addend.handle];
    if !run(lhs, &plan, buffers, dtype, (alpha, 1.0), options) {
        return Err(addend);
    }
    Ok(addend)
}
