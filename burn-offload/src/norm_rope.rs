//! The queries' and keys' RMS norm and rotary embedding as one fused op for models written
//! against any backend: [`rms_norm_rope`] runs the inner backend's kernel
//! ([`StreamTarget::fused_norm_rope`]) as one autodiff op on `Autodiff<Offload<B>>` or
//! `Offload<B>` when the backend has one, and returns `None` otherwise, so that the caller
//! computes the norm and the rotation from separate ops.
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

/// The operands of one fused RMS norm and rotary embedding, in the inner backend's tensors.
#[derive(Debug, Clone)]
pub struct NormRope<B: Backend> {
    /// `[..., tokens, dim]`, one head of one token per row.
    pub x: FloatTensor<B>,
    /// The norm's learned scale, `dim` values.
    pub scale: FloatTensor<B>,
    /// Cosines of the angles, `[tokens, dim]` (each pair's value repeated for both lanes).
    pub cos: FloatTensor<B>,
    /// Sines of the angles, as `cos`.
    pub sin: FloatTensor<B>,
    /// Added to the mean square.
    pub eps: f32,
}

/// `x / √(mean(x²) + eps) · scale` over the last dimension, then each pair of lanes
/// `(n₀, n₁)` turned to `(n₀ cos − n₁ sin, n₁ cos + n₀ sin)` by its token's angles, computed in
/// f32 in one kernel (one more for the gradient of `x`) and returned in `x`'s dtype; `None`
/// when `B` has no such kernel (see the module), the path is not switched on, or the scale or
/// the tables need gradients (the fused op gives only `x` one).
///
/// # Shapes
/// - `x`: `[batch, heads, tokens, dim]`; `scale`: `[dim]`; `cos`, `sin`: `[tokens, dim]`
pub fn rms_norm_rope<B: Backend>(
    x: &Tensor<B, 4>,
    scale: &Tensor<B, 1>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    eps: f64,
) -> Option<Tensor<B, 4>> {
    if FUSED.on() {
        ELEMENTWISE_CALLS.count(fused(x, scale, cos, sin, eps))
    } else {
        None
    }
}

/// [`rms_norm_rope`] whatever the switch says.
fn fused<B: Backend>(
    x: &Tensor<B, 4>,
    scale: &Tensor<B, 1>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    eps: f64,
) -> Option<Tensor<B, 4>> {
    // One rank for the dispatch; the kernels read the buffers whatever the shape says.
    let scale = scale.clone().unsqueeze::<4>();
    let [cos, sin] = [cos, sin].map(|t| t.clone().unsqueeze::<4>());
    let eps = eps as f32;
    dispatch_offload!(
        B,
        [x, &scale, &cos, &sin],
        |operands| tracked(operands, eps),
        |operands| untracked(operands, eps)
    )
}

fn untracked<T: StreamTarget>(
    operands: [Tensor<Offload<T>, 4>; 4],
    eps: f32,
) -> Option<Tensor<Offload<T>, 4>> {
    let [x, scale, cos, sin] = operands.map(|t| t.into_primitive().tensor().into_inner());
    let y = T::fused_norm_rope(&NormRope {
        x,
        scale,
        cos,
        sin,
        eps,
    })?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(
        OffloadTensor::from_inner(y),
    )))
}

/// The fused forward on `Autodiff<Offload<T>>`, recorded as one op whose backward gives `x` its
/// gradient; declined when the scale or the tables need gradients.
fn tracked<T: StreamTarget>(
    operands: [Tensor<Autodiff<Offload<T>>, 4>; 4],
    eps: f32,
) -> Option<Tensor<Autodiff<Offload<T>>, 4>> {
    let [x, scale, cos, sin] = operands.map(|t| t.into_primitive().tensor());
    if [&scale, &cos, &sin]
        .iter()
        .any(|t| !t.node.requirement.is_none())
    {
        return None;
    }
    let [xi, scale, cos, sin] = [&x, &scale, &cos, &sin].map(|t| t.primitive.clone().into_inner());
    let operands = NormRope {
        x: xi,
        scale,
        cos,
        sin,
        eps,
    };
    let y = OffloadTensor::from_inner(T::fused_norm_rope(&operands)?);
    let prepared = <NormRopeBackward as Backward<Offload<T>, 1>>::prepare::<NoCheckpointing>;
    let out = match prepared(NormRopeBackward, [x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(operands, y),
        OpsKind::UnTracked(prep) => prep.finish(y),
    };
    Some(Tensor::from_primitive(TensorPrimitive::Float(out)))
}

#[derive(Debug)]
struct NormRopeBackward;

impl<T: StreamTarget, P: crate::PrefetchPolicy> Backward<Offload<T, P>, 1> for NormRopeBackward {
    type State = NormRope<T>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        one_input_backward::<T, P, _>(ops, grads, T::fused_norm_rope_backward);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Distribution;

    /// The decorated backends run the op (on Flex, its CPU kernel), tracked or not, unless the
    /// scale needs a gradient; a backend that is not decorated gets no fused result.
    /// (burn-diffusion's tests compare the results and gradients with the separate ops.)
    #[test]
    fn only_decorated_backends_run_the_fused_op() {
        fn check<B: Backend>(expected: bool, scale_grad: bool) {
            let device = Default::default();
            let x = Tensor::<B, 4>::random([1, 2, 3, 4], Distribution::Default, &device);
            let scale = Tensor::<B, 1>::ones([4], &device).set_require_grad(scale_grad);
            let table = Tensor::<B, 2>::ones([3, 4], &device);
            let fused = fused(&x, &scale, &table, &table, 1e-6);
            assert_eq!(fused.is_some(), expected);
        }
        check::<Flex>(false, false);
        check::<Autodiff<Flex>>(false, false);
        check::<Offload<Flex>>(true, false);
        check::<Autodiff<Offload<Flex>>>(true, false);
        check::<Autodiff<Offload<Flex>>>(false, true);
    }
}
