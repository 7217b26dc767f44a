//! The queries' and keys' RMS norm and rotary embedding as one CubeCL kernel each way, for any
//! CubeCL runtime: for each row `x` of `head_dim` values (one head of one token),
//! `n = x / √(mean(x²) + eps) · scale`, then each pair `(n₀, n₁)` turned to
//! `(n₀ cos − n₁ sin, n₁ cos + n₀ sin)` by the token's angles; in f32, stored once in the
//! input's dtype. As separate ops that is about fourteen passes forward. The mechanism behind
//! [`rms_norm_rope`](crate::rms_norm_rope); tested on wgpu (f32), run on CUDA (bf16).
//!
//! One thread per row: a row is 64 or 128 values, so a block's rows stay in its cache between
//! the two passes over them.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::cube_tensor::{array, contiguous_as, empty_like, one_unit_each};

/// `1 / √(mean(x²) + eps)` of the row of `dim` values at `base`.
#[cube]
fn inverse_rms<F: Float>(x: &Array<F>, base: usize, dim: usize, eps: f32) -> f32 {
    let mut squares = 0.0f32;
    for c in 0..dim {
        let v = f32::cast_from(x[base + c]);
        squares += v * v;
    }
    1.0f32 / f32::sqrt(squares / f32::cast_from(dim) + eps)
}

/// The gradient of lanes `c` and `c + 1` turned back by their angle (the rotation's
/// transpose), times the scale: the gradient of the scaled normalized pair.
#[cube]
fn turned_back<F: Float>(
    grad: &Array<F>,
    scale: &Array<F>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    base: usize,
    angles: usize,
    c: usize,
) -> (f32, f32) {
    let (co, si) = (cos[angles + c], sin[angles + c]);
    let g0 = f32::cast_from(grad[base + c]);
    let g1 = f32::cast_from(grad[base + c + 1]);
    (
        (g0 * co + g1 * si) * f32::cast_from(scale[c]),
        (g1 * co - g0 * si) * f32::cast_from(scale[c + 1]),
    )
}

#[cube(launch)]
fn norm_rope_kernel<F: Float>(
    x: &Array<F>,
    scale: &Array<F>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    out: &mut Array<F>,
    rows: usize,
    dim: usize,
    tokens: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let base = row * dim;
    let angles = (row % tokens) * dim;
    let inverse = inverse_rms(x, base, dim, eps);
    for c in range_stepped(0, dim, 2) {
        let n0 = f32::cast_from(x[base + c]) * inverse * f32::cast_from(scale[c]);
        let n1 = f32::cast_from(x[base + c + 1]) * inverse * f32::cast_from(scale[c + 1]);
        let (co, si) = (cos[angles + c], sin[angles + c]);
        out[base + c] = F::cast_from(n0 * co - n1 * si);
        out[base + c + 1] = F::cast_from(n1 * co + n0 * si);
    }
}

/// `dx = inverse · (g − x · inverse · mean(g ∘ x · inverse))`, where `g` is the output's
/// gradient turned back by the token's angles and multiplied by the scale.
#[cube(launch)]
fn norm_rope_backward_kernel<F: Float>(
    x: &Array<F>,
    scale: &Array<F>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    grad: &Array<F>,
    dx: &mut Array<F>,
    rows: usize,
    dim: usize,
    tokens: usize,
    eps: f32,
    #[define(F)] _dtype: StorageType,
) {
    let row = ABSOLUTE_POS;
    if row >= rows {
        terminate!();
    }
    let base = row * dim;
    let angles = (row % tokens) * dim;
    let inverse = inverse_rms(x, base, dim, eps);
    let mut dot = 0.0f32;
    for c in range_stepped(0, dim, 2) {
        let (gn0, gn1) = turned_back(grad, scale, cos, sin, base, angles, c);
        dot += gn0 * f32::cast_from(x[base + c]) + gn1 * f32::cast_from(x[base + c + 1]);
    }
    let mean = dot * inverse / f32::cast_from(dim);
    for c in range_stepped(0, dim, 2) {
        let (gn0, gn1) = turned_back(grad, scale, cos, sin, base, angles, c);
        let n0 = f32::cast_from(x[base + c]) * inverse;
        let n1 = f32::cast_from(x[base + c + 1]) * inverse;
        dx[base + c] = F::cast_from(inverse * (gn0 - n0 * mean));
        dx[base + c + 1] = F::cast_from(inverse * (gn1 - n1 * mean));
    }
}

