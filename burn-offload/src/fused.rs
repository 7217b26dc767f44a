//! [`FusedOps`] for `Offload<B, P>`: the fused kernels of `B` on the decorator's device
//! tensors. An operand that is a streamed weight (not on the device) declines the fused path
//! (the model's separate ops then meet it and materialize it, counted in the step's stats),
//! except the base weight of a LoRA layer's products, fetched as the linear ops fetch it.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{ConvOptions, FloatTensor};
use burn_kernels::{ConvGrad, FusedOps, KernelOptions, LoraProducts, NormRope, UnaryOp};

use crate::backend::{Offload, OffloadTensor, PrefetchPolicy};
use crate::ops::module::linear_flops;
use crate::target::StreamTarget;

fn inner<B: StreamTarget>(t: &OffloadTensor<B>) -> Option<&FloatTensor<B>> {
    t.as_inner()
}

fn outer<B: StreamTarget>(t: FloatTensor<B>) -> OffloadTensor<B> {
    OffloadTensor::from_inner(t)
}

/// The operands as `B`'s tensors, `None` when one is a streamed weight.
fn inner_norm_rope<B: StreamTarget, P: PrefetchPolicy>(
    o: &NormRope<Offload<B, P>>,
) -> Option<NormRope<B>> {
    Some(NormRope {
        x: inner(&o.x)?.clone(),
        scale: inner(&o.scale)?.clone(),
        cos: inner(&o.cos)?.clone(),
        sin: inner(&o.sin)?.clone(),
        eps: o.eps,
    })
}

/// `products` as `B`'s tensors handed to `op`, the base weight on the device: itself, or a
/// streamed weight fetched as the decorator's linear ops fetch it (a use of `flops` in the
/// step's profile). `None`, with nothing fetched, when `B` routes no products to a BLAS under
/// `options` or the input or a factor is a streamed weight.
fn with_lora<B: StreamTarget, P: PrefetchPolicy, R>(
    products: &LoraProducts<Offload<B, P>>,
    flops: f64,
    options: &KernelOptions,
    op: impl FnOnce(&LoraProducts<B>) -> Option<R>,
) -> Option<R> {
    if !B::blas_routes(options) {
        return None;
    }
    let (x, down, up) = (
        inner(&products.x)?,
        inner(&products.down)?,
        inner(&products.up)?,
    );
    let run = |weight: &FloatTensor<B>| {
        op(&LoraProducts {
            x: x.clone(),
            weight: weight.clone(),
            down: down.clone(),
            up: up.clone(),
            alpha: products.alpha,
        })
    };
    match products.weight.as_streamed() {
        None => run(inner(&products.weight)?),
        Some(streamed) => streamed
            .engine
            .with_weight(&streamed.weight, flops, P::depth, |w| run(&w)),
    }
}

impl<B: StreamTarget, P: PrefetchPolicy> FusedOps for Offload<B, P> {
    type Attention = B::Attention;

    /// A parameter tagged by a [`GradientSink`](crate::GradientSink) sends its gradients there.
    fn takes_gradient(param: &FloatTensor<Self>) -> bool {
        param.sink.is_some()
    }

    fn sink_gradient(param: &FloatTensor<Self>, grad: FloatTensor<Self>) {
        if let Some(tag) = &param.sink {
            tag.sink.send(tag.index, grad.into_inner());
        }
    }

    fn fused_attention(
        q: &FloatTensor<Self>,
        k: &FloatTensor<Self>,
        v: &FloatTensor<Self>,
        scale: f32,
        options: &KernelOptions,
    ) -> Option<(FloatTensor<Self>, B::Attention)> {
        let (out, saved) = B::fused_attention(inner(q)?, inner(k)?, inner(v)?, scale, options)?;
        Some((outer(out), saved))
    }

    fn fused_attention_backward(
        qkv: [&FloatTensor<Self>; 3],
        saved: &B::Attention,
        grad: FloatTensor<Self>,
        scale: f32,
    ) -> [FloatTensor<Self>; 3] {
        let [q, k, v] = qkv.map(|t| t.clone().into_inner());
        B::fused_attention_backward([&q, &k, &v], saved, grad.into_inner(), scale).map(outer)
    }

    fn fused_unary(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::fused_unary(op, inner(x)?, options).map(outer)
    }

    fn fused_unary_backward(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        outer(B::fused_unary_backward(
            op,
            &x.clone().into_inner(),
            grad.into_inner(),
        ))
    }

    fn fused_norm_rope(
        operands: &NormRope<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::fused_norm_rope(&inner_norm_rope(operands)?, options).map(outer)
    }

    fn blas_routes(options: &KernelOptions) -> bool {
        B::blas_routes(options)
    }

    /// Declined for a streamed weight: the decorator's own linear ops stream it.
    fn blas_matmul(
        lhs: &FloatTensor<Self>,
        rhs: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::blas_matmul(inner(lhs)?, inner(rhs)?, options).map(outer)
    }

    /// Declined for a streamed operand, as [`blas_matmul`](FusedOps::blas_matmul).
    fn blas_matmul_add(
        lhs: &FloatTensor<Self>,
        rhs: &FloatTensor<Self>,
        addend: FloatTensor<Self>,
        alpha: f32,
        options: &KernelOptions,
    ) -> Result<FloatTensor<Self>, FloatTensor<Self>> {
        let (Some(lhs), Some(rhs)) = (inner(lhs), inner(rhs)) else {
            return Err(addend);
        };
        let addend = addend.try_into_inner()?;
        B::blas_matmul_add(lhs, rhs, addend, alpha, options)
            .map(outer)
            .map_err(outer)
    }

    /// A streamed base weight is fetched for the products, as the linear op fetches it.
    fn blas_lora(
        products: &LoraProducts<Self>,
        options: &KernelOptions,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        let flops = linear_flops(&products.x, &products.weight.shape(), 1);
        let (y, h) = with_lora(products, flops, options, |inner| {
            B::blas_lora(inner, options)
        })?;
        Some((outer(y), outer(h)))
    }

    /// A streamed base weight is fetched for the input's gradient, as `linear_x_backward`
    /// fetches it.
    fn blas_lora_backward(
        products: &LoraProducts<Self>,
        h: &FloatTensor<Self>,
        grad: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<[FloatTensor<Self>; 3]> {
        let flops = linear_flops(grad, &products.weight.shape(), 0);
        let (h, grad) = (inner(h)?, inner(grad)?);
        let gradients = with_lora(products, flops, options, |inner| {
            B::blas_lora_backward(inner, h, grad, options)
        })?;
        Some(gradients.map(outer))
    }

    fn dnn_conv2d(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        conv: &ConvOptions<2>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        B::dnn_conv2d(inner(x)?, inner(weight)?, conv, options).map(outer)
    }

    fn dnn_conv2d_backward(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        output_grad: &FloatTensor<Self>,
        conv: &ConvOptions<2>,
        wanted: ConvGrad,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let (x, weight, output_grad) = (inner(x)?, inner(weight)?, inner(output_grad)?);
        B::dnn_conv2d_backward(x, weight, output_grad, conv, wanted, options).map(outer)
    }

    fn fused_norm_rope_backward(
        operands: &NormRope<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let o = NormRope {
            x: operands.x.clone().into_inner(),
            scale: operands.scale.clone().into_inner(),
            cos: operands.cos.clone().into_inner(),
            sin: operands.sin.clone().into_inner(),
            eps: operands.eps,
        };
        outer(B::fused_norm_rope_backward(&o, grad.into_inner()))
    }
}
