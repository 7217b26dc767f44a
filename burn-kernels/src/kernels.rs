//! [`Kernels`], the bound model code puts on its backend, and the entry points it calls:
//! [`attention`], [`gelu_tanh`], [`layer_norm`], [`rms_norm`], [`rms_norm_rope`] return the fused result, or
//! `None` where the backend, the operands or the installed [`KernelOptions`] leave the op to
//! separate ops, which the caller then writes out; [`linear`], [`linear_add`] and
//! [`lora_linear`] run Burn's linear where the vendor BLAS does not take the products.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::counters;
use crate::fused::{FusedOps, LoraProducts, NormRope, UnaryOp};
use crate::options::{AttentionRoute, KernelOptions};

/// A backend whose models can call the fused entry points: every [`FusedOps`] backend, and
/// `Autodiff` of one under any checkpoint strategy (see `autodiff.rs`).
pub trait Kernels: Backend {
    /// `softmax(scale · q kᵀ) v` for `[batch, heads, rows, head_dim]` tensors, fused.
    fn attention(
        q: &FloatTensor<Self>,
        k: &FloatTensor<Self>,
        v: &FloatTensor<Self>,
        scale: f32,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>>;

    /// `op` on `x`, fused.
    fn unary(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>>;

    /// The RMS norm of `x` with `scale`, then the rotation by `cos` and `sin`, fused.
    fn norm_rope(operands: NormRope<Self>, options: &KernelOptions) -> Option<FloatTensor<Self>>;

    /// `x · weight` (weight `[d_input, d_output]`, Burn's layout) through the vendor BLAS, its
    /// gradients too.
    fn blas_linear(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>>;

    /// `alpha · x · weight + addend` through the vendor BLAS, written into `addend`'s memory,
    /// its gradients too; `Err(addend)` where the BLAS does not take it.
    fn blas_linear_add(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        addend: FloatTensor<Self>,
        alpha: f32,
        options: &KernelOptions,
    ) -> Result<FloatTensor<Self>, FloatTensor<Self>>;

    /// `x · weight + alpha · (x · down) · up` (see [`LoraProducts`]) through the vendor BLAS,
    /// the three products in one place in the backend's order, and the five of its gradients
    /// likewise; `None` where the BLAS does not take them or the base weight needs a gradient.
    fn blas_lora(
        products: LoraProducts<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>>;

    /// `param` as the forward reads it: itself, or, where the backend takes the parameter's
    /// gradient ([`FusedOps::takes_gradient`]), an op whose backward hands its gradient to the
    /// backend instead of the graph.
    fn trainable(param: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl<B: FusedOps> Kernels for B {
    fn attention(
        q: &FloatTensor<Self>,
        k: &FloatTensor<Self>,
        v: &FloatTensor<Self>,
        scale: f32,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::fused_attention(q, k, v, scale, options).map(|(out, _)| out)
    }

    fn unary(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::fused_unary(op, x, options)
    }

    fn norm_rope(operands: NormRope<Self>, options: &KernelOptions) -> Option<FloatTensor<Self>> {
        B::fused_norm_rope(&operands, options)
    }

    fn blas_linear(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::blas_matmul(x, weight, options)
    }

    fn blas_linear_add(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        addend: FloatTensor<Self>,
        alpha: f32,
        options: &KernelOptions,
    ) -> Result<FloatTensor<Self>, FloatTensor<Self>> {
        B::blas_matmul_add(x, weight, addend, alpha, options)
    }

    fn blas_lora(
        products: LoraProducts<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::blas_lora(&products, options).map(|(y, _)| y)
    }

    /// Without autodiff there is no gradient to take.
    fn trainable(param: FloatTensor<Self>) -> FloatTensor<Self> {
        param
    }
}

fn primitive<B: Backend, const D: usize>(tensor: &Tensor<B, D>) -> FloatTensor<B> {
    tensor.clone().into_primitive().tensor()
}

fn tensor<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// `run` under the installed options when `enabled` says they allow it, its result counted by
/// `count`: the part every fused entry point shares.
fn fused<B: Backend, const D: usize>(
    enabled: fn(&KernelOptions) -> bool,
    count: fn(),
    run: impl FnOnce(&KernelOptions) -> Option<FloatTensor<B>>,
) -> Option<Tensor<B, D>> {
    let options = KernelOptions::current();
    if !enabled(&options) {
        return None;
    }
    let out = run(&options)?;
    count();
    Some(tensor(out))
}

/// `softmax(scale · q kᵀ) v` over `[batch, heads, rows, head_dim]` tensors through the
/// backend's fused kernel (on CUDA: bf16, heads of 64 or 128), forward and backward; `None`
/// where there is none for these tensors or the installed options switch it off.
pub fn attention<B: Kernels>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    scale: f64,
) -> Option<Tensor<B, 4>> {
    fused(
        |o| o.attention != AttentionRoute::Separate,
        counters::count_attention,
        |options| {
            <B as Kernels>::attention(
                &primitive(q),
                &primitive(k),
                &primitive(v),
                scale as f32,
                options,
            )
        },
    )
}

/// GELU with the tanh approximation, computed in f32 in one kernel (one more for its gradient)
/// and returned in `x`'s dtype; `None` where the backend has no such kernel or the installed
/// options switch it off.
pub fn gelu_tanh<B: Kernels, const D: usize>(x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    unary(UnaryOp::GeluTanh, x)
}

/// Layer norm over the last dimension without learned parameters, computed in f32 in one kernel
/// (one more for its gradient) and returned in `x`'s dtype; `None` as for [`gelu_tanh`].
pub fn layer_norm<B: Kernels, const D: usize>(x: &Tensor<B, D>, eps: f64) -> Option<Tensor<B, D>> {
    unary(UnaryOp::LayerNorm { eps: eps as f32 }, x)
}

/// RMS norm over the last dimension without a learned scale, `x / √(mean(x²) + eps)`, computed
/// in f32 in one kernel (one more for its gradient) and returned in `x`'s dtype; `None` as for
/// [`gelu_tanh`].
pub fn rms_norm<B: Kernels, const D: usize>(x: &Tensor<B, D>, eps: f64) -> Option<Tensor<B, D>> {
    unary(UnaryOp::RmsNorm { eps: eps as f32 }, x)
}

fn unary<B: Kernels, const D: usize>(op: UnaryOp, x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    fused(
        |o| o.fused_elementwise,
        counters::count_elementwise,
        |options| <B as Kernels>::unary(op, &primitive(x), options),
    )
}

/// `x / √(mean(x²) + eps) · scale` over the last dimension, then each pair of lanes
/// `(n₀, n₁)` turned to `(n₀ cos − n₁ sin, n₁ cos + n₀ sin)` by its token's angles, computed in
/// f32 in one kernel (one more for the gradient of `x`) and returned in `x`'s dtype; `None`
/// where the backend has no such kernel, the installed options switch it off, or the scale or
/// the tables need gradients (the fused op gives only `x` one). The tables hold one head's
/// `rot` lanes: a row of `x` is one head (`rot = dim`), or all heads of a token normed together
/// (`dim = heads · rot`, Wan's norm across heads), each head turned by the same angles.
///
/// # Shapes
/// - `x`: `[batch, heads, tokens, dim]` or `[batch, tokens, dim]`; `scale`: `[dim]`; `cos`,
///   `sin`: `[tokens, rot]`
pub fn rms_norm_rope<B: Kernels, const D: usize>(
    x: &Tensor<B, D>,
    scale: &Tensor<B, 1>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    eps: f64,
) -> Option<Tensor<B, D>> {
    fused(
        |o| o.fused_elementwise,
        counters::count_elementwise,
        |options| {
            let operands = NormRope {
                x: primitive(x),
                scale: primitive(scale),
                cos: primitive(cos),
                sin: primitive(sin),
                eps: eps as f32,
            };
            <B as Kernels>::norm_rope(operands, options)
        },
    )
}

/// `x · weight + bias` (weight `[d_input, d_output]`, bias `[d_output]`: an `nn::Linear`'s
/// parameters), through the vendor BLAS where the backend has one, the installed options route
/// products there and the layouts fit (forward and backward, counted in
/// [`counters`](crate::counters)), else through Burn's `module::linear`, so that a backend
/// without BLAS computes exactly what `nn::Linear::forward` computes.
pub fn linear<B: Kernels, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let options = KernelOptions::current();
    let Some(out) = <B as Kernels>::blas_linear(&primitive(&x), &primitive(&weight), &options)
    else {
        return burn::tensor::module::linear(x, weight, bias);
    };
    counters::count_blas_product();
    with_bias(tensor(out), bias)
}

/// `out + bias` over the last dimension, as Burn's linear adds it.
fn with_bias<B: Backend, const D: usize>(
    out: Tensor<B, D>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    match bias {
        Some(bias) => out + bias.unsqueeze(),
        None => out,
    }
}

/// `addend + alpha · (x · weight)` (weight `[d_input, d_output]`, Burn's layout; `addend` of
/// the product's shape): the vendor BLAS accumulates the product into `addend`'s memory where
/// the backend has one, the options route products there, the layouts fit and nothing else
/// holds `addend` (a LoRA's update added to the base layer's output without a pass of its own);
/// else [`linear`], [`Tensor::mul_scalar`] and the sum, as separate ops.
pub fn linear_add<B: Kernels, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    addend: Tensor<B, D>,
    alpha: f64,
) -> Tensor<B, D> {
    let options = KernelOptions::current();
    let addend = addend.into_primitive().tensor();
    match <B as Kernels>::blas_linear_add(
        &primitive(&x),
        &primitive(&weight),
        addend,
        alpha as f32,
        &options,
    ) {
        Ok(out) => {
            counters::count_blas_accumulated();
            tensor(out)
        }
        Err(addend) => {
            let product = linear(x, weight, None);
            let product = if alpha == 1.0 {
                product
            } else {
                product.mul_scalar(alpha)
            };
            tensor::<B, D>(addend) + product
        }
    }
}

/// A LoRA layer, `x · weight + bias + alpha · (x · down) · up` (Burn's layouts: weight
/// `[d_in, d_out]`, bias `[d_out]`, down `[d_in, rank]`, up `[rank, d_out]`). Where the backend
/// has a vendor BLAS, the options route products there and the base weight needs no gradient,
/// the three products go there in one place in the backend's order, and the five of the
/// gradients likewise (counted in [`counters`](crate::counters)): one ordering each way instead
/// of one per product. Else [`linear`] for the base and the down factor and [`linear_add`] for
/// the up factor.
pub fn lora_linear<B: Kernels, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    down: Tensor<B, 2>,
    up: Tensor<B, 2>,
    alpha: f64,
) -> Tensor<B, D> {
    let options = KernelOptions::current();
    let products = LoraProducts {
        x: primitive(&x),
        weight: primitive(&weight),
        down: primitive(&down),
        up: primitive(&up),
        alpha: alpha as f32,
    };
    let Some(out) = <B as Kernels>::blas_lora(products, &options) else {
        let y = linear(x.clone(), weight, bias);
        return linear_add(linear(x, down, None), up, y, alpha);
    };
    counters::count_lora(3);
    with_bias(tensor(out), bias)
}

/// A trainable parameter as the forward reads it: the same values, whose gradient the backend
/// may take to host memory as the backward produces it, instead of keeping it in the graph's
/// gradients until the backward ends (burn-offload's `GradientSink`). Call it on each
/// parameter read that the forward differentiates.
pub fn trainable<B: Kernels, const D: usize>(param: Tensor<B, D>) -> Tensor<B, D> {
    tensor(B::trainable(param.into_primitive().tensor()))
}
