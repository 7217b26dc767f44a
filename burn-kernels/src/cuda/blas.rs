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
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
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
    let dtype = shared_type(&[lhs, rhs], options)?;
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
    let step = Step::new(plan.clone(), [0, 1, 2], scales);
    run_steps(lhs, buffers, &[step], dtype, options)
}

/// One product of a batch: `C ← alpha · op(A) · op(B) + beta · C`, where `operands` are the
/// indices of `[A, B, C]` in the batch's buffers and `scales` is `(alpha, beta)`.
struct Step {
    plan: GemmPlan,
    operands: [usize; 3],
    scales: (f32, f32),
}

impl Step {
    fn new(plan: GemmPlan, operands: [usize; 3], scales: (f32, f32)) -> Self {
        Self {
            plan,
            operands,
            scales,
        }
    }
}

/// Runs `steps` one after the other on the cuBLAS stream, all in one place in CubeCL's order
/// (`like`'s client and device); `false` (logged) when they could not.
fn run_steps<const N: usize>(
    like: &CubeTensor<CudaRuntime>,
    buffers: [&Handle; N],
    steps: &[Step],
    dtype: cudaDataType,
    options: &KernelOptions,
) -> bool {
    let done = SideContext::of(&like.device).and_then(|side| {
        let blas = side.blas()?;
        let blas = blas.lock().unwrap();
        ordered(
            &like.client,
            &side,
            &blas.stream,
            options.order,
            buffers,
            |addresses| {
                steps.iter().try_for_each(|step| {
                    let abc = step.operands.map(|i| addresses[i]);
                    blas.gemm(&step.plan, abc, dtype, step.scales)
                })
            },
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
    let dtype = shared_type(&[lhs, rhs, &addend], options);
    let Some(dtype) = dtype.filter(|_| addend.can_mut() && addend.is_contiguous()) else {
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

/// A matrix's transposed view: the last two dimensions of `shape` and `strides` swapped.
fn transposed(shape: &[usize], strides: &[usize]) -> (Vec<usize>, Vec<usize>) {
    let (mut shape, mut strides) = (shape.to_vec(), strides.to_vec());
    let rank = shape.len();
    shape.swap(rank - 2, rank - 1);
    strides.swap(rank - 2, rank - 1);
    (shape, strides)
}

/// A layout held as owned shape and strides.
fn view((shape, strides): &(Vec<usize>, Vec<usize>)) -> Layout<'_> {
    Layout { shape, strides }
}

/// `shape` with the row-major strides of a contiguous tensor.
fn contiguous(shape: Vec<usize>) -> (Vec<usize>, Vec<usize>) {
    let mut strides = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    (shape, strides)
}

/// `shape` with its last dimension set to `last`.
fn with_last(shape: &[usize], last: usize) -> Vec<usize> {
    let mut shape = shape.to_vec();
    *shape.last_mut().expect("a matrix operand") = last;
    shape
}

/// A fresh contiguous tensor of `shape` and `like`'s dtype.
fn fresh(like: &CubeTensor<CudaRuntime>, shape: Vec<usize>) -> CubeTensor<CudaRuntime> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        like.dtype,
    )
}

/// The cuBLAS data type the operands share, where they share one cuBLAS takes and the route
/// is on.
fn shared_type(
    operands: &[&CubeTensor<CudaRuntime>],
    options: &KernelOptions,
) -> Option<cudaDataType> {
    let dtype = operands[0].dtype;
    let fits = options.blas != BlasRoute::Off
        && operands
            .iter()
            .all(|t| t.dtype == dtype && t.qparams.is_none());
    fits.then(|| data_type(dtype)).flatten()
}

/// A LoRA layer's products, `(x · weight + alpha · h · up, h)` with `h = x · down`, through
/// cuBLAS in one ordering; `None` where a product does not fit (see [`plan`] and `routed`) or
/// cuBLAS fails (logged).
pub(crate) fn lora(
    [x, weight, down, up]: [&CubeTensor<CudaRuntime>; 4],
    alpha: f32,
    options: &KernelOptions,
) -> Option<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)> {
    let dtype = shared_type(&[x, weight, down, up], options)?;
    let rank = *down.meta.shape().last()?;
    let h_view = contiguous(with_last(x.meta.shape(), rank));
    let plans = [
        plan(layout(x), layout(down))?,
        plan(layout(x), layout(weight))?,
        plan(view(&h_view), layout(up))?,
    ];
    if !plans.iter().all(|p| routed(p, options)) {
        return None;
    }
    let [plan_h, plan_y, plan_up] = plans;
    let h = fresh(x, h_view.0);
    let y = fresh(x, plan_y.out_shape.clone());
    // Buffers: x 0, weight 1, down 2, up 3, h 4, y 5.
    let buffers = [
        &x.handle,
        &weight.handle,
        &down.handle,
        &up.handle,
        &h.handle,
        &y.handle,
    ];
    let steps = [
        Step::new(plan_h, [2, 0, 4], (1.0, 0.0)),
        Step::new(plan_y, [1, 0, 5], (1.0, 0.0)),
        Step::new(plan_up, [3, 4, 5], (alpha, 1.0)),
    ];
    run_steps(x, buffers, &steps, dtype, options).then_some((y, h))
}

/// The gradients `[x, down, up]` of [`lora`]'s output given its gradient `grad` and the
/// forward's `h`, the five products through cuBLAS in one ordering:
/// `dh = alpha · grad · upᵀ`, `dx = grad · weightᵀ + dh · downᵀ`, `d_down = xᵀ · dh` and
/// `d_up = alpha · hᵀ · grad` over all rows. `None` where a product does not fit or cuBLAS fails
/// (logged).
pub(crate) fn lora_backward(
    [x, weight, down, up]: [&CubeTensor<CudaRuntime>; 4],
    h: &CubeTensor<CudaRuntime>,
    grad: &CubeTensor<CudaRuntime>,
    alpha: f32,
    options: &KernelOptions,
) -> Option<[CubeTensor<CudaRuntime>; 3]> {
    let dtype = shared_type(&[x, weight, down, up, h, grad], options)?;
    // The weight gradients sum over every row: the rows of x, h and grad as one matrix each.
    let (x, grad) = (into_contiguous(x.clone()), into_contiguous(grad.clone()));
    let rank = *down.meta.shape().last()?;
    let (d_in, d_out) = (*x.meta.shape().last()?, *grad.meta.shape().last()?);
    let rows = x.meta.shape().num_elements() / d_in.max(1);
    let as_rows = |cols: usize| (vec![rows, cols], vec![cols, 1]);
    let (up_t, weight_t, down_t) = (
        transposed(up.meta.shape(), up.meta.strides()),
        transposed(weight.meta.shape(), weight.meta.strides()),
        transposed(down.meta.shape(), down.meta.strides()),
    );
    let dh_view = contiguous(with_last(grad.meta.shape(), rank));
    // dh and h share their row layout.
    let (x_rows, rank_rows, grad_rows) = (as_rows(d_in), as_rows(rank), as_rows(d_out));
    let x_rows_t = transposed(&x_rows.0, &x_rows.1);
    let h_rows_t = transposed(&rank_rows.0, &rank_rows.1);
    let plans = [
        plan(layout(&grad), view(&up_t))?,
        plan(layout(&grad), view(&weight_t))?,
        plan(view(&dh_view), view(&down_t))?,
        plan(view(&x_rows_t), view(&rank_rows))?,
        plan(view(&h_rows_t), view(&grad_rows))?,
    ];
    if !h.is_contiguous() || !plans.iter().all(|p| routed(p, options)) {
        return None;
    }
    let [plan_dh, plan_dx, plan_dx_lora, plan_down, plan_up] = plans;
    let dh = fresh(&x, dh_view.0);
    let dx = fresh(&x, plan_dx.out_shape.clone());
    let d_down = fresh(&x, plan_down.out_shape.clone());
    let d_up = fresh(&x, plan_up.out_shape.clone());
    // Buffers: x 0, weight 1, down 2, up 3, h 4, grad 5, dh 6, dx 7, d_down 8, d_up 9.
    let buffers = [
        &x.handle,
        &weight.handle,
        &down.handle,
        &up.handle,
        &h.handle,
        &grad.handle,
        &dh.handle,
        &dx.handle,
        &d_down.handle,
        &d_up.handle,
    ];
    let steps = [
        Step::new(plan_dh, [3, 5, 6], (alpha, 0.0)),
        Step::new(plan_dx, [1, 5, 7], (1.0, 0.0)),
        Step::new(plan_dx_lora, [2, 6, 7], (1.0, 1.0)),
        Step::new(plan_down, [6, 0, 8], (1.0, 0.0)),
        Step::new(plan_up, [5, 4, 9], (alpha, 0.0)),
    ];
    run_steps(&x, buffers, &steps, dtype, options).then_some([dx, d_down, d_up])
}
