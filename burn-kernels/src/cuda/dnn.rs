//! Convolutions and their gradients through cuDNN on Burn-owned buffers: the CUDA mechanism
//! behind [`FusedOps::dnn_conv2d`](crate::FusedOps::dnn_conv2d) and
//! [`FusedOps::dnn_conv2d_backward`](crate::FusedOps::dnn_conv2d_backward). cuDNN's heuristics pick the algorithm
//! for each shape, so a convolution costs no compilation and no timing runs on first use.
//!
//! cuDNN runs on a CUDA stream of its own, kept in CubeCL's order as the cuBLAS products are
//! (`order.rs`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use burn::tensor::DType;
use burn::tensor::ops::ConvOptions;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::cudnn::result as dnn;
use cudarc::cudnn::sys::{
    cudnnConvolutionBwdDataAlgo_t, cudnnConvolutionBwdDataAlgoPerf_t,
    cudnnConvolutionBwdFilterAlgo_t, cudnnConvolutionBwdFilterAlgoPerf_t,
    cudnnConvolutionDescriptor_t, cudnnConvolutionFwdAlgo_t, cudnnConvolutionFwdAlgoPerf_t,
    cudnnConvolutionMode_t, cudnnDataType_t, cudnnFilterDescriptor_t, cudnnHandle_t,
    cudnnMathType_t, cudnnStatus_t, cudnnTensorDescriptor_t, cudnnTensorFormat_t,
};
use cudarc::driver::{CudaContext, CudaStream};

use crate::conv::ConvPlan;
use crate::cuda::SideContext;
use crate::cuda::order::ordered;
use crate::cuda::sdpa::{self, AttentionShape, Plan};
use crate::error::{KernelError, fell_back};
use crate::fused::ConvGrad;
use crate::options::{BlasRoute, KernelOptions};

/// The largest workspace an algorithm may ask for; cuDNN's next choice is taken above it.
/// 256 MiB keeps a convolution's scratch a small part of the budgets the trainer runs in
/// (the backend's pool keeps a large allocation's page after it is freed).
const WORKSPACE_LIMIT: usize = 256 << 20;

/// A cuDNN handle bound to its own stream on one device.
pub(crate) struct Dnn {
    stream: Arc<CudaStream>,
    handle: cudnnHandle_t,
    /// The algorithm and workspace chosen for each pass, shape and dtype: cuDNN 9 answers a
    /// `_v7` heuristics query by building an operation graph, which costs milliseconds, so
    /// each convolution asks once.
    chosen: HashMap<(Pass, ConvPlan, u32), (Algorithm, usize)>,
    /// The fused attention's forward and backward plans per shape; `None` where cuDNN offers
    /// no engine for either.
    attention: HashMap<AttentionShape, Option<(Plan, Plan)>>,
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
        Ok(Self {
            stream,
            handle,
            chosen: HashMap::new(),
            attention: HashMap::new(),
        })
    }

    /// The stream cuDNN runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The cuDNN handle (bound to [`Dnn::stream`]).
    pub(crate) fn handle(&self) -> cudnnHandle_t {
        self.handle
    }

    /// The forward and backward plans of the fused attention for `shape`, built on first use
    /// with the CUDA context bound; `None` when cuDNN has no engine for either (logged once per
    /// shape: the caller's own kernels run it instead).
    pub(crate) fn attention_plans(&mut self, shape: &AttentionShape) -> Option<&(Plan, Plan)> {
        let handle = self.handle;
        self.attention
            .entry(*shape)
            .or_insert_with(|| {
                let built = sdpa::forward_plan(handle, shape)
                    .and_then(|forward| Ok((forward, sdpa::backward_plan(handle, shape)?)));
                built
                    .inspect_err(|error| {
                        tracing::info!(
                            "cuDNN attention for {shape:?}: {error}; the fused kernels run it"
                        )
                    })
                    .ok()
            })
            .as_ref()
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

/// cuDNN's first choice of algorithm whose workspace is within [`WORKSPACE_LIMIT`], with that
/// workspace's size, from a `cudnnGetConvolution*Algorithm_v7` query (its heuristics, no timing
/// runs): `$query` fills `$results` and counts them in `$found`.
macro_rules! first_algorithm {
    ($perf:ty, $count:expr, $name:literal, |$found:ident, $results:ident| $query:expr) => {{
        const COUNT: usize = $count as usize;
        // SAFETY: cuDNN writes at most `COUNT` plain-data results, and only those it counts are
        // read.
        let mut perf: [$perf; COUNT] = unsafe { std::mem::zeroed() };
        let mut $found = 0;
        let $results = perf.as_mut_ptr();
        // SAFETY: live descriptors of one convolution and room for `COUNT` results.
        unsafe { $query }.map_err(KernelError::device($name))?;
        perf[..$found.clamp(0, COUNT as i32) as usize]
            .iter()
            .find(|p| {
                p.status == cudnnStatus_t::CUDNN_STATUS_SUCCESS && p.memory <= WORKSPACE_LIMIT
            })
            .map(|p| (p.algo, p.memory))
            .ok_or_else(|| {
                KernelError::Unsupported(format!("{}: no algorithm for this convolution", $name))
            })
    }};
}

/// Which of a convolution's three products a call computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Pass {
    /// `y` from `x` and the filter.
    Forward,
    /// `dx` from the filter and `dy`.
    Input,
    /// The filter's gradient from `x` and `dy`.
    Filter,
}

