//! [`FusedOps`]: what a backend that computes (not a decorator of autodiff) offers the entry
//! points, on its own tensors: fused forwards that may decline, and their backwards.

use std::fmt::Debug;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor};

use crate::options::KernelOptions;

/// √(2/π), GELU's (tanh) scale.
pub(crate) const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term's coefficient in GELU (tanh).
pub(crate) const GELU_CUBIC: f32 = 0.044_715;

/// A fused op of one tensor whose gradient needs only that tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    /// GELU with the tanh approximation, `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
    GeluTanh,
    /// Layer norm over the last dimension without learned parameters, `(x − mean) / √(var +
    /// eps)` (biased variance).
    LayerNorm {
        /// Added to the variance.
        eps: f32,
    },
    /// RMS norm over the last dimension without a learned scale, `x / √(mean(x²) + eps)`.
    RmsNorm {
        /// Added to the mean square.
        eps: f32,
    },
}

/// The operands of one fused RMS norm and rotary embedding.
#[derive(Debug, Clone)]
pub struct NormRope<B: Backend> {
    /// `[..., tokens, dim]`: one head of one token per row, or all heads of one token.
    pub x: FloatTensor<B>,
    /// The norm's learned scale, `dim` values.
    pub scale: FloatTensor<B>,
    /// Cosines of the angles of one head, `[tokens, rot]` (each pair's value repeated for both
    /// lanes; `rot` even and a divisor of `dim`): lane `c` of a row turns by lane `c mod rot`'s.
    pub cos: FloatTensor<B>,
    /// Sines of the angles, as `cos`.
    pub sin: FloatTensor<B>,
    /// Added to the mean square.
    pub eps: f32,
}

/// The operands of a LoRA layer's three products, `x · weight + alpha · (x · down) · up`, in
/// Burn's layouts: `x` `[..., d_in]`, `weight` `[d_in, d_out]`, `down` `[d_in, rank]`, `up`
/// `[rank, d_out]`.
#[derive(Debug, Clone)]
pub struct LoraProducts<B: Backend> {
    /// The layer's input.
    pub x: FloatTensor<B>,
    /// The base layer's weight.
    pub weight: FloatTensor<B>,
    /// The down factor.
    pub down: FloatTensor<B>,
    /// The up factor.
    pub up: FloatTensor<B>,
    /// The update's scale.
    pub alpha: f32,
}

/// The state of a kernel a backend does not have: no value exists, so its backward cannot be
/// reached.
#[derive(Debug, Clone, Copy)]
pub enum NoKernel {}

/// The fused kernels of a backend that computes: Burn's `Flex` (CPU), CUDA and wgpu backends,
/// and decorators of them such as burn-offload's `Offload`. `Autodiff` of such a backend gets
/// [`Kernels`](crate::Kernels) from these, recording each fused forward as one op whose
/// backward is the matching method here.
///
/// A forward returns `None` where the kernel does not take the operands (dtype, layout, head
/// size) or the options switch it off; the entry point then computes the same from separate
/// ops. A forward that fails logs why ([`fell_back`](crate::fell_back)) and returns `None`.
pub trait FusedOps: Backend {
    /// What a fused attention's forward keeps for its backward; [`NoKernel`] where the backend
    /// has no fused attention.
    type Attention: Clone + Send + Debug + 'static;

    /// `softmax(scale · q kᵀ) v` for `[batch, heads, rows, head_dim]` tensors in one kernel, and
    /// what its backward needs.
    fn fused_attention(
        q: &FloatTensor<Self>,
        k: &FloatTensor<Self>,
        v: &FloatTensor<Self>,
        scale: f32,
        options: &KernelOptions,
    ) -> Option<(FloatTensor<Self>, Self::Attention)>;

