//! Burn's backend traits for [`Offload`]: every op forwards to the inner backend, including the
//! methods Burn gives a default body (so the inner backend's own kernels stay in use); only the
//! linear ops stream, in `module.rs`.
//!
//! Each forwarded method is one line of [`forward!`]: a conversion for the result and one per
//! argument. Float tensors go through `lower` (a streamed weight is materialized there) and come
//! back through `lift`; other types pass through `keep`. The matrix products (`float_matmul`
//! and the linear ops) go through burn-kernels' `products`, which hands them to the inner
//! backend's vendor BLAS where it has one and the installed options route them there.

mod activation;
mod bool_tensor;
mod int_tensor;
pub(crate) mod module;
mod qtensor;
mod tensor;
mod transaction;

use burn::tensor::TensorPrimitive;
use burn::tensor::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices,
};
use burn::tensor::quantization::QuantizationParametersPrimitive;

use crate::backend::{Offload, OffloadTensor, PrefetchPolicy};
use crate::target::StreamTarget;

/// Defines trait methods that call the inner backend `B`'s method of the same name:
/// `lift fn op(lower a: FloatTensor<Self>, keep b: usize) -> FloatTensor<Self>;` expands to
/// `fn op(a: FloatTensor<Self>, b: usize) -> FloatTensor<Self> { lift(B::op(lower(a), keep(b))) }`.
macro_rules! forward {
    ($(
        $(#[$meta:meta])*
        $lift:ident fn $name:ident($($lower:ident $arg:ident: $ty:ty),* $(,)?) -> $ret:ty;
    )*) => {
        $(
            $(#[$meta])*
            fn $name($($arg: $ty),*) -> $ret {
                $lift(B::$name($($lower($arg)),*))
            }
        )*
    };
}
use forward;

fn keep<T>(value: T) -> T {
    value
}

fn lower<B: StreamTarget>(tensor: OffloadTensor<B>) -> B::FloatTensorPrimitive {
    tensor.into_inner()
}

fn lower_opt<B: StreamTarget>(tensor: Option<OffloadTensor<B>>) -> Option<B::FloatTensorPrimitive> {
    tensor.map(lower)
}

fn lower_vec<B: StreamTarget>(tensors: Vec<OffloadTensor<B>>) -> Vec<B::FloatTensorPrimitive> {
    tensors.into_iter().map(lower).collect()
}

fn lower_prim<B: StreamTarget, P: PrefetchPolicy>(
    tensor: TensorPrimitive<Offload<B, P>>,
) -> TensorPrimitive<B> {
    match tensor {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(lower(t)),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

fn lower_qparams<B: StreamTarget, P: PrefetchPolicy>(
    qparams: QuantizationParametersPrimitive<Offload<B, P>>,
) -> QuantizationParametersPrimitive<B> {
    QuantizationParametersPrimitive {
        scales: lower(qparams.scales),
    }
}

fn lift<B: StreamTarget>(tensor: B::FloatTensorPrimitive) -> OffloadTensor<B> {
    OffloadTensor::from_inner(tensor)
}

fn lift_first<B: StreamTarget, T>(
    (tensor, other): (B::FloatTensorPrimitive, T),
) -> (OffloadTensor<B>, T) {
    (lift(tensor), other)
}

fn lift_pair<B: StreamTarget>(
    (a, b): (B::FloatTensorPrimitive, B::FloatTensorPrimitive),
) -> (OffloadTensor<B>, OffloadTensor<B>) {
    (lift(a), lift(b))
}

fn lift_prim<B: StreamTarget, P: PrefetchPolicy>(
    tensor: TensorPrimitive<B>,
) -> TensorPrimitive<Offload<B, P>> {
    match tensor {
        TensorPrimitive::Float(t) => TensorPrimitive::Float(lift(t)),
        TensorPrimitive::QFloat(q) => TensorPrimitive::QFloat(q),
    }
}

fn lift_pool1d<B: StreamTarget, P: PrefetchPolicy>(
    out: MaxPool1dWithIndices<B>,
) -> MaxPool1dWithIndices<Offload<B, P>> {
    MaxPool1dWithIndices {
        output: lift(out.output),
        indices: out.indices,
    }
}

fn lift_pool2d<B: StreamTarget, P: PrefetchPolicy>(
    out: MaxPool2dWithIndices<B>,
) -> MaxPool2dWithIndices<Offload<B, P>> {
    MaxPool2dWithIndices {
        output: lift(out.output),
        indices: out.indices,
    }
}

fn lift_pool1d_backward<B: StreamTarget, P: PrefetchPolicy>(
    out: MaxPool1dBackward<B>,
) -> MaxPool1dBackward<Offload<B, P>> {
    MaxPool1dBackward {
        x_grad: lift(out.x_grad),
    }
}

fn lift_pool2d_backward<B: StreamTarget, P: PrefetchPolicy>(
    out: MaxPool2dBackward<B>,
) -> MaxPool2dBackward<Offload<B, P>> {
    MaxPool2dBackward {
        x_grad: lift(out.x_grad),
    }
}

fn lift_deform_backward<B: StreamTarget, P: PrefetchPolicy>(
    out: DeformConv2dBackward<B>,
) -> DeformConv2dBackward<Offload<B, P>> {
    DeformConv2dBackward {
        x_grad: lift(out.x_grad),
        offset_grad: lift(out.offset_grad),
        weight_grad: lift(out.weight_grad),
        mask_grad: out.mask_grad.map(lift),
        bias_grad: out.bias_grad.map(lift),
    }
}
