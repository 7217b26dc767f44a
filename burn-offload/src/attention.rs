//! Fused attention for models written against any backend: [`attention`] runs the inner
//! backend's fused kernel ([`StreamTarget::fused_attention`]) as one autodiff op when the model
//! runs on `Autodiff<Offload<B>>` or `Offload<B>` with such a kernel, and returns `None`
//! otherwise, so the caller computes attention from separate ops.
//!
//! The fused path is on unless `BURN_LORA_FLASH=0` (or `off`, `false`). Its kernels never hold
//! the score matrix and run 6.3 times as fast forward, 4.6 times forward + backward, as the
//! separate products (cuBLAS) and softmax at FLUX.1 size on the H200 (benches/RESULTS.md, burn-offload/DESIGN.md "Fused
//! attention").

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use crate::backend::{Offload, OffloadTensor};
use crate::dispatch::{ATTENTION_CALLS, FLASH, dispatch_offload};
use crate::target::{FusedAttention, StreamTarget};

/// `softmax(scale · q kᵀ) v` over `[batch, heads, rows, head_dim]` tensors through the fused
/// kernel of the backend under [`Offload`], or `None` when `B` is not `Autodiff<Offload<T>>` or
/// `Offload<T>` (default policy and checkpointing) for a `T` listed in `dispatch_offload!`, the
/// kernel does not take these tensors, or the path is not switched on; the caller then computes
/// attention from separate ops.
pub fn attention<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    scale: f64,
) -> Option<Tensor<B, 4>> {
    if FLASH.on() {
        fused(q, k, v, scale)
    } else {
        None
    }
}

/// [`attention`] whatever the switch says, counted in
/// [`fused_attention_calls`](crate::fused_attention_calls).
fn fused<B: Backend>(
    q: &Tensor<B, 4>,
    k: &Tensor<B, 4>,
    v: &Tensor<B, 4>,
    scale: f64,
) -> Option<Tensor<B, 4>> {
    ATTENTION_CALLS.count(dispatch_offload!(
        B,
        [q, k, v],
        |qkv| tracked(qkv, scale),
        |qkv| untracked(qkv, scale)
    ))
}

/// The fused forward on `Offload<T>`, without gradients.
fn untracked<T: StreamTarget>(
    qkv: [Tensor<Offload<T>, 4>; 3],
    scale: f64,
) -> Option<Tensor<Offload<T>, 4>> {
    let [q, k, v] = qkv.map(|t| t.into_primitive().tensor());
    let forward = T::fused_attention(q.as_inner()?, k.as_inner()?, v.as_inner()?, scale as f32)?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(
        OffloadTensor::from_inner(forward.output),
    )))
}

/// The fused forward on `Autodiff<Offload<T>>`, recorded as one op whose backward runs the
/// fused backward kernel.
fn tracked<T: StreamTarget>(
    qkv: [Tensor<Autodiff<Offload<T>>, 4>; 3],
    scale: f64,
) -> Option<Tensor<Autodiff<Offload<T>>, 4>> {
    let [q, k, v] = qkv.map(|t| t.into_primitive().tensor());
    let (qi, ki, vi) = (
        q.primitive.as_inner()?,
        k.primitive.as_inner()?,
        v.primitive.as_inner()?,
    );
    let forward = T::fused_attention(qi, ki, vi, scale as f32)?;
    let output = OffloadTensor::from_inner(forward.output.clone());
    let nodes = [q.node.clone(), k.node.clone(), v.node.clone()];
    let prepared = <FusedBackward as Backward<Offload<T>, 3>>::prepare::<NoCheckpointing>;
    let out = match prepared(FusedBackward, nodes).compute_bound().stateful() {
        OpsKind::Tracked(prep) => {
            let qkv = [qi.clone(), ki.clone(), vi.clone()];
            prep.finish(
                FusedState {
                    qkv,
                    forward,
                    scale: scale as f32,
                },
                output,
            )
        }
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Some(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

/// What the backward pass of one fused attention keeps from its forward pass.
#[derive(Debug, Clone)]
struct FusedState<T: StreamTarget> {
    qkv: [FloatTensor<T>; 3],
    forward: FusedAttention<T>,
    scale: f32,
}

#[derive(Debug)]
struct FusedBackward;

impl<T: StreamTarget, P: crate::PrefetchPolicy> Backward<Offload<T, P>, 3> for FusedBackward {
    type State = FusedState<T>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<Offload<T, P>>(&ops.node).into_inner();
        let FusedState {
            qkv,
            forward,
            scale,
        } = ops.state;
        let [q, k, v] = &qkv;
        let gradients = T::fused_attention_backward([q, k, v], &forward, grad, scale);
        for (parent, gradient) in ops.parents.into_iter().zip(gradients) {
            if let Some(node) = parent {
                grads.register::<Offload<T, P>>(node.id, OffloadTensor::from_inner(gradient));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_attention_calls;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    /// A backend whose kernel declines, or that is not an offload backend, gets no fused
    /// result and no fused call is counted, tracked or not.
    #[test]
    fn declined_attention_falls_back() {
        fn check<B: Backend>() {
            let device = Default::default();
            let shape = [1, 2, 5, 8];
            let [q, k, v] = [0.0, 1.0, 2.0].map(|mean| {
                Tensor::<B, 4>::random(shape, Distribution::Normal(mean, 1.0), &device)
            });
            let calls = fused_attention_calls();
            assert!(
                fused(&q, &k, &v, 0.5).is_none(),
                "no fused kernel on this backend"
            );
            assert_eq!(fused_attention_calls(), calls);
        }
        check::<Flex>();
        check::<Offload<Flex>>();
        check::<Autodiff<Offload<Flex>>>();
    }
}
