//! Matrix products through cuBLAS on Burn-owned buffers: the CUDA mechanism behind
//! [`StreamTarget::blas_matmul`](crate::StreamTarget::blas_matmul); the layouts are planned in
//! `gemm.rs`.
//!
//! cuBLAS runs on a CUDA stream of its own, since CubeCL 0.10 hands out no handle to its
//! streams; `order.rs` keeps each product in its place in CubeCL's stream. Under device order every
//! product whose layout allows goes to cuBLAS; under host order only those large enough to pay
//! for the waits (`BURN_LORA_BLAS=large` keeps that limit under device order too, `=all` drops
//! it under host order); `BURN_LORA_BLAS=0` leaves every product to Burn's kernels.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cudarc::cublas::result as cublas;
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasHandle_t, cublasOperation_t, cudaDataType,
};
use cudarc::driver::{CudaContext, CudaStream};

use crate::cuda::address;
use crate::gemm::{GemmPlan, Layout, MIN_ROUTED_FLOPS, Operand, plan};
use crate::order::{device_ordered, ordered};

/// Which products `BURN_LORA_BLAS` sends to cuBLAS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// `0`, `off` or `false`: none.
    Off,
    /// Unset or any other value: every product whose layout allows it while the products are
    /// ordered on the device, only those worth host waits ([`GemmPlan::worth_routing`]) while
    /// the host orders them.
    Auto,
    /// `large`: only those worth host waits, whatever the order.
    Large,
    /// `all`: every product whose layout allows it, whatever the order.
    All,
}

fn route() -> Route {
    static ROUTE: OnceLock<Route> = OnceLock::new();
    *ROUTE.get_or_init(|| {
        let route = match std::env::var("BURN_LORA_BLAS").as_deref() {
            Ok("0" | "off" | "false") => Route::Off,
            Ok("large") => Route::Large,
            Ok("all") => Route::All,
            _ => Route::Auto,
        };
        let large = MIN_ROUTED_FLOPS >> 30;
        match route {
            Route::Off => tracing::info!("matrix products: Burn's kernels (BURN_LORA_BLAS=0)"),
            Route::Auto => tracing::info!(
                "matrix products: cuBLAS where the layout allows, only those of at least {large} \
                 GFLOP under host order (BURN_LORA_BLAS=0 turns it off)"
            ),
            Route::Large => tracing::info!(
                "matrix products: cuBLAS for those of at least {large} GFLOP where the layout \
                 allows (BURN_LORA_BLAS=large)"
            ),
            Route::All => tracing::info!(
                "matrix products: cuBLAS for all where the layout allows (BURN_LORA_BLAS=all)"
            ),
        }
        route
    })
}

/// Whether `plan` goes to cuBLAS under the route (the route is on).
fn routed(plan: &GemmPlan) -> bool {
    match route() {
        Route::Off => false,
        Route::All => true,
        Route::Large => plan.worth_routing(),
        Route::Auto => device_ordered() || plan.worth_routing(),
    }
}

/// Set once a cuBLAS call has failed: later products stay with Burn.
static FAILED: AtomicBool = AtomicBool::new(false);

/// Whether products go to cuBLAS now: switched on and not failed.
pub(crate) fn enabled() -> bool {
    route() != Route::Off && !FAILED.load(AtomicOrdering::Relaxed)
}

/// Products run through cuBLAS so far, in this process.
static PRODUCTS: AtomicU64 = AtomicU64::new(0);

/// How many matrix products this process has run through cuBLAS (every one else ran on Burn's
/// kernels): lets a program check that the route it measures was taken.
pub fn cublas_products() -> u64 {
    PRODUCTS.load(AtomicOrdering::Relaxed)
}

/// A cuBLAS handle bound to its own stream on one device.
struct Blas {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    handle: cublasHandle_t,
}

// SAFETY: the handle is only used under the mutex that owns the `Blas`.
unsafe impl Send for Blas {}

impl Blas {
    fn new(device: &CudaDevice) -> Result<Self, String> {
        let ctx = CudaContext::new(device.index).map_err(|e| e.to_string())?;
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        // cudarc loads libcublas on first use and panics when it is missing.
        let handle = std::panic::catch_unwind(cublas::create_handle)
            .map_err(|_| "libcublas could not be loaded".to_string())?
            .map_err(|e| e.to_string())?;
        // SAFETY: a live handle and a live stream of the same context.
        unsafe { cublas::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| e.to_string())?;
        Ok(Self {
            ctx,
            stream,
            handle,
        })
    }

    /// Queues `plan` on the cuBLAS stream.
    fn gemm(
        &self,
        plan: &GemmPlan,
        [a, b, c]: [u64; 3],
        dtype: cudaDataType,
    ) -> Result<(), String> {
        let op = |operand: &Operand| {
            if operand.transpose {
                cublasOperation_t::CUBLAS_OP_T
            } else {
                cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
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
        .map_err(|e| e.to_string())
    }
}

/// The device's cuBLAS, created on first use; `None` (said once) when it cannot be.
fn blas(device: &CudaDevice) -> Option<Arc<Mutex<Blas>>> {
    type Handles = Mutex<HashMap<usize, Option<Arc<Mutex<Blas>>>>>;
    static HANDLES: OnceLock<Handles> = OnceLock::new();
    let mut handles = HANDLES.get_or_init(Default::default).lock().unwrap();
    handles
        .entry(device.index)
        .or_insert_with(|| match Blas::new(device) {
            Ok(blas) => Some(Arc::new(Mutex::new(blas))),
            Err(reason) => {
                tracing::warn!("cuBLAS unavailable ({reason}); matrix products use Burn's kernels");
                None
            }
        })
        .clone()
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

/// `lhs · rhs` through cuBLAS, or `None` when it is switched off, unavailable, the dtypes or
/// layouts do not fit (see [`plan`]) or the route leaves the product to Burn (see `routed`).
pub(crate) fn matmul(
    lhs: &CubeTensor<CudaRuntime>,
    rhs: &CubeTensor<CudaRuntime>,
) -> Option<CubeTensor<CudaRuntime>> {
    if !enabled() || lhs.dtype != rhs.dtype || lhs.qparams.is_some() {
        return None;
    }
    let dtype = data_type(lhs.dtype)?;
    let plan = plan(layout(lhs), layout(rhs)).filter(routed)?;
    let blas = blas(&lhs.device)?;
    let client = &lhs.client;
    let out_shape = Shape::from(plan.out_shape.clone());
    let out = client.empty(out_shape.num_elements() * lhs.dtype.size());
    let addresses = [
        address(client, &rhs.handle)?,
        address(client, &lhs.handle)?,
        address(client, &out)?,
    ];
    let blas = blas.lock().unwrap();
    let done = ordered(client, &blas.ctx, &blas.stream, || {
        blas.gemm(&plan, addresses, dtype)
    });
    if let Err(reason) = done {
        tracing::warn!("cuBLAS failed on {plan:?} ({reason}); Burn's kernels run from now on");
        FAILED.store(true, AtomicOrdering::Relaxed);
        return None;
    }
    PRODUCTS.fetch_add(1, AtomicOrdering::Relaxed);
    Some(CubeTensor::new_contiguous(
        client.clone(),
        lhs.device.clone(),
        out_shape,
        out,
        lhs.dtype,
    ))
}
