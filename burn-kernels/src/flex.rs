//! [`FusedOps`] for `Flex`: the fused elementwise ops on the CPU, the device kernels'
//! arithmetic (`cube/unary.rs`, `cube/norm_rope.rs`) in f32, row by row, stored in the input's
//! dtype, so that the CPU tests run the entry points, the autodiff recording and the backward
//! end to end. Attention and products stay with Flex's own ops.

use burn::backend::Flex;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{TensorData, TensorMetadata};
use cubecl_common::future::block_on;

use crate::fused::{
    FusedOps, GELU_CUBIC as CUBIC, NormRope, SQRT_2_OVER_PI, UnaryOp, no_fused_attention,
};
use crate::options::KernelOptions;

impl FusedOps for Flex {
    no_fused_attention!();

    fn fused_unary(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        _options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        Some(unary(op, x))
    }

    fn fused_unary_backward(
        op: UnaryOp,
        x: &FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        unary_backward(op, x, &grad)
    }

    fn fused_norm_rope(
        operands: &NormRope<Self>,
        _options: &KernelOptions,
    ) -> Option<FloatTensor<Self>> {
        Some(norm_rope(operands))
    }

    fn fused_norm_rope_backward(
        operands: &NormRope<Self>,
        grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        norm_rope_backward(operands, &grad)
    }
}

/// A tensor's values as f32, and its shape.
fn values(t: &FloatTensor<Flex>) -> (Vec<f32>, Vec<usize>) {
    let data = block_on(Flex::float_into_data(t.clone()))
        .expect("Flex reads its tensors")
        .convert::<f32>();
    let shape = data.shape.to_vec();
    (data.to_vec().expect("f32 values"), shape)
}

/// `values` shaped `shape`, in `like`'s dtype.
fn tensor(values: Vec<f32>, shape: Vec<usize>, like: &FloatTensor<Flex>) -> FloatTensor<Flex> {
    let data = TensorData::new(values, shape).convert_dtype(like.dtype());
    Flex::float_from_data(data, &Flex::float_device(like))
}

/// `f` on each row of `dim` values of `x` (and of `grad`, when given), writing the row's output.
fn by_rows(
    x: &FloatTensor<Flex>,
    grad: Option<&FloatTensor<Flex>>,
    f: impl Fn(usize, &[f32], &[f32], &mut [f32]),
) -> FloatTensor<Flex> {
    let (xs, shape) = values(x);
    let gs = grad.map_or_else(Vec::new, |g| values(g).0);
    let dim = shape.last().copied().unwrap_or(1).max(1);
    let mut out = vec![0.0; xs.len()];
    for (row, (x_row, out_row)) in xs.chunks(dim).zip(out.chunks_mut(dim)).enumerate() {
        let g_row = gs.get(row * dim..(row + 1) * dim).unwrap_or(&[]);
        f(row, x_row, g_row, out_row);
    }
    tensor(out, shape, x)
}

/// σ(2z) and σ(−2z) of GELU's `z` at `v`, and `dz/dv`.
fn gelu_parts(v: f32) -> (f32, f32, f32) {
    let z = SQRT_2_OVER_PI * (v + CUBIC * v * v * v);
    let dz = SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * v * v);
    (
        1.0 / (1.0 + (-2.0 * z).exp()),
        1.0 / (1.0 + (2.0 * z).exp()),
        dz,
    )
}

/// A row's mean (zero where not `centered`) and `1 / √(var + eps)`, the variance taken about
/// that mean.
fn row_statistics(x: &[f32], eps: f32, centered: bool) -> (f32, f32) {
    let n = x.len() as f32;
    let mean = if centered {
        x.iter().sum::<f32>() / n
    } else {
        0.0
    };
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    (mean, 1.0 / (var + eps).sqrt())
}

/// Whether the norm `op` subtracts the row's mean (layer norm) or not (RMS norm).
fn centered(op: UnaryOp) -> bool {
    matches!(op, UnaryOp::LayerNorm { .. })
}

/// `op` on `x`.
fn unary(op: UnaryOp, x: &FloatTensor<Flex>) -> FloatTensor<Flex> {
    by_rows(x, None, |_, x, _, out| match op {
        UnaryOp::GeluTanh => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v * gelu_parts(v).0;
            }
        }
        UnaryOp::LayerNorm { eps } | UnaryOp::RmsNorm { eps } => {
            let (mean, inverse) = row_statistics(x, eps, centered(op));
            for (o, &v) in out.iter_mut().zip(x) {
                *o = (v - mean) * inverse;
            }
        }
    })
}

