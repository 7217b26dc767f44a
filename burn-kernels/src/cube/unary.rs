//! The fused ops of one tensor ([`UnaryOp`]) as CubeCL kernels, one each way, for any CubeCL
//! runtime; computed in f32 and stored in the tensor's dtype. The mechanism behind
//! [`gelu_tanh`](crate::gelu_tanh), [`layer_norm`](crate::layer_norm) and
//! [`rms_norm`](crate::rms_norm); tested on wgpu (f32),
//! run on CUDA (bf16).
//!
//! GELU (tanh), `y = x/2 · (1 + tanh(z))`, `z = √(2/π) · (x + 0.044715 x³)`: as separate ops
//! the forward is nine passes over the tensor and the backward more; here each is one. The
//! kernels use the same function written with the logistic σ, `(1 + tanh z) / 2 = σ(2z)` and
//! `1 − tanh² z = 4 σ(2z) σ(−2z)`, each σ from its own exponential, so that no difference of
//! nearly equal numbers loses the tails (the tanh form gives a zero gradient below x ≈ −4.5 in
//! f32). Each unit loads, computes and stores one vector of `width` consecutive values:
//! `width` is the widest vector the runtime loads in one access for the dtype (16 bytes: 8 bf16
//! values on CUDA, 4 f32 values) that divides the tensor's size, down to one value per unit
//! when no wider vector does.
//!
//! Layer norm and RMS norm (the same kernels, the mean left out): one cube of [`ROW_UNITS`]
//! units per row, the sums reduced in shared memory; the forward reads the row three times
//! (mean, centered variance, output; RMS norm twice) and the backward four, from cache after
//! the first.

use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::cube::{array, contiguous_as, empty_like, one_unit_each, vector_array, widest_vector};
use crate::fused::{GELU_CUBIC as CUBIC, SQRT_2_OVER_PI, UnaryOp};

/// GELU (tanh) of `v`.
#[cube]
fn gelu(v: f32) -> f32 {
    let z = SQRT_2_OVER_PI * (v + CUBIC * v * v * v);
    v / (1.0f32 + f32::exp(-2.0f32 * z))
}

/// The slope of GELU (tanh) at `v`.
#[cube]
fn gelu_slope(v: f32) -> f32 {
    let z = SQRT_2_OVER_PI * (v + CUBIC * v * v * v);
    let dz = SQRT_2_OVER_PI * (1.0f32 + 3.0f32 * CUBIC * v * v);
    let s = 1.0f32 / (1.0f32 + f32::exp(-2.0f32 * z));
    let s_complement = 1.0f32 / (1.0f32 + f32::exp(2.0f32 * z));
    s + 2.0f32 * v * s * s_complement * dz
}

#[cube(launch)]
fn gelu_tanh_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    y: &mut Array<Vector<F, N>>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= x.len() {
        terminate!();
    }
    let values = x[i];
    let mut result = values;
    #[unroll]
    for k in 0..N::value() {
        result[k] = F::cast_from(gelu(f32::cast_from(values[k])));
    }
    y[i] = result;
}

#[cube(launch)]
fn gelu_tanh_backward_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    grad: &Array<Vector<F, N>>,
    dx: &mut Array<Vector<F, N>>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= x.len() {
        terminate!();
    }
    let values = x[i];
    let gradient = grad[i];
    let mut result = values;
    #[unroll]
    for k in 0..N::value() {
        let slope = gelu_slope(f32::cast_from(values[k]));
        result[k] = F::cast_from(f32::cast_from(gradient[k]) * slope);
    }
    dx[i] = result;
}

/// Units per cube of the layer-norm kernels: one cube per row.
pub const ROW_UNITS: usize = 1 << ROW_LEVELS;
/// Halvings that reduce `ROW_UNITS` values to one.
const ROW_LEVELS: usize = 8;

/// The sum of every unit's `value` over the cube (`ROW_UNITS` units), through `shared`.
#[cube]
fn cube_sum(shared: &mut SharedMemory<f32>, value: f32) -> f32 {
    let unit = UNIT_POS_X as usize;
    shared[unit] = value;
    sync_cube();
    #[unroll]
    for level in 1..=ROW_LEVELS {
        let stride = ROW_UNITS >> level;
        if unit < stride {
            shared[unit] = shared[unit] + shared[unit + stride];
        }
        sync_cube();
    }
    let total = shared[0];
    sync_cube();
    total
}

