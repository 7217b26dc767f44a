//! Convolutions through cuDNN on Burn-owned buffers: the CUDA mechanism behind
//! [`FusedOps::dnn_conv2d`](crate::FusedOps::dnn_conv2d). cuDNN's heuristics pick the algorithm
//! for each shape, so a convolution costs no compilation and no timing runs on first use.
//!
//! cuDNN runs on a CUDA stream of its own, kept in CubeCL's order as the cuBLAS products are
//! (`order.rs`).

use std::ffi::c_void;
use std::sync::Arc;

use burn::tensor::DType;
use burn::tensor::ops::ConvOptions;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys::{
    cudnnConvolutionDescriptor_t, cudnnConvolutionFwdAlgo_t, cudnnConvolutionFwdAlgoPerf_t,
    cudnnConvolutionMode_t, cudnnDataType_t, cudnnFilterDescriptor_t, cudnnHandle_t,
    cudnnMathType_t, cudnnStatus_t, cudnnTensorDescriptor_t, cudnnTensorFormat_t,
};
use cudarc::driver::{CudaContext, CudaStream};

use crate::conv::ConvPlan;
use crate::cuda::order::ordered;
use crate::cuda::{SideContext, address};
use crate::error::{KernelError, fell_back};
use crate::options::{BlasRoute, KernelOptions};

/// The largest workspace an algorithm may ask for; cuDNN's next choice is taken above it.
const WORKSPACE_LIMIT: usize = 1 << 30;

/// A cuDNN handle bound to its own stream on one device.
pub(crate) struct Dnn {
    stream: Arc<CudaStream>,
    handle: cudnnHandle_t,
}

// SAFETY: the handle is only used under the mutex that owns the `Dnn`.
unsafe impl Send for Dnn {}

impl Dnn {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        let stream = ctx
            .new_stream()
            .map_err(KernelError::device("creating the cuDNN stream"))?;
        ctx.bind_to_thread()
            .map_err(KernelError::device("binding the CUDA context"))?;
        // cudarc loads libcudnn on first use and panics when it is missing.
        let handle = std::panic::catch_unwind(dnn::create_handle)
            .map_err(|_| KernelError::Library("libcudnn"))?
            .map_err(KernelError::device("creating the cuDNN handle"))?;
        // SAFETY: a live handle and a live stream of the same context.
        unsafe { dnn::set_stream(handle, stream.cu_stream() as _) }
            .map_err(KernelError::device("binding cuDNN to its stream"))?;
        Ok(Self { stream, handle })
    }
}

/// The descriptors of one convolution, destroyed on drop.
struct Descriptors {
    x: cudnnTensorDescriptor_t,
    w: cudnnFilterDescriptor_t,
    conv: cudnnConvolutionDescriptor_t,
    y: cudnnTensorDescriptor_t,
}

impl Descriptors {
    /// The descriptors of `conv`'s operands, all NCHW and contiguous.
    fn new(conv: &ConvPlan, dtype: cudnnDataType_t) -> Result<Self, KernelError> {
        let failed = KernelError::device("describing a cuDNN convolution");
        let mut out = Self {
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
        };
        out.x = dnn::create_tensor_descriptor().map_err(&failed)?;
        out.w = dnn::create_filter_descriptor().map_err(&failed)?;
        out.conv = dnn::create_convolution_descriptor().map_err(&failed)?;
        out.y = dnn::create_tensor_descriptor().map_err(&failed)?;
        let nchw = cudnnTensorFormat_t::CUDNN_TENSOR_NCHW;
        // Half types compute in f32 on tensor cores; f32 may use TF32 tensor cores, as
        // PyTorch's convolutions do by default.
        let math = match dtype {
            cudnnDataType_t::CUDNN_DATA_FLOAT => cudnnMathType_t::CUDNN_DEFAULT_MATH,
            _ => cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        };
        // SAFETY: live descriptors created above; every size was checked to fit an i32.
        unsafe {
            dnn::set_tensor4d_descriptor(out.x, nchw, dtype, conv.x).map_err(&failed)?;
            dnn::set_filter4d_descriptor(out.w, dtype, nchw, conv.w).map_err(&failed)?;
            dnn::set_convolution2d_descriptor(
                out.conv,
                conv.padding[0],
                conv.padding[1],
                conv.stride[0],
                conv.stride[1],
                conv.dilation[0],
                conv.dilation[1],
                cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                cudnnDataType_t::CUDNN_DATA_FLOAT,
            )
            .map_err(&failed)?;
            dnn::set_convolution_group_count(out.conv, conv.groups).map_err(&failed)?;
            dnn::set_convolution_math_type(out.conv, math).map_err(&failed)?;
            dnn::set_tensor4d_descriptor(out.y, nchw, dtype, conv.y).map_err(&failed)?;
        }
        Ok(out)
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: each non-null descriptor was created by `new` and is destroyed once.
        unsafe {
            if !self.x.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.x);
            }
            if !self.w.is_null() {
                let _ = dnn::destroy_filter_descriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = dnn::destroy_convolution_descriptor(self.conv);
            }
            if !self.y.is_null() {
                let _ = dnn::destroy_tensor_descriptor(self.y);
            }
        }
    }
}