/// The operands of one call, contiguous, the scale in `x`'s dtype and the tables in f32.
struct Operands<R: CubeRuntime> {
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    rows: usize,
    dim: usize,
    tokens: usize,
}

impl<R: CubeRuntime> Operands<R> {
    /// `x` `[..., tokens, dim]`, `scale` with `dim` values, `cos` and `sin` with `tokens · dim`
    /// (every pair's value repeated for both its lanes).
    fn new(x: CubeTensor<R>, scale: CubeTensor<R>, cos: CubeTensor<R>, sin: CubeTensor<R>) -> Self {
        let shape = x.meta.shape().to_vec();
        let (tokens, dim) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        assert!(
            dim % 2 == 0,
            "rotary pairs need an even head size, got {dim}"
        );
        assert_eq!(scale.meta.shape().num_elements(), dim, "norm scale size");
        for table in [&cos, &sin] {
            assert_eq!(
                table.meta.shape().num_elements(),
                tokens * dim,
                "rotary table size"
            );
        }
        Self {
            rows: shape.iter().product::<usize>() / dim,
            scale: contiguous_as(scale, x.dtype),
            x: into_contiguous(x),
            cos: contiguous_as(cos, DType::F32),
            sin: contiguous_as(sin, DType::F32),
            dim,
            tokens,
        }
    }

    /// Cubes and units: one unit per row.
    fn launch_dims(&self) -> (CubeCount, CubeDim) {
        one_unit_each(&self.x.client, self.rows)
    }
}

/// The RMS norm of each row of `x` (`[..., tokens, dim]`) times `scale`, rotated by the
/// token's angles (`cos`, `sin`: `[tokens, dim]`).
pub fn norm_rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    eps: f32,
) -> CubeTensor<R> {
    let o = Operands::new(x, scale, cos, sin);
    let out = empty_like(&o.x);
    let (count, cube_dim) = o.launch_dims();
    norm_rope_kernel::launch(
        &o.x.client,
        count,
        cube_dim,
        array(&o.x),
        array(&o.scale),
        array(&o.cos),
        array(&o.sin),
        array(&out),
        o.rows,
        o.dim,
        o.tokens,
        eps,
        o.x.dtype.into(),
    );
    out
}

