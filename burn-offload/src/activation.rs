//! Fused activations for models written against any backend: [`gelu_tanh`] runs the inner
//! backend's GELU kernel ([`StreamTarget::fused_gelu_tanh`]) as one autodiff op on
//! `Autodiff<Offload<B>>` or `Offload<B>` when the backend has one, and returns `None`
//! otherwise, so that the caller computes it from separate ops.
//!
//! Opt-in: `BURN_LORA_FUSED=1` (or `on`, `true`), until the GPU measurements show it faster.

use std::sync::OnceLock;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::{Offload, OffloadTensor};
use crate::dispatch::{dispatch_offload, switched_on};
use crate::target::StreamTarget;

/// GELU with the tanh approximation, `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`, computed
/// in f32 in one kernel (one more for its gradient) and returned in `x`'s dtype; `None` when `B`
/// is not `Autodiff<Offload<T>>` or `Offload<T>` for a `T` with the kernel, or the path is not
/// switched on.
pub fn gelu_tanh<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    static ON: OnceLock<bool> = OnceLock::new();
    if switched_on("BURN_LORA_FUSED", &ON, "GELU") {
        fused(x)
    } else {
        None
    }
}

/// [`gelu_tanh`] whatever the switch says.
fn fused<B: Backend, const D: usize>(x: &Tensor<B, D>) -> Option<Tensor<B, D>> {
    dispatch_offload!(B, [x], |[x]| tracked(x), |[x]| untracked(x));
    None
}

fn untracked<T: StreamTarget, const D: usize>(
    x: Tensor<Offload<T>, D>,
) -> Option<Tensor<Offload<T>, D>> {
    let x = x.into_primitive().tensor();
    let y = T::fused_gelu_tanh(x.as_inner()?)?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(
        OffloadTensor::from_inner(y),
    )))
}

/// The fused forward on `Autodiff<Offload<T>>`, recorded as one op whose backward runs the
/// gradient kernel on the saved input.
fn tracked<T: StreamTarget, const D: usize>(
    x: Tensor<Autodiff<Offload<T>>, D>,
) -> Option<Tensor<Autodiff<Offload<T>>, D>> {
    let x = x.into_primitive().tensor();
    let inner = x.primitive.as_inner()?;
    let y = OffloadTensor::from_inner(T::fused_gelu_tanh(inner)?);
    let prepared = <GeluBackward as Backward<Offload<T>, 1>>::prepare::<NoCheckpointing>;
    let out = match prepared(GeluBackward, [x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(inner.clone(), y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    Some(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

#[derive(Debug)]
struct GeluBackward;

impl<T: StreamTarget, P: crate::PrefetchPolicy> Backward<Offload<T, P>, 1> for GeluBackward {
    /// The input.
    type State = FloatTensor<T>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<Offload<T, P>>(&ops.node).into_inner();
        let [parent] = ops.parents;
        if let Some(node) = parent {
            let gradient = T::fused_gelu_tanh_backward(&ops.state, grad);
            grads.register::<Offload<T, P>>(node.id, OffloadTensor::from_inner(gradient));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    /// A backend without the kernel, or that is not an offload backend, gets no fused result,
    /// tracked or not.
    #[test]
    fn declined_gelu_falls_back() {
        fn check<B: Backend>() {
            let x = Tensor::<B, 3>::random([2, 3, 4], Distribution::Default, &Default::default());
            assert!(fused(&x).is_none(), "no fused kernel on this backend");
        }
        check::<Flex>();
        check::<Offload<Flex>>();
        check::<Autodiff<Offload<Flex>>>();
    }
}
