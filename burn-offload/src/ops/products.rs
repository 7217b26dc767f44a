//! The matrix products, on the inner backend: through its vendor BLAS
//! ([`StreamTarget::blas_matmul`]) where it has one and takes the layouts, else through its own
//! op of the same name, so a backend without BLAS runs exactly what it ran before.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, TensorMetadata};

use crate::target::StreamTarget;

/// `lhs · rhs`, as `float_matmul`.
pub(super) fn matmul<B: StreamTarget>(lhs: FloatTensor<B>, rhs: FloatTensor<B>) -> FloatTensor<B> {
    B::blas_matmul(&lhs, &rhs).unwrap_or_else(|| B::float_matmul(lhs, rhs))
}

/// `x · weight + bias` (weight `[d_input, d_output]`), as `linear`.
pub(super) fn linear<B: StreamTarget>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> FloatTensor<B> {
    let Some(out) = B::blas_matmul(&x, &weight) else {
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

/// `output_grad · weightᵀ`, as `linear_x_backward`.
pub(super) fn linear_x_backward<B: StreamTarget>(
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    if B::blas_enabled() {
        let weight_t = B::float_swap_dims(weight.clone(), 0, 1);
        if let Some(grad) = B::blas_matmul(&output_grad, &weight_t) {
            return grad;
        }
    }
    B::linear_x_backward(weight, output_grad)
}

/// `xᵀ · output_grad` summed over the batch dimensions, as `linear_weight_backward`: one
/// product over all rows at once.
pub(super) fn linear_weight_backward<B: StreamTarget>(
    x: FloatTensor<B>,
    output_grad: FloatTensor<B>,
) -> FloatTensor<B> {
    if B::blas_enabled() {
        let rows = |t: &FloatTensor<B>| {
            let shape = t.shape();
            let cols = shape[shape.num_dims() - 1];
            Shape::new([shape.num_elements() / cols.max(1), cols])
        };
        let x_t = B::float_swap_dims(B::float_reshape(x.clone(), rows(&x)), 0, 1);
        let grad = B::float_reshape(output_grad.clone(), rows(&output_grad));
        if let Some(weight_grad) = B::blas_matmul(&x_t, &grad) {
            return weight_grad;
        }
    }
    B::linear_weight_backward(x, output_grad)
}