/// A row's mean (zero where not `centered`) and `1 / √(var + eps)`, the variance taken about
/// that mean.
#[cube]
fn row_statistics<F: Float>(
    x: &Array<F>,
    shared: &mut SharedMemory<f32>,
    base: usize,
    dim: usize,
    eps: f32,
    #[comptime] centered: bool,
) -> (f32, f32) {
    let unit = UNIT_POS_X as usize;
    let mut mean = 0.0f32;
    if centered {
        let mut sum = 0.0f32;
        for c in range_stepped(unit, dim, ROW_UNITS) {
            sum += f32::cast_from(x[base + c]);
        }
        mean = cube_sum(shared, sum) / f32::cast_from(dim);
    }
    let mut squares = 0.0f32;
    for c in range_stepped(unit, dim, ROW_UNITS) {
        let v = f32::cast_from(x[base + c]) - mean;
        squares += v * v;
    }
    let variance = cube_sum(shared, squares) / f32::cast_from(dim);
    (mean, 1.0f32 / f32::sqrt(variance + eps))
}

/// Layer norm where `centered`, else RMS norm.
#[cube(launch)]
fn row_norm_kernel<F: Float>(
    x: &Array<F>,
    y: &mut Array<F>,
    dim: usize,
    eps: f32,
    #[comptime] centered: bool,
    #[define(F)] _dtype: StorageType,
) {
    let base = CUBE_POS_X as usize * dim;
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS);
    let (mean, inverse) = row_statistics(x, &mut shared, base, dim, eps, centered);
    for c in range_stepped(UNIT_POS_X as usize, dim, ROW_UNITS) {
        y[base + c] = F::cast_from((f32::cast_from(x[base + c]) - mean) * inverse);
    }
}

/// `dx = inverse · (g − mean(g) − n · mean(g ∘ n))`, `n` the normalized row; without the
/// `mean(g)` term where not `centered` (RMS norm).
#[cube(launch)]
fn row_norm_backward_kernel<F: Float>(
    x: &Array<F>,
    grad: &Array<F>,
    dx: &mut Array<F>,
    dim: usize,
    eps: f32,
    #[comptime] centered: bool,
    #[define(F)] _dtype: StorageType,
) {
    let base = CUBE_POS_X as usize * dim;
    let mut shared = SharedMemory::<f32>::new(ROW_UNITS);
    let (mean, inverse) = row_statistics(x, &mut shared, base, dim, eps, centered);
    let unit = UNIT_POS_X as usize;
    let mut sum = 0.0f32;
    let mut dot = 0.0f32;
    for c in range_stepped(unit, dim, ROW_UNITS) {
        let g = f32::cast_from(grad[base + c]);
        sum += g;
        dot += g * (f32::cast_from(x[base + c]) - mean) * inverse;
    }
    let mut grad_mean = 0.0f32;
    if centered {
        grad_mean = cube_sum(&mut shared, sum) / f32::cast_from(dim);
    }
    let dot_mean = cube_sum(&mut shared, dot) / f32::cast_from(dim);
    for c in range_stepped(unit, dim, ROW_UNITS) {
        let n = (f32::cast_from(x[base + c]) - mean) * inverse;
        let g = f32::cast_from(grad[base + c]);
        dx[base + c] = F::cast_from(inverse * (g - grad_mean - n * dot_mean));
    }
}

/// `op` on the float tensor `x` (made contiguous first when it is a strided view).
pub fn unary<R: CubeRuntime>(op: UnaryOp, x: CubeTensor<R>) -> CubeTensor<R> {
    let x = into_contiguous(x);
    match op {
        UnaryOp::GeluTanh => gelu_tanh(x),
        UnaryOp::LayerNorm { eps } => row_norm(x, eps, true),
        UnaryOp::RmsNorm { eps } => row_norm(x, eps, false),
    }
}

