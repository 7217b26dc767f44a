//! The matrix products and convolutions of a decorator's ops on the backend it decorates:
//! through the vendor BLAS ([`FusedOps::blas_matmul`]) or DNN library
//! ([`FusedOps::dnn_conv2d`], [`FusedOps::dnn_conv2d_backward`]) where the backend has one, the options route the op there and it
//! takes the layouts, else through the backend's own op of the same name, so a backend without
//! them runs exactly what it ran before.

use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn::tensor::{Shape, TensorMetadata};

use crate::counters::{count_blas_product, count_dnn_convolution};
use crate::fused::{ConvGrad, FusedOps, LoraProducts};
use crate::options::KernelOptions;

/// The vendor BLAS's product, counted.
fn blas<B: FusedOps>(
    lhs: &FloatTensor<B>,
    rhs: &FloatTensor<B>,
    options: &KernelOptions,
) -> Option<FloatTensor<B>> {
    let out = B::blas_matmul(lhs, rhs, options)?;
    count_blas_product();
    Some(out)
}

/// `lhs · rhs`, as `float_matmul`.
pub fn matmul<B: FusedOps>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    options: &KernelOptions,
) -> FloatTensor<B> {
    blas::<B>(&lhs, &rhs, options).unwrap_or_else(|| B::float_matmul(lhs, rhs))
}

/// `x · weight + bias` (weight `[d_input, d_output]`), as `linear`.
pub fn linear<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: &KernelOptions,
) -> FloatTensor<B> {
    let Some(out) = blas::<B>(&x, &weight, options) else {
        return B::linear(x, weight, bias);
    };
    let Some(bias) = bias else {
        return out;
    };
    // [d_output] → [1, …, 1, d_output], as Burn's default linear broadcasts it.
    let rank = out.shape().num_dims();
    let mut dims = vec![1; rank];
    dims[rank - 1] = bias.shape().num_elements();
    B::float_add(out, B::float_reshape(bias, Shape::from(dims)))
}

/// The 2-D convolution of `x` with `weight` under `conv`, plus `bias` per output channel, as
/// `conv2d`.
pub fn conv2d<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    conv: ConvOptions<2>,
    options: &KernelOptions,
) -> FloatTensor<B> {
    let Some(out) = B::dnn_conv2d(&x, &weight, &conv, options) else {
        return B::conv2d(x, weight, bias, conv);
    };
    count_dnn_convolution();
    let Some(bias) = bias else {
        return out;
    };
    let channels = bias.shape().num_elements();
    B::float_add(out, B::float_reshape(bias, Shape::new([1, channels, 1, 1])))
}

/// The gradient `wanted` of the convolution of `x` with `weight` under `conv`, given
/// `output_grad`, as `conv2d_x_backward` / `conv2d_weight_backward`.
pub fn conv2d_backward<B: FusedOps>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
    conv: ConvOptions<2>,
    wanted: ConvGrad,
    options: &KernelOptions,
) -> FloatTensor<B> {
    if let Some(grad) = B::dnn_conv2d_backward(&x, &weight, &output_grad, &conv, wanted, options) {
        count_dnn_convolution();
        return grad;
    }
    match wanted {
        ConvGrad::Input => B::conv2d_x_backward(x, weight, output_grad, conv),
        ConvGrad::Weight => B::conv2d_weight_backward(x, weight, output_grad, conv),
    }
}

/// `output_grad · weightᵀ`, as `linear_x_backward`.
pub fn linear_x_backward<B: FusedOps>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
    options: &KernelOptions,
) -> FloatTensor<B> {
    if B::blas_routes(options) {
        let weight_t = B::float_swap_dims(weight.clone(), 0, 1);
        if let Some(grad) = blas::<B>(&output_grad, &weight_t, options) {
            return grad;
        }
    }
    B::linear_x_backward(weight, output_grad)
}

/// `xᵀ · output_grad` summed over the batch dimensions, as `linear_weight_backward`: one
/// product over all rows at once.
pub fn linear_weight_backward<B: FusedOps>(
    x: FloatTensor<B>,
    output_grad: FloatTensor<B>,
    options: &KernelOptions,
) -> FloatTensor<B> {
    if B::blas_routes(options) {
        let rows = |t: &FloatTensor<B>| {
            let shape = t.shape();
            let cols = shape[shape.num_dims() - 1];
            Shape::new([shape.num_elements() / cols.max(1), cols])
        };
        let x_t = B::float_swap_dims(B::float_reshape(x.clone(), rows(&x)), 0, 1);
        let grad = B::float_reshape(output_grad.clone(), rows(&output_grad));
        if let Some(weight_grad) = blas::<B>(&x_t, &grad, options) {
            return weight_grad;
        }
    }
    B::linear_weight_backward(x, output_grad)
}

/// The gradients `[x, down, up]` of `x · weight + alpha · (x · down) · up` (see
/// [`LoraProducts`]) given the output's gradient `grad` and `h = x · down`, product by product
/// (each through [`linear_x_backward`] or [`linear_weight_backward`]).
pub fn lora_backward<B: FusedOps>(
    products: &LoraProducts<B>,
    h: FloatTensor<B>,
    grad: FloatTensor<B>,
    options: &KernelOptions,
) -> [FloatTensor<B>; 3] {
    let scaled = B::float_mul_scalar(grad.clone(), products.alpha.into());
    let dh = linear_x_backward::<B>(products.up.clone(), scaled.clone(), options);
    let dx = B::float_add(
        linear_x_backward::<B>(products.weight.clone(), grad, options),
        linear_x_backward::<B>(products.down.clone(), dh.clone(), options),
    );
    let d_down = linear_weight_backward::<B>(products.x.clone(), dh, options);
    let d_up = linear_weight_backward::<B>(h, scaled, options);
    [dx, d_down, d_up]
}
