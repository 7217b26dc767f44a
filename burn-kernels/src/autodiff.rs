//! [`Kernels`] for `Autodiff<B, C>` over any [`FusedOps`] backend and any checkpoint strategy:
//! each fused forward of `B` is recorded as one autodiff op whose backward runs `B`'s fused
//! backward.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::ops::FloatTensor;

use crate::counters::count_lora;
use crate::fused::{FusedOps, LoraProducts, NormRope, UnaryOp};
use crate::kernels::Kernels;
use crate::options::KernelOptions;
use crate::products;

impl<B: FusedOps, C: CheckpointStrategy> Kernels for Autodiff<B, C> {
    fn attention(
        q: &FloatTensor<Self>,
        k: &FloatTensor<Self>,
        v: &FloatTensor<Self>,
        scale: f32,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let qkv = [&q.primitive, &k.primitive, &v.primitive];
        let (output, saved) = B::fused_attention(qkv[0], qkv[1], qkv[2], scale, options)?;
        let nodes = [q.node.clone(), k.node.clone(), v.node.clone()];
        let prepared = <AttentionBackward as Backward<B, 3>>::prepare::<C>;
        Some(
            match prepared(AttentionBackward, nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(
                    AttentionState {
                        qkv: qkv.map(Clone::clone),
                        saved,
                        scale,
                    },
                    output,
                ),
                OpsKind::UnTracked(prep) => prep.finish(output),
            },
        )
    }