/// The convolution of `x` with `weight` under `options` (no bias) through cuDNN, or `None` when
/// `options` leave it to Burn, the dtypes or shapes do not fit, or cuDNN fails (logged).
pub(crate) fn conv2d(
    x: &CubeTensor<CudaRuntime>,
    weight: &CubeTensor<CudaRuntime>,
    options: &ConvOptions<2>,
    kernel: &KernelOptions,
) -> Option<CubeTensor<CudaRuntime>> {
    convolve(Pass::Forward, x, weight, None, options, kernel)
}

/// The gradient `wanted` of the convolution of `x` with `weight` under `options`, given
/// `output_grad`, through cuDNN; `None` as [`conv2d`].
pub(crate) fn conv2d_backward(
    x: &CubeTensor<CudaRuntime>,
    weight: &CubeTensor<CudaRuntime>,
    output_grad: &CubeTensor<CudaRuntime>,
    options: &ConvOptions<2>,
    wanted: ConvGrad,
    kernel: &KernelOptions,
) -> Option<CubeTensor<CudaRuntime>> {
    let pass = match wanted {
        ConvGrad::Input => Pass::Input,
        ConvGrad::Weight => Pass::Filter,
    };
    convolve(pass, x, weight, Some(output_grad), options, kernel)
}

/// `pass` of the convolution of `x` with `weight` (`dy` its output's gradient for the backward
/// passes), or `None` as [`conv2d`].
fn convolve(
    pass: Pass,
    x: &CubeTensor<CudaRuntime>,
    weight: &CubeTensor<CudaRuntime>,
    dy: Option<&CubeTensor<CudaRuntime>>,
    options: &ConvOptions<2>,
    kernel: &KernelOptions,
) -> Option<CubeTensor<CudaRuntime>> {
    let operands = [Some(x), Some(weight), dy];
    if kernel.blas == BlasRoute::Off
        || operands
            .iter()
            .flatten()
            .any(|t| t.dtype != x.dtype || t.qparams.is_some())
    {
        return None;
    }
    let dtype = data_type(x.dtype)?;
    let shape = ConvPlan::new(x.meta.shape(), weight.meta.shape(), options)?;
    if dy.is_some_and(|dy| *dy.meta.shape() != shape.output_shape()) {
        return None;
    }
    // Without cuDNN (no libcudnn), nothing is copied or allocated before falling back.
    let (dnn, side) = match SideContext::of(&x.device).and_then(|side| Ok((side.dnn()?, side))) {
        Ok(found) => found,
        Err(error) => {
            fell_back("cuDNN convolution", &error);
            return None;
        }
    };
    let (x, weight) = (into_contiguous(x.clone()), into_contiguous(weight.clone()));
    let dy = dy.map(|dy| into_contiguous(dy.clone()));
    let client = &x.client;
    let out_shape = match pass {
        Pass::Forward => shape.output_shape(),
        Pass::Input => x.meta.shape().clone(),
        Pass::Filter => weight.meta.shape().clone(),
    };
    let out = client.empty(out_shape.num_elements() * x.dtype.size());
    let run = || -> Result<(), KernelError> {
        let mut dnn = dnn.lock().unwrap();
        side.context()
            .bind_to_thread()
            .map_err(KernelError::device("binding the CUDA context"))?;
        let d = Descriptors::new(&shape, dtype)?;
        let h = dnn.handle;
        let key = (pass, shape.clone(), dtype as u32);
        let (algorithm, workspace_bytes) = match dnn.chosen.get(&key) {
            Some(&chosen) => chosen,
            None => {
                let chosen = choose(pass, h, &d)?;
                dnn.chosen.insert(key, chosen);
                chosen
            }
        };
        let workspace = client.empty(workspace_bytes.max(1));
        // The forward has no `dy`; `x` stands in for it, unused.
        let dy_handle = dy.as_ref().map_or(&x.handle, |dy| &dy.handle);
        let buffers = [&x.handle, &weight.handle, &out, &workspace, dy_handle];
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (alpha, beta) = (
            (&alpha as *const f32).cast::<c_void>(),
            (&beta as *const f32).cast::<c_void>(),
        );
        ordered(
            client,
            &side,
            &dnn.stream,
            kernel.order,
            buffers,
            |addresses| {
                let [px, pw, pout, pws, pdy] = addresses;
                let pdy = dy.is_some().then_some(pdy);
                let ws = pws as *mut c_void;
                // SAFETY: the descriptors describe the contiguous buffers behind the addresses
                // (`out` and the workspace were allocated for them, `dy` was checked to be the
                // output's shape); the ordering keeps every other use of them out of the
                // convolution's way.
                unsafe {
                    match (algorithm, pdy) {
                        (Algorithm::Forward(algo), _) => dnn::convolution_forward(
                            h,
                            alpha,
                            d.x,
                            px as _,
                            d.w,
                            pw as _,
                            d.conv,
                            algo,
                            ws,
                            workspace_bytes,
                            beta,
                            d.y,
                            pout as _,
                        ),
                        (Algorithm::Input(algo), Some(pdy)) => dnn::convolution_backward_data(
                            h,
                            alpha,
                            d.w,
                            pw as _,
                            d.y,
                            pdy as _,
                            d.conv,
                            algo,
                            ws,
                            workspace_bytes,
                            beta,
                            d.x,
                            pout as _,
                        ),
                        (Algorithm::Filter(algo), Some(pdy)) => dnn::convolution_backward_filter(
                            h,
                            alpha,
                            d.x,
                            px as _,
                            d.y,
                            pdy as _,
                            d.conv,
                            algo,
                            ws,
                            workspace_bytes,
                            beta,
                            d.w,
                            pout as _,
                        ),
                        (_, None) => unreachable!("the backward passes are given dy"),
                    }
                }
                .map_err(KernelError::device("a cuDNN convolution"))
            },
        )
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

/// cuDNN's choice of algorithm for `pass` of the convolution `d` describes (its heuristics,
/// no timing runs), with that algorithm's workspace.
fn choose(
    pass: Pass,
    h: cudnnHandle_t,
    d: &Descriptors,
) -> Result<(Algorithm, usize), KernelError> {
    Ok(match pass {
        Pass::Forward => first_algorithm!(
            cudnnConvolutionFwdAlgoPerf_t,
            cudnnConvolutionFwdAlgo_t::CUDNN_CONVOLUTION_FWD_ALGO_COUNT,
            "cudnnGetConvolutionForwardAlgorithm_v7",
            |found, results| dnn::get_convolution_forward_algorithm(
                h,
                d.x,
                d.w,
                d.conv,
                d.y,
                COUNT as i32,
                &mut found,
                results
            )
        )
        .map(|(algo, bytes)| (Algorithm::Forward(algo), bytes))?,
        Pass::Input => first_algorithm!(
            cudnnConvolutionBwdDataAlgoPerf_t,
            cudnnConvolutionBwdDataAlgo_t::CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
            "cudnnGetConvolutionBackwardDataAlgorithm_v7",
            |found, results| dnn::get_convolution_backward_data_algorithm(
                h,
                d.w,
                d.y,
                d.conv,
                d.x,
                COUNT as i32,
                &mut found,
                results
            )
        )
        .map(|(algo, bytes)| (Algorithm::Input(algo), bytes))?,
        Pass::Filter => first_algorithm!(
            cudnnConvolutionBwdFilterAlgoPerf_t,
            cudnnConvolutionBwdFilterAlgo_t::CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
            "cudnnGetConvolutionBackwardFilterAlgorithm_v7",
            |found, results| dnn::get_convolution_backward_filter_algorithm(
                h,
                d.x,
                d.y,
                d.conv,
                d.w,
                COUNT as i32,
                &mut found,
                results
            )
        )
        .map(|(algo, bytes)| (Algorithm::Filter(algo), bytes))?,
    })
}

/// The algorithm cuDNN chose for a pass.
#[derive(Clone, Copy)]
enum Algorithm {
    Forward(cudnnConvolutionFwdAlgo_t),
    Input(cudnnConvolutionBwdDataAlgo_t),
    Filter(cudnnConvolutionBwdFilterAlgo_t),
}