/// The gradient of `x` given `grad`, the gradient of `op` on `x` (same shape; cast to `x`'s
/// dtype when it differs).
pub fn unary_backward<R: CubeRuntime>(
    op: UnaryOp,
    x: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    assert_eq!(x.meta.shape(), grad.meta.shape(), "gradient shape");
    let x = into_contiguous(x);
    let grad = contiguous_as(grad, x.dtype);
    match op {
        UnaryOp::GeluTanh => gelu_tanh_backward(x, grad),
        UnaryOp::LayerNorm { eps } => row_norm_backward(x, grad, eps, true),
        UnaryOp::RmsNorm { eps } => row_norm_backward(x, grad, eps, false),
    }
}

/// Rows of the last dimension's length, and that length.
fn rows<R: CubeRuntime>(x: &CubeTensor<R>) -> (usize, usize) {
    let shape = x.meta.shape();
    let dim = shape[shape.len() - 1];
    (shape.num_elements() / dim.max(1), dim)
}

/// Layer norm of each row of `x` where `centered`, else RMS norm.
fn row_norm<R: CubeRuntime>(x: CubeTensor<R>, eps: f32, centered: bool) -> CubeTensor<R> {
    let y = empty_like(&x);
    let (rows, dim) = rows(&x);
    row_norm_kernel::launch(
        &x.client,
        CubeCount::new_1d(rows as u32),
        CubeDim::new_1d(ROW_UNITS as u32),
        array(&x),
        array(&y),
        dim,
        eps,
        centered,
        x.dtype.into(),
    );
    y
}

fn row_norm_backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    grad: CubeTensor<R>,
    eps: f32,
    centered: bool,
) -> CubeTensor<R> {
    let dx = empty_like(&x);
    let (rows, dim) = rows(&x);
    row_norm_backward_kernel::launch(
        &x.client,
        CubeCount::new_1d(rows as u32),
        CubeDim::new_1d(ROW_UNITS as u32),
        array(&x),
        array(&grad),
        array(&dx),
        dim,
        eps,
        centered,
        x.dtype.into(),
    );
    dx
}

/// Values per unit of the GELU kernels: the widest vector `x`'s runtime loads in one access for
/// its dtype that divides its size (1 when no wider one does).
fn gelu_width<R: CubeRuntime>(x: &CubeTensor<R>) -> usize {
    let elements = x.meta.shape().num_elements();
    widest_vector(&x.client, x.dtype, |width| elements.is_multiple_of(width)).unwrap_or(1)
}

fn gelu_tanh<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let out = empty_like(&x);
    let width = gelu_width(&x);
    let (cube_count, cube_dim) = one_unit_each(&x.client, x.meta.shape().num_elements() / width);
    gelu_tanh_kernel::launch(
        &x.client,
        cube_count,
        cube_dim,
        width,
        vector_array(&x, width),
        vector_array(&out, width),
        x.dtype.into(),
    );
    out
}

