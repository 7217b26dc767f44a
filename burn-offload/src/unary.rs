//! Fused ops of one tensor for models written against any backend: [`gelu_tanh`] and
//! [`layer_norm`] run the inner backend's kernel ([`StreamTarget::fused_unary`]) as one autodiff
//! op on `Autodiff<Offload<B>>` or `Offload<B>` when the backend has one, and return `None`
//! otherwise, so that the caller computes the same from separate ops.
//!
//! On unless `BURN_LORA_FUSED=0` (or `off`, `false`).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::{Offload, OffloadTensor};
use crate::dispatch::{ELEMENTWISE_CALLS, FUSED, dispatch_offload, one_input_backward};
use crate::target::StreamTarget;

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
}

/// GELU with the tanh approximation, computed in f32 in one kernel (one more for its gradient)
/// and returned in `x`'s dtype; `None` when `B` is not `Autodiff<Offload<T>>` or `Offload<T>`
/// for a `T` with the kernel, or the path is not switched on.
pub fn gelu_tanh<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    unary(UnaryOp::GeluTanh, x)
}

/// Layer norm over the last dimension without learned parameters, computed in f32 in one kernel
/// (one more for its gradient) and returned in `x`'s dtype; `None` as for [`gelu_tanh`].
pub fn layer_norm<B: Backend, const D: usize>(x: &Tensor<B, D>, eps: f64) -> Option<Tensor<B, D>> {
    unary(UnaryOp::LayerNorm { eps: eps as f32 }, x)
}

/// `op` on `x` through the fused kernel, when switched on.
fn unary<B: Backend, const D: usize>(op: UnaryOp, x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    if FUSED.on() {
        ELEMENTWISE_CALLS.count(fused(op, x))
    } else {
        None
    }
}

/// [`unary`] whatever the switch says.
fn fused<B: Backend, const D: usize>(op: UnaryOp, x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    dispatch_offload!(B, [x], |[x]| tracked(op, x), |[x]| untracked(op, x))
}

fn untracked<T: StreamTarget, const D: usize>(
    op: UnaryOp,
    x: Tensor<Offload<T>, D>,
) -> Option<Tensor<Offload<T>, D>> {
    let x = x.into_primitive().tensor();
    let y = T::fused_unary(op, x.as_inner()?)?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(
        OffloadTensor::from_inner(y),
    )))
}

/// The fused forward on `Autodiff<Offload<T>>`, recorded as one op whose backward runs the
/// gradient kernel on the saved input.
fn tracked<T: StreamTarget, const D: usize>(
    op: UnaryOp,
    x: Tensor<Autodiff<Offload<T>>, D>,
) -> Option<Tensor<Autodiff<Offload<T>>, D>> {
    let x = x.into_primitive().tensor();
    let inner = x.primitive.as_inner()?;
    let y = OffloadTensor::from_inner(T::fused_unary(op, inner)?);
    let prepared = <UnaryBackward as Backward<Offload<T>, 1>>::prepare::<NoCheckpointing>;
    let out = match prepared(UnaryBackward(op), [x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(inner.clone(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    Some(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

#[derive(Debug)]
struct UnaryBackward(UnaryOp);

impl<T: StreamTarget, P: crate::PrefetchPolicy> Backward<Offload<T, P>, 1> for UnaryBackward {
    /// The input.
    type State = FloatTensor<T>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        one_input_backward::<T, P, _>(ops, grads, |x, grad| {
            T::fused_unary_backward(self.0, x, grad)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    /// The decorated backends run the ops (on Flex, its CPU kernels), tracked or not; a backend
    /// that is not decorated gets no fused result. (burn-diffusion's tests compare the results
    /// and gradients with the separate ops.)
    #[test]
    fn only_decorated_backends_run_the_fused_ops() {
        fn check<B: Backend>(expected: bool) {
            let x = Tensor::<B, 3>::random([2, 3, 4], Distribution::Default, &Default::default());
            for op in [UnaryOp::GeluTanh, UnaryOp::LayerNorm { eps: 1e-6 }] {
                assert_eq!(fused(op, &x).is_some(), expected, "{op:?}");
            }
        }
        check::<Flex>(false);
        check::<Autodiff<Flex>>(false);
        check::<Offload<Flex>>(true);
        check::<Autodiff<Offload<Flex>>>(true);
    }
}