fn data_type(dtype: DType) -> Option<cudnnDataType_t> {
    match dtype {
        DType::F32 => Some(cudnnDataType_t::CUDNN_DATA_FLOAT),
        DType::F16 => Some(cudnnDataType_t::CUDNN_DATA_HALF),
        DType::BF16 => Some(cudnnDataType_t::CUDNN_DATA_BFLOAT16),
        _ => None,
    }
}

/// cuDNN's first choice of forward algorithm whose workspace is within [`WORKSPACE_LIMIT`],
/// with that workspace's size: its heuristics, no timing runs.
fn forward_algorithm(
    handle: cudnnHandle_t,
    d: &Descriptors,
) -> Result<(cudnnConvolutionFwdAlgo_t, usize), KernelError> {
    const COUNT: usize = cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT as usize;
    // SAFETY: cuDNN writes at most `COUNT` plain-data results, and only those it counts are read.
    let mut perf: [cudnnConvolutionFwdAlgoPerf_t; COUNT] = unsafe { std::mem::zeroed() };
    let mut found = 0;
    unsafe {
        dnn::get_convolution_forward_algorithm(
            handle,
            d.x,
            d.w,
            d.conv,
            d.y,
            COUNT as i32,
            &mut found,
            perf.as_mut_ptr(),
        )
    }
    .map_err(KernelError::device(
        "cudnnGetConvolutionForwardAlgorithm_v7",
    ))?;
    perf[..found.clamp(0, COUNT as i32) as usize]
        .iter()
        .find(|p| p.status == cudnnStatus_t::CUDNN_STATUS_SUCCESS && p.memory <= WORKSPACE_LIMIT)
        .map(|p| (p.algo, p.memory))
        .ok_or_else(|| {
            KernelError::Unsupported("cuDNN has no forward algorithm for this convolution".into())
        })
}

/// The convolution of `x` with `weight` under `options` (no bias) through cuDNN, or `None` when
/// `options` leave it to Burn, the dtypes or shapes do not fit, or cuDNN fails (logged).
pub(crate) fn conv2d(
    x: &CubeTensor<CudaRuntime>,
    weight: &CubeTensor<CudaRuntime>,
    options: &ConvOptions<2>,
    kernel: &KernelOptions,
) -> Option<CubeTensor<CudaRuntime>> {
    if kernel.blas == BlasRoute::Off
        || x.dtype != weight.dtype
        || x.qparams.is_some()
        || weight.qparams.is_some()
    {
        return None;
    }
    let dtype = data_type(x.dtype)?;
    let shape = ConvPlan::new(x.meta.shape(), weight.meta.shape(), options)?;
    // Without cuDNN (no libcudnn), nothing is copied or allocated before falling back.
    let (dnn, side) = match SideContext::of(&x.device).and_then(|side| Ok((side.dnn()?, side))) {
        Ok(found) => found,
        Err(error) => {
            fell_back("cuDNN convolution", &error);
            return None;
        }
    };
    let (x, weight) = (into_contiguous(x.clone()), into_contiguous(weight.clone()));
    let client = &x.client;
    let out_shape = shape.output_shape();
    let out = client.empty(out_shape.num_elements() * x.dtype.size());
    let run = || -> Result<(), KernelError> {
        let dnn = dnn.lock().unwrap();
        side.context()
            .bind_to_thread()
            .map_err(KernelError::device("binding the CUDA context"))?;
        let descriptors = Descriptors::new(&shape, dtype)?;
        let (algorithm, workspace_bytes) = forward_algorithm(dnn.handle, &descriptors)?;
        let workspace = client.empty(workspace_bytes.max(1));
        let resolve = |handle| {
            address(client, handle).ok_or(KernelError::Unsupported(
                "a buffer CubeCL cannot resolve".into(),
            ))
        };
        let [px, pw, py, pws] = [&x.handle, &weight.handle, &out, &workspace].map(resolve);
        let (px, pw, py, pws) = (px?, pw?, py?, pws?);
        let (alpha, beta) = (1.0f32, 0.0f32);
        ordered(client, &side, &dnn.stream, kernel.order, || {
            // SAFETY: the descriptors describe the contiguous buffers behind the addresses
            // (`out` and the workspace were allocated for them); the ordering keeps every other
            // use of them out of the convolution's way.
            unsafe {
                dnn::convolution_forward(
                    dnn.handle,
                    (&alpha as *const f32).cast::<c_void>(),
                    descriptors.x,
                    px as *const c_void,
                    descriptors.w,
                    pw as *const c_void,
                    descriptors.conv,
                    algorithm,
                    pws as *mut c_void,
                    workspace_bytes,
                    (&beta as *const f32).cast::<c_void>(),
                    descriptors.y,
                    py as *mut c_void,
                )
            }
            .map_err(KernelError::device("cudnnConvolutionForward"))
        })
    };
    if let Err(error) = run() {
        fell_back("cuDNN convolution", &error);
        return None;
    }
    Some(CubeTensor::new_contiguous(
        client.clone(),
        x.device.clone(),
        out_shape,
        out,
        x.dtype,
    ))
}
