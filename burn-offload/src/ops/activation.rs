//! `ActivationOps`: forwarded to the inner backend.

use burn::tensor::Scalar;
use burn::tensor::ops::{ActivationOps, FloatTensor};

use super::{forward, keep, lift, lower};
use crate::backend::{Offload, PrefetchPolicy};
use crate::target::StreamTarget;

impl<B: StreamTarget, P: PrefetchPolicy> ActivationOps<Self> for Offload<B, P> {
    forward! {
        lift fn leaky_relu(
            lower tensor: FloatTensor<Self>,
            keep negative_slope: Scalar,
        ) -> FloatTensor<Self>;
        lift fn relu(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn relu_backward(
            lower output: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn gelu(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn prelu(
            lower tensor: FloatTensor<Self>,
            lower alpha: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn gelu_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn sigmoid(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn sigmoid_backward(
            lower output: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn hard_sigmoid(
            lower tensor: FloatTensor<Self>,
            keep alpha: Scalar,
            keep beta: Scalar,
        ) -> FloatTensor<Self>;
        lift fn log_sigmoid(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn softmax(lower tensor: FloatTensor<Self>, keep dim: usize) -> FloatTensor<Self>;
        lift fn log_softmax(lower tensor: FloatTensor<Self>, keep dim: usize) -> FloatTensor<Self>;
        lift fn softmin(lower tensor: FloatTensor<Self>, keep dim: usize) -> FloatTensor<Self>;
        lift fn log_sigmoid_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
    }
}