    /// The gradients of `q`, `k` and `v` given the output's gradient `grad`.
    fn fused_attention_backward(
        qkv: [&FloatTensor<Self>; 3],
        saved: &Self::Attention,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> [FloatTensor<Self>; 3];

    /// `op` on `x` in one kernel, computed in f32 and stored in `x`'s dtype.
    fn fused_unary(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>>;

    /// The gradient of `x` given `grad`, the gradient of [`fused_unary`](Self::fused_unary)'s
    /// output.
    fn fused_unary_backward(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// The RMS norm and rotary embedding of `operands.x` in one kernel (see
    /// [`rms_norm_rope`](crate::rms_norm_rope)).
    fn fused_norm_rope(
        operands: &NormRope<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>>;

    /// The gradient of `operands.x` given `grad`, the gradient of
    /// [`fused_norm_rope`](Self::fused_norm_rope)'s output.
    fn fused_norm_rope_backward(
        operands: &NormRope<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Whether [`blas_matmul`](Self::blas_matmul) may take products under `options` (a caller
    /// prepares transposed and flattened views only then).
    fn blas_routes(options: &KernelOptions) -> bool {
        let _ = options;
        false
    }

    /// `lhs · rhs` with `float_matmul`'s broadcasting, computed by the device's vendor BLAS;
    /// `None` where the backend has none, the options leave the product to Burn, or the dtypes
    /// or layouts do not fit.
    fn blas_matmul(
        lhs: &FloatTensor<Self>,
        rhs: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let _ = (lhs, rhs, options);
        None
    }

    /// `alpha · lhs · rhs + addend` (`addend` of the product's shape and dtype) computed by the
    /// vendor BLAS into `addend`'s own memory, so that the sum costs no pass of its own;
    /// `Err(addend)`, untouched, where [`blas_matmul`](Self::blas_matmul) would decline, or
    /// `addend`'s memory is shared or not laid out as the product's.
    fn blas_matmul_add(
        lhs: &FloatTensor<Self>,
        rhs: &FloatTensor<Self>,
        addend: FloatTensor<Self>,
        alpha: f32,
        options: &KernelOptions,
    ) -> Result<FloatTensor<Self>, FloatTensor<Self>> {
        let _ = (lhs, rhs, alpha, options);
        Err(addend)
    }

    /// `(x · weight + alpha · h · up, h)` with `h = x · down` (see [`LoraProducts`]), the
    /// three products computed by the vendor BLAS in one place in the backend's order; `None`
    /// where the backend has none, the options leave products to Burn, or the dtypes or layouts
    /// do not fit.
    fn blas_lora(
        products: &LoraProducts<Self>,
        options: &KernelOptions,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let _ = (products, options);
        None
    }

    /// The gradients `[x, down, up]` of [`blas_lora`](Self::blas_lora)'s output given its
    /// gradient `grad` and the forward's `h`, the five products (the base weight's gradient is
    /// not one of them) computed by the vendor BLAS in one place in the backend's order; `None`
    /// where [`blas_lora`](Self::blas_lora) would decline.
    fn blas_lora_backward(
        products: &LoraProducts<Self>,
        h: &FloatTensor<Self>,
        grad: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<[FloatTensor<Self>; 3]> {
        let _ = (products, h, grad, options);
        None
    }

    /// Whether the gradient of the trainable parameter `param` goes to a sink of the backend's
    /// (host memory, as each backward produces it) rather than into the autodiff graph's
    /// gradients ([`trainable`](crate::trainable)). No parameter's does by default.
    fn takes_gradient(param: &FloatTensor<Self>) -> bool {
        let _ = param;
        false
    }

    /// Hands `grad`, a gradient of `param`, to its sink; called only where
    /// [`takes_gradient`](Self::takes_gradient) said yes.
    fn sink_gradient(param: &FloatTensor<Self>, grad: FloatTensor<Self>) {
        let _ = (param, grad);
    }

    /// The 2-D convolution of `x` (`[batch, channels, height, width]`) with `weight` under
    /// `conv`, without bias, as `conv2d` computes it, by the device's vendor DNN library; `None`
    /// where the backend has none, the options leave products to Burn (`blas: off`), or the
    /// dtypes or shapes do not fit.
    fn dnn_conv2d(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        conv: &ConvOptions<2>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, weight, conv, options);
        None
    }

    /// The gradient `wanted` of [`dnn_conv2d`](Self::dnn_conv2d)'s convolution of `x` with
    /// `weight` under `conv`, given `output_grad`, as `conv2d_x_backward` /
    /// `conv2d_weight_backward` compute it, by the device's vendor DNN library; `None` where
    /// [`dnn_conv2d`](Self::dnn_conv2d) would decline or `output_grad` is not the
    /// convolution's output shape.
    fn dnn_conv2d_backward(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        output_grad: &FloatTensor<Self>,
        conv: &ConvOptions<2>,
        wanted: ConvGrad,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let _ = (x, weight, output_grad, conv, wanted, options);
        None
    }
}

/// Which gradient of a 2-D convolution `y = conv(x, weight)` to compute from `y`'s.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvGrad {
    /// The input's, of `x`'s shape.
    Input,
    /// The filter's, of `weight`'s shape.
    Weight,
}

/// The attention methods of [`FusedOps`] for a backend without a fused attention: the forward
/// declines, and the backward's state is [`NoKernel`], so it cannot be reached.
macro_rules! no_fused_attention {
    () => {
        type Attention = $crate::NoKernel;

        fn fused_attention(
            _q: &burn::tensor::ops::FloatTensor<Self>,
            _k: &burn::tensor::ops::FloatTensor<Self>,
            _v: &burn::tensor::ops::FloatTensor<Self>,
            _scale: f32,
            _options: &$crate::KernelOptions,
        ) -> Option<(burn::tensor::ops::FloatTensor<Self>, $crate::NoKernel)> {
            None
        }

        fn fused_attention_backward(
            _qkv: [&burn::tensor::ops::FloatTensor<Self>; 3],
            saved: &$crate::NoKernel,
            _grad: burn::tensor::ops::FloatTensor<Self>,
            _scale: f32,
        ) -> [burn::tensor::ops::FloatTensor<Self>; 3] {
            match *saved {}
        }
    };
}
pub(crate) use no_fused_attention;