/// The gradient of `x` given `grad`, the gradient of [`norm_rope`]'s output (same shape), with
/// the scale and the angles held constant.
pub fn norm_rope_backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    grad: CubeTensor<R>,
    eps: f32,
) -> CubeTensor<R> {
    assert_eq!(x.meta.shape(), grad.meta.shape(), "gradient shape");
    let o = Operands::new(x, scale, cos, sin);
    let grad = contiguous_as(grad, o.x.dtype);
    let dx = empty_like(&o.x);
    let (count, cube_dim) = o.launch_dims();
    norm_rope_backward_kernel::launch(
        &o.x.client,
        count,
        cube_dim,
        array(&o.x),
        array(&o.scale),
        array(&o.cos),
        array(&o.sin),
        array(&grad),
        array(&dx),
        o.rows,
        o.dim,
        o.tokens,
        eps,
        o.x.dtype.into(),
    );
    dx
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::backend::Wgpu;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    /// One row's output in f64.
    fn reference(x: &[f64], scale: &[f64], cos: &[f64], sin: &[f64], eps: f64) -> Vec<f64> {
        let inverse = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
        let n: Vec<f64> = x.iter().zip(scale).map(|(v, s)| v * inverse * s).collect();
        (0..x.len())
            .map(|c| {
                let pair = c - c % 2;
                let (n0, n1) = (n[pair], n[pair + 1]);
                if c % 2 == 0 {
                    n0 * cos[c] - n1 * sin[c]
                } else {
                    n1 * cos[c] + n0 * sin[c]
                }
            })
            .collect()
    }

    fn values<const D: usize>(t: &Tensor<Wgpu, D>) -> Vec<f64> {
        t.to_data().iter::<f64>().collect()
    }

    fn from(t: CubeTensor<cubecl::wgpu::WgpuRuntime>) -> Vec<f64> {
        values(&Tensor::<Wgpu, 4>::from_primitive(TensorPrimitive::Float(
            t,
        )))
    }

    /// The kernels on a strided view (made contiguous first) against the formula in f64, and
    /// the gradient of `Σ grad ∘ out` against its central differences.
    #[test]
    fn forward_and_gradient_match_float64() {
        let device = Default::default();
        let (heads, tokens, dim, eps) = (3, 5, 8, 1e-6);
        let normal = Distribution::Normal(0.0, 1.5);
        let x = Tensor::<Wgpu, 4>::random([1, tokens, heads, dim], normal, &device).swap_dims(1, 2);
        let scale = Tensor::<Wgpu, 1>::random([dim], Distribution::Uniform(0.5, 1.5), &device);
        let angles =
            Tensor::<Wgpu, 2>::random([tokens, dim / 2], Distribution::Uniform(-3.0, 3.0), &device)
                .unsqueeze_dim::<3>(2)
                .repeat_dim(2, 2)
                .reshape([tokens, dim]);
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let grad =
            Tensor::<Wgpu, 4>::random([1, heads, tokens, dim], Distribution::Default, &device);
        let (xs, ss, cs, ns, gs) = (
            values(&x),
            values(&scale),
            values(&cos),
            values(&sin),
            values(&grad),
        );
        let prim = |t: Tensor<Wgpu, 2>| t.into_primitive().tensor();
        let out = from(norm_rope(
            x.clone().into_primitive().tensor(),
            scale.clone().into_primitive().tensor(),
            prim(cos.clone()),
            prim(sin.clone()),
            eps as f32,
        ));
        let dx = from(norm_rope_backward(
            x.into_primitive().tensor(),
            scale.into_primitive().tensor(),
            prim(cos),
            prim(sin),
            grad.into_primitive().tensor(),
            eps as f32,
        ));
        for row in 0..heads * tokens {
            let t = row % tokens;
            let at = |v: &[f64]| v[row * dim..][..dim].to_vec();
            let table = |v: &[f64]| v[t * dim..][..dim].to_vec();
            let (xr, cr, nr, gr) = (at(&xs), table(&cs), table(&ns), at(&gs));
            let want = reference(&xr, &ss, &cr, &nr, eps);
            let loss = |x: &[f64]| -> f64 {
                reference(x, &ss, &cr, &nr, eps)
                    .iter()
                    .zip(&gr)
                    .map(|(o, g)| o * g)
                    .sum()
            };
            for c in 0..dim {
                let got = out[row * dim + c];
                assert!(
                    (got - want[c]).abs() <= 1e-5 + 1e-5 * want[c].abs(),
                    "row {row} lane {c}: {got}, expected {}",
                    want[c]
                );
                let h = 1e-6;
                let (mut up, mut down) = (xr.clone(), xr.clone());
                up[c] += h;
                down[c] -= h;
                let slope = (loss(&up) - loss(&down)) / (2.0 * h);
                let got = dx[row * dim + c];
                assert!(
                    (got - slope).abs() <= 1e-4 + 1e-4 * slope.abs(),
                    "gradient at row {row} lane {c}: {got}, expected {slope}"
                );
            }
        }
    }
}