fn gelu_tanh_backward<R: CubeRuntime>(x: CubeTensor<R>, grad: CubeTensor<R>) -> CubeTensor<R> {
    let out = empty_like(&x);
    let width = gelu_width(&x);
    let (cube_count, cube_dim) = one_unit_each(&x.client, x.meta.shape().num_elements() / width);
    gelu_tanh_backward_kernel::launch(
        &x.client,
        cube_count,
        cube_dim,
        width,
        vector_array(&x, width),
        vector_array(&grad, width),
        vector_array(&out, width),
        x.dtype.into(),
    );
    out
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::backend::Wgpu;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    fn reference(x: f64) -> f64 {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x.powi(3))).tanh())
    }

    fn values(t: CubeTensor<cubecl::wgpu::WgpuRuntime>) -> Vec<f32> {
        Tensor::<Wgpu, 2>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .to_vec()
            .unwrap()
    }

    /// The GELU kernels on `x` against the formula in f64, and the gradient against a central
    /// difference of that formula; returns the kernels' vector width.
    fn check_gelu(x: Tensor<Wgpu, 2>) -> usize {
        let device = Default::default();
        let grad = Tensor::<Wgpu, 2>::random(x.shape(), Distribution::Default, &device);
        let xs: Vec<f32> = x.to_data().to_vec().unwrap();
        let gs: Vec<f32> = grad.to_data().to_vec().unwrap();
        let x = x.into_primitive().tensor();
        let width = gelu_width(&into_contiguous(x.clone()));
        let y = values(unary(UnaryOp::GeluTanh, x.clone()));
        let dx = values(unary_backward(
            UnaryOp::GeluTanh,
            x,
            grad.into_primitive().tensor(),
        ));
        let h = 1e-6;
        for (i, &v) in xs.iter().enumerate() {
            let v = v as f64;
            let want = reference(v);
            assert!(
                (y[i] as f64 - want).abs() <= 1e-6 + 1e-5 * want.abs(),
                "gelu({v}) = {}, expected {want}",
                y[i]
            );
            let slope = (reference(v + h) - reference(v - h)) / (2.0 * h);
            let want = gs[i] as f64 * slope;
            assert!(
                (dx[i] as f64 - want).abs() <= 1e-6 + 1e-5 * want.abs(),
                "gradient at {v}: {}, expected {want}",
                dx[i]
            );
        }
        width
    }

    /// A strided view (made contiguous first) of an odd number of values, one per unit.
    #[test]
    fn forward_and_gradient_match_float64() {
        let x = Tensor::<Wgpu, 2>::random(
            [37, 129],
            Distribution::Normal(0.0, 2.5),
            &Default::default(),
        );
        assert_eq!(check_gelu(x.swap_dims(0, 1)), 1);
    }

    /// A size that vectors tile: several values per unit.
    #[test]
    fn vectors_match_float64() {
        let x = Tensor::<Wgpu, 2>::random(
            [48, 80],
            Distribution::Normal(0.0, 2.5),
            &Default::default(),
        );
        assert!(check_gelu(x) > 1);
    }

    /// One row's layer norm (RMS norm where not `centered`) in f64.
    fn norm_row(x: &[f64], eps: f64, centered: bool) -> Vec<f64> {
        let n = x.len() as f64;
        let mean = if centered {
            x.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        x.iter().map(|v| (v - mean) / (var + eps).sqrt()).collect()
    }

    /// Layer norm and RMS norm on rows longer and shorter than a cube, one of them a strided
    /// view: the output against the formula in f64, the gradient of `Σ grad ∘ y` against its
    /// central differences.
    #[test]
    fn norms_and_gradients_match_float64() {
        let device = Default::default();
        let eps = 1e-5;
        let norms = [
            (UnaryOp::LayerNorm { eps: eps as f32 }, true),
            (UnaryOp::RmsNorm { eps: eps as f32 }, false),
        ];
        for ((op, centered), (rows, dim)) in norms
            .into_iter()
            .flat_map(|norm| [(5, 300), (4, 7)].map(|shape| (norm, shape)))
        {
            let x = Tensor::<Wgpu, 2>::random([dim, rows], Distribution::Normal(0.5, 2.0), &device)
                .swap_dims(0, 1);
            let grad = Tensor::<Wgpu, 2>::random([rows, dim], Distribution::Default, &device);
            let xs: Vec<f64> = x.to_data().iter::<f64>().collect();
            let gs: Vec<f64> = grad.to_data().iter::<f64>().collect();
            let x = x.into_primitive().tensor();
            let y = values(unary(op, x.clone()));
            let dx = values(unary_backward(op, x, grad.into_primitive().tensor()));
            for row in 0..rows {
                let (xr, gr) = (&xs[row * dim..][..dim], &gs[row * dim..][..dim]);
                let want = norm_row(xr, eps, centered);
                let loss = |x: &[f64]| -> f64 {
                    norm_row(x, eps, centered)
                        .iter()
                        .zip(gr)
                        .map(|(y, g)| y * g)
                        .sum()
                };
                for c in 0..dim {
                    let got = y[row * dim + c] as f64;
                    assert!(
                        (got - want[c]).abs() <= 1e-5 + 1e-5 * want[c].abs(),
                        "row {row} of {dim}, lane {c}: {got}, expected {}",
                        want[c]
                    );
                    let h = 1e-6;
                    let (mut up, mut down) = (xr.to_vec(), xr.to_vec());
                    up[c] += h;
                    down[c] -= h;
                    let slope = (loss(&up) - loss(&down)) / (2.0 * h);
                    let got = dx[row * dim + c] as f64;
                    assert!(
                        (got - slope).abs() <= 1e-4 + 1e-4 * slope.abs(),
                        "gradient at row {row} of {dim}, lane {c}: {got}, expected {slope}"
                    );
                }
            }
        }
    }
}