/// The gradient of `x` given `grad`, the gradient of `op` on `x`.
fn unary_backward(
    op: UnaryOp,
    x: &FloatTensor<Flex>,
    grad: &FloatTensor<Flex>,
) -> FloatTensor<Flex> {
    by_rows(x, Some(grad), |_, x, g, out| match op {
        UnaryOp::GeluTanh => {
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(g) {
                let (s, s_complement, dz) = gelu_parts(v);
                *o = g * (s + 2.0 * v * s * s_complement * dz);
            }
        }
        UnaryOp::LayerNorm { eps } | UnaryOp::RmsNorm { eps } => {
            let (mean, inverse) = row_statistics(x, eps, centered(op));
            let n = x.len() as f32;
            let grad_mean = if centered(op) {
                g.iter().sum::<f32>() / n
            } else {
                0.0
            };
            let dot_mean = g
                .iter()
                .zip(x)
                .map(|(g, v)| g * (v - mean) * inverse)
                .sum::<f32>()
                / n;
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(g) {
                *o = inverse * (g - grad_mean - (v - mean) * inverse * dot_mean);
            }
        }
    })
}

/// The scale, the tables, the row length and the tables' lanes of a norm-and-rotation call.
struct Tables {
    scale: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    tokens: usize,
    dim: usize,
    rot: usize,
}

impl Tables {
    fn new(o: &NormRope<Flex>) -> Self {
        let shape = o.x.shape();
        let (tokens, dim) = (shape[shape.num_dims() - 2], shape[shape.num_dims() - 1]);
        let rot = o.cos.shape()[o.cos.shape().num_dims() - 1];
        Self {
            scale: values(&o.scale).0,
            cos: values(&o.cos).0,
            sin: values(&o.sin).0,
            tokens,
            dim,
            rot,
        }
    }

    /// The cosine and sine of lane `c` of `row`'s token: the tables' lane `c mod rot`.
    fn angle(&self, row: usize, c: usize) -> (f32, f32) {
        let at = (row % self.tokens) * self.rot + c % self.rot;
        (self.cos[at], self.sin[at])
    }
}

fn inverse_rms(x: &[f32], eps: f32) -> f32 {
    1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt()
}

/// The RMS norm of each row of `o.x` times the scale, turned by its token's angles.
fn norm_rope(o: &NormRope<Flex>) -> FloatTensor<Flex> {
    let t = Tables::new(o);
    by_rows(&o.x, None, |row, x, _, out| {
        let inverse = inverse_rms(x, o.eps);
        for c in (0..t.dim).step_by(2) {
            let (cos, sin) = t.angle(row, c);
            let n0 = x[c] * inverse * t.scale[c];
            let n1 = x[c + 1] * inverse * t.scale[c + 1];
            out[c] = n0 * cos - n1 * sin;
            out[c + 1] = n1 * cos + n0 * sin;
        }
    })
}

/// The gradient of `o.x` given `grad`, the gradient of [`norm_rope`]'s output.
fn norm_rope_backward(o: &NormRope<Flex>, grad: &FloatTensor<Flex>) -> FloatTensor<Flex> {
    let t = Tables::new(o);
    by_rows(&o.x, Some(grad), |row, x, g, out| {
        let inverse = inverse_rms(x, o.eps);
        let back = |c: usize| {
            let (cos, sin) = t.angle(row, c);
            (
                (g[c] * cos + g[c + 1] * sin) * t.scale[c],
                (g[c + 1] * cos - g[c] * sin) * t.scale[c + 1],
            )
        };
        let dot: f32 = (0..t.dim)
            .step_by(2)
            .map(|c| {
                let (g0, g1) = back(c);
                g0 * x[c] + g1 * x[c + 1]
            })
            .sum();
        let mean = dot * inverse / t.dim as f32;
        for c in (0..t.dim).step_by(2) {
            let (g0, g1) = back(c);
            out[c] = inverse * (g0 - x[c] * inverse * mean);
            out[c + 1] = inverse * (g1 - x[c + 1] * inverse * mean);
        }
    })
}