    fn unary(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let y = B::fused_unary(op, &x.primitive, options)?;
        let prepared = <UnaryBackward as Backward<B, 1>>::prepare::<C>;
        Some(
            match prepared(UnaryBackward(op), [x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(x.primitive.clone(), y),
                OpsKind::UnTracked(prep) => prep.finish(y),
            },
        )
    }

    /// The product as one op whose backward sends both gradient products to the BLAS too
    /// (through [`products`], which falls back to `B`'s own ops where the BLAS declines).
    fn blas_linear(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let out = B::blas_matmul(&x.primitive, &weight.primitive, options)?;
        let prepared = <LinearBackward as Backward<B, 2>>::prepare::<C>;
        Some(
            match prepared(LinearBackward, [x.node.clone(), weight.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    prep.finish(LinearState::of::<C>(x, weight, options), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }

    /// The product accumulated into `addend` as one op: the output's gradient is `addend`'s,
    /// and, scaled by `alpha`, goes through both gradient products as in
    /// [`blas_linear`](Kernels::blas_linear).
    fn blas_linear_add(
        x: &FloatTensor<Self>,
        weight: &FloatTensor<Self>,
        addend: FloatTensor<Self>,
        alpha: f32,
        options: &KernelOptions,
    ) -> Result<FloatTensor<Self>, FloatTensor<Self>> {
        let mut addend = addend;
        let out = match B::blas_matmul_add(
            &x.primitive,
            &weight.primitive,
            addend.primitive,
            alpha,
            options,
        ) {
            Ok(out) => out,
            Err(primitive) => {
                addend.primitive = primitive;
                return Err(addend);
            }
        };
        let node = addend.node;
        let prepared = <LinearAddBackward as Backward<B, 3>>::prepare::<C>;
        Ok(
            match prepared(
                LinearAddBackward,
                [x.node.clone(), weight.node.clone(), node],
            )
            .compute_bound()
            .stateful()
            {
                OpsKind::Tracked(prep) => {
                    prep.finish((LinearState::of::<C>(x, weight, options), alpha), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(out),
            },
        )
    }

    /// One op, the identity, whose backward hands the gradient to `B`'s sink and gives the
    /// parameter none in the graph.
    fn trainable(param: FloatTensor<Self>) -> FloatTensor<Self> {
        if param.node.requirement.is_none() || !B::takes_gradient(&param.primitive) {
            return param;
        }
        let prepared = <SinkBackward as Backward<B, 1>>::prepare::<C>;
        match prepared(SinkBackward, [param.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(param.primitive.clone(), param.primitive),
            OpsKind::UnTracked(prep) => prep.finish(param.primitive),
        }
    }

    /// Declined when the base weight needs a gradient: the fused backward gives it none.
    fn blas_lora(
        products: LoraProducts<Self>,
        options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        let LoraProducts {
            x,
            weight,
            down,
            up,
            alpha,
        } = products;
        if !weight.node.requirement.is_none() {
            return None;
        }
        let inner = LoraProducts {
            x: x.primitive,
            weight: weight.primitive,
            down: down.primitive,
            up: up.primitive,
            alpha,
        };
        let (y, h) = B::blas_lora(&inner, options)?;
        let prepared = <LoraBackward as Backward<B, 3>>::prepare::<C>;
        Some(
            match prepared(LoraBackward, [x.node, down.node, up.node])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(
                    LoraState {
                        products: inner,
                        h,
                        options: *options,
                    },
                    y,
                ),
                OpsKind::UnTracked(prep) => prep.finish(y),
            },
        )
    }

    /// Declined when the scale or the tables need gradients: the fused op gives only `x` one.
    fn norm_rope(operands: NormRope<Self>, options: &KernelOptions) -> Option<FloatTensor<Self>> {
        let NormRope {
            x,
            scale,
            cos,
            sin,
            eps,
        } = operands;
        if [&scale, &cos, &sin]
            .iter()
            .any(|t| !t.node.requirement.is_none())
        {
            return None;
        }
        let inner = NormRope {
            x: x.primitive.clone(),
            scale: scale.primitive,
            cos: cos.primitive,
            sin: sin.primitive,
            eps,
        };
        let y = B::fused_norm_rope(&inner, options)?;
        let prepared = <NormRopeBackward as Backward<B, 1>>::prepare::<C>;
        Some(
            match prepared(NormRopeBackward, [x.node.clone()])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(inner, y),
                OpsKind::UnTracked(prep) => prep.finish(y),
            },
        )
    }
}

/// What the backward pass of one BLAS product `x · weight` keeps.
#[derive(Debug, Clone)]
struct LinearState<B: FusedOps> {
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    options: KernelOptions,
}

impl<B: FusedOps> LinearState<B> {
    /// The operands of `x · weight` under autodiff, kept for the backward pass.
    fn of<C: CheckpointStrategy>(
        x: &FloatTensor<Autodiff<B, C>>,
        weight: &FloatTensor<Autodiff<B, C>>,
        options: &KernelOptions,
    ) -> Self {
        Self {
            x: x.primitive.clone(),
            weight: weight.primitive.clone(),
            options: *options,
        }
    }
}

#[derive(Debug)]
struct LinearBackward;

impl<B: FusedOps> Backward<B, 2> for LinearBackward {
    type State = LinearState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let ids = ops.parents.map(|parent| parent.map(|node| node.id));
        linear_backward::<B>(ops.state, ids, grad, grads);
    }
}

/// The gradients of `x` and `weight` in `x · weight` given the product's gradient `grad`.
fn linear_backward<B: FusedOps>(
    state: LinearState<B>,
    [x_node, weight_node]: [Option<NodeId>; 2],
    grad: FloatTensor<B>,
    grads: &mut Gradients,
) {
    let LinearState { x, weight, options } = state;
    if let Some(id) = weight_node {
        let dw = products::linear_weight_backward::<B>(x, grad.clone(), &options);
        grads.register::<B>(id, dw);
    }
    if let Some(id) = x_node {
        let dx = products::linear_x_backward::<B>(weight, grad, &options);
        grads.register::<B>(id, dx);
    }
}

#[derive(Debug)]
struct LinearAddBackward;

impl<B: FusedOps> Backward<B, 3> for LinearAddBackward {
    /// The product's operands and `alpha`.
    type State = (LinearState<B>, f32);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let (state, alpha) = ops.state;
        let [x_id, weight_id, addend_id] = ops.parents.map(|parent| parent.map(|node| node.id));
        if let Some(id) = addend_id {
            grads.register::<B>(id, grad.clone());
        }
        let grad = if alpha == 1.0 {
            grad
        } else {
            B::float_mul_scalar(grad, alpha.into())
        };
        linear_backward::<B>(state, [x_id, weight_id], grad, grads);
    }
}

/// What the backward pass of one LoRA layer's fused products keeps.
#[derive(Debug, Clone)]
struct LoraState<B: FusedOps> {
    products: LoraProducts<B>,
    /// `x · down`.
    h: FloatTensor<B>,
    options: KernelOptions,
}

#[derive(Debug)]
struct LoraBackward;

impl<B: FusedOps> Backward<B, 3> for LoraBackward {
    type State = LoraState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let LoraState {
            products,
            h,
            options,
        } = ops.state;
        let gradients = match B::blas_lora_backward(&products, &h, &grad, &options) {
            Some(gradients) => {
                count_lora(5);
                gradients
            }
            None => products::lora_backward::<B>(&products, h, grad, &options),
        };
        let ids = ops.parents.map(|parent| parent.map(|node| node.id));
        register_each::<B, 3>(ids, gradients, grads);
    }
}

/// Registers each gradient for its parent's node, where the parent needs one.
fn register_each<B: FusedOps, const N: usize>(
    ids: [Option<NodeId>; N],
    gradients: [FloatTensor<B>; N],
    grads: &mut Gradients,
) {
    for (id, gradient) in ids.into_iter().zip(gradients) {
        if let Some(id) = id {
            grads.register::<B>(id, gradient);
        }
    }
}

#[derive(Debug)]
struct SinkBackward;

impl<B: FusedOps> Backward<B, 1> for SinkBackward {
    /// The parameter, which tells the backend where its gradient goes.
    type State = FloatTensor<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        B::sink_gradient(&ops.state, grad);
    }
}

/// What the backward pass of one fused attention keeps from its forward pass.
#[derive(Debug, Clone)]
struct AttentionState<B: FusedOps> {
    qkv: [FloatTensor<B>; 3],
    saved: B::Attention,
    scale: f32,
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: FusedOps> Backward<B, 3> for AttentionBackward {
    type State = AttentionState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let AttentionState { qkv, saved, scale } = ops.state;
        let [q, k, v] = &qkv;
        let gradients = B::fused_attention_backward([q, k, v], &saved, grad, scale);
        let ids = ops.parents.map(|parent| parent.map(|node| node.id));
        register_each::<B, 3>(ids, gradients, grads);
    }
}

/// The backward step of a fused op with one input: the output's gradient turned by `gradient`
/// (given the op's saved state) into the input's, registered when the input needs one.
fn one_input_backward<B: FusedOps, S>(
    ops: Ops<S, 1>,
    grads: &mut Gradients,
    gradient: impl FnOnce(&S, FloatTensor<B>) -> FloatTensor<B>,
) {
    let grad = grads.consume::<B>(&ops.node);
    let [parent] = ops.parents;
    if let Some(node) = parent {
        grads.register::<B>(node.id, gradient(&ops.state, grad));
    }
}

#[derive(Debug)]
struct UnaryBackward(UnaryOp);

impl<B: FusedOps> Backward<B, 1> for UnaryBackward {
    /// The input.
    type State = FloatTensor<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        one_input_backward::<B, _>(ops, grads, |x, grad| {
            B::fused_unary_backward(self.0, x, grad)
        });
    }
}

#[derive(Debug)]
struct NormRopeBackward;

impl<B: FusedOps> Backward<B, 1> for NormRopeBackward {
    type State = NormRope<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        one_input_backward::<B, _>(ops, grads, B::fused_norm_rope_backward);
    }
}
