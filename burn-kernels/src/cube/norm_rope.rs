//! The queries' and keys' RMS norm and rotary embedding as one CubeCL kernel each way, for any
//! CubeCL runtime: for each row `x` of `dim` values (one head of one token, or all heads of one
//! token together), `n = x / √(mean(x²) + eps) · scale`, then each pair `(n₀, n₁)` turned to
//! `(n₀ cos − n₁ sin, n₁ cos + n₀ sin)` by the token's angles, the tables holding one head's
//! `rot` lanes (lane `c` of the row takes the angle of lane `c mod rot`); in f32, stored once in
//! the input's dtype. As separate ops that is about fourteen passes forward. The mechanism
//! behind [`rms_norm_rope`](crate::rms_norm_rope); tested on wgpu (f32), run on CUDA (bf16).
//!
//! Each unit holds `spread` vectors of `width` consecutive values of a row, loaded and stored
//! whole: `width` is the widest vector the runtime loads in one access for the dtype (16 bytes:
//! 8 bf16 values on CUDA, 4 f32 values) that is even and divides `rot`, so that a unit holds
//! whole pairs of one head; `spread` is the fewest vectors per unit that fit a row in
//! [`CUBE_UNITS`] units (one for a head of 128, four for 5120 values of bf16). A row's units
//! sit side by side along the cube's x axis, vector `k · units + unit` in the unit's `k`-th
//! slot, so that neighbouring units touch neighbouring vectors, and a cube stacks as many rows
//! along its y axis as fit in [`CUBE_UNITS`] units (16 rows of 128 bf16 values). Rows go to
//! cubes token by token (every head of every batch entry at one token, then the next token's),
//! so that a cube's rows read the `cos` and `sin` rows of few tokens (one or two for 24 heads):
//! each unit reads the even lane's entry of each of its pairs, and the cube's other rows of the
//! same token find it in cache. A row's sums go through shared memory: every unit stores its
//! partial sum, and after one barrier adds up its row's partials in the same order, so that the
//! row's units agree on the sum. Slots past the last row (in the last cube, or in cubes added to
//! fit the runtime's grid) compute on the last row, so that they reach the barrier, and store
//! nothing.

use burn::tensor::DType;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::client::ComputeClient;
use cubecl::prelude::*;

use crate::cube::{array, contiguous_as, empty_like, vector_array, widest_vector};

/// Units per cube at most: a cube holds as many whole rows as fit.
pub const CUBE_UNITS: usize = 256;

/// Where the unit works: the index of its first vector in the rows (of its slot's row, or of
/// the last row for a spare slot), the index of its token's angles in the tables, and whether
/// the slot holds a row. Slots run token by token: slot `s` is head `s mod heads` of token
/// `s / heads`; a row of `dim` values is `dim / width` vectors, `group` units of `spread`.
#[cube]
fn unit_place(
    rows: usize,
    tokens: usize,
    #[comptime] dim: usize,
    #[comptime] rot: usize,
    #[comptime] width: usize,
) -> (usize, usize, bool) {
    let slot = CUBE_POS * CUBE_DIM_Y as usize + UNIT_POS_Y as usize;
    let active = slot < rows;
    let slot = slot.min(rows - 1);
    let heads = rows / tokens;
    let token = slot / heads;
    let row = (slot % heads) * tokens + token;
    let unit = UNIT_POS_X as usize;
    (row * comptime!(dim / width) + unit, token * rot, active)
}

/// The index in a table row of the first angle of the unit's `k`-th vector: its lane in the
/// row modulo the head's `rot` lanes.
#[cube]
fn lane(
    k: usize,
    #[comptime] group: usize,
    #[comptime] rot: usize,
    #[comptime] width: usize,
) -> usize {
    ((k * group + UNIT_POS_X as usize) * width) % rot
}

/// The sum of `value` over the `group` units of the unit's row (the units of one y position),
/// through `shared` (one entry per unit of the cube, written once: each sum takes its own).
#[cube]
fn row_sum(shared: &mut SharedMemory<f32>, value: f32, #[comptime] group: usize) -> f32 {
    let first = UNIT_POS_Y as usize * group;
    shared[first + UNIT_POS_X as usize] = value;
    sync_cube();
    let mut total = 0.0f32;
    for j in 0..group {
        total += shared[first + j];
    }
    total
}

#[cube(launch)]
fn norm_rope_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    scale: &Array<Vector<F, N>>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    out: &mut Array<Vector<F, N>>,
    rows: usize,
    tokens: usize,
    eps: f32,
    #[comptime] dim: usize,
    #[comptime] rot: usize,
    #[comptime] spread: usize,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let group = comptime!(dim / width / spread);
    let pairs = comptime!(width / 2);
    let unit = UNIT_POS_X as usize;
    let (first, angles, active) = unit_place(rows, tokens, dim, rot, width);
    let mut squares = 0.0f32;
    #[unroll]
    for k in 0..spread {
        let values = x[first + k * group];
        #[unroll]
        for c in 0..width {
            let v = f32::cast_from(values[c]);
            squares += v * v;
        }
    }
    let mut shared = SharedMemory::<f32>::new(CUBE_UNITS);
    let total = row_sum(&mut shared, squares, group);
    let inverse = 1.0f32 / f32::sqrt(total / f32::cast_from(dim) + eps);
    #[unroll]
    for k in 0..spread {
        let values = x[first + k * group];
        let weights = scale[k * group + unit];
        let at = angles + lane(k, group, rot, width);
        let mut turned = values;
        #[unroll]
        for p in 0..pairs {
            let c = 2 * p;
            let n0 = f32::cast_from(values[c]) * inverse * f32::cast_from(weights[c]);
            let n1 = f32::cast_from(values[c + 1]) * inverse * f32::cast_from(weights[c + 1]);
            let co = cos[at + c];
            let si = sin[at + c];
            turned[c] = F::cast_from(n0 * co - n1 * si);
            turned[c + 1] = F::cast_from(n1 * co + n0 * si);
        }
        if active {
            out[first + k * group] = turned;
        }
    }
}

/// The gradient of lanes `c` and `c + 1` of `grad` turned back by their angle (`cos[angle]`,
/// `sin[angle]`; the rotation's transpose), times the scale (`weights`): the gradient of the
/// scaled normalized pair.
#[cube]
fn turned_back<F: Float, N: Size>(
    grad: Vector<F, N>,
    weights: Vector<F, N>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    angle: usize,
    #[comptime] c: usize,
) -> (f32, f32) {
    let co = cos[angle];
    let si = sin[angle];
    let g0 = f32::cast_from(grad[c]);
    let g1 = f32::cast_from(grad[c + 1]);
    (
        (g0 * co + g1 * si) * f32::cast_from(weights[c]),
        (g1 * co - g0 * si) * f32::cast_from(weights[c + 1]),
    )
}

/// `dx = inverse · (g − x · inverse · mean(g ∘ x · inverse))`, where `g` is the output's
/// gradient turned back by the token's angles and multiplied by the scale.
#[cube(launch)]
fn norm_rope_backward_kernel<F: Float, N: Size>(
    x: &Array<Vector<F, N>>,
    scale: &Array<Vector<F, N>>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    grad: &Array<Vector<F, N>>,
    dx: &mut Array<Vector<F, N>>,
    rows: usize,
    tokens: usize,
    eps: f32,
    #[comptime] dim: usize,
    #[comptime] rot: usize,
    #[comptime] spread: usize,
    #[define(F)] _dtype: StorageType,
) {
    let width = N::value();
    let group = comptime!(dim / width / spread);
    let pairs = comptime!(width / 2);
    let unit = UNIT_POS_X as usize;
    let (first, angles, active) = unit_place(rows, tokens, dim, rot, width);
    let mut squares = 0.0f32;
    let mut dot = 0.0f32;
    #[unroll]
    for k in 0..spread {
        let values = x[first + k * group];
        let gradient = grad[first + k * group];
        let weights = scale[k * group + unit];
        let at = angles + lane(k, group, rot, width);
        #[unroll]
        for p in 0..pairs {
            let c = 2 * p;
            let (gn0, gn1) = turned_back(gradient, weights, cos, sin, at + c, c);
            let v0 = f32::cast_from(values[c]);
            let v1 = f32::cast_from(values[c + 1]);
            squares += v0 * v0 + v1 * v1;
            dot += gn0 * v0 + gn1 * v1;
        }
    }
    let mut shared_squares = SharedMemory::<f32>::new(CUBE_UNITS);
    let mut shared_dot = SharedMemory::<f32>::new(CUBE_UNITS);
    let inverse = 1.0f32
        / f32::sqrt(row_sum(&mut shared_squares, squares, group) / f32::cast_from(dim) + eps);
    let mean = row_sum(&mut shared_dot, dot, group) * inverse / f32::cast_from(dim);
    #[unroll]
    for k in 0..spread {
        let values = x[first + k * group];
        let gradient = grad[first + k * group];
        let weights = scale[k * group + unit];
        let at = angles + lane(k, group, rot, width);
        let mut result = values;
        #[unroll]
        for p in 0..pairs {
            let c = 2 * p;
            let (gn0, gn1) = turned_back(gradient, weights, cos, sin, at + c, c);
            let n0 = f32::cast_from(values[c]) * inverse;
            let n1 = f32::cast_from(values[c + 1]) * inverse;
            result[c] = F::cast_from(inverse * (gn0 - n0 * mean));
            result[c + 1] = F::cast_from(inverse * (gn1 - n1 * mean));
        }
        if active {
            dx[first + k * group] = result;
        }
    }
}

/// How a launch lays rows on units and cubes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Geometry {
    /// Values per vector: even, and a divisor of the tables' `rot` lanes.
    width: usize,
    /// Vectors per unit.
    spread: usize,
    /// Units per row, `dim / (width · spread)`.
    group: usize,
    /// Rows per cube.
    rows_per_cube: usize,
}

impl Geometry {
    /// The widest vector `client` loads in one access for `dtype` that is even and divides
    /// `rot` (which divides `dim`), the fewest vectors per unit that fit a row in
    /// [`CUBE_UNITS`] units, and as many rows per cube as fit.
    fn new<R: CubeRuntime>(
        client: &ComputeClient<R>,
        dtype: DType,
        dim: usize,
        rot: usize,
    ) -> Self {
        let width = widest_vector(client, dtype, |w| w % 2 == 0 && rot.is_multiple_of(w))
            .unwrap_or_else(|| panic!("no vector of whole pairs divides a head of {rot}"));
        let vectors = dim / width;
        let spread = (1..=vectors)
            .find(|&s| vectors.is_multiple_of(s) && vectors / s <= CUBE_UNITS)
            .expect("one vector per unit at most");
        let group = vectors / spread;
        Self {
            width,
            spread,
            group,
            rows_per_cube: CUBE_UNITS / group,
        }
    }

    /// Cubes and units for `rows` rows.
    fn launch_dims<R: CubeRuntime>(
        &self,
        client: &ComputeClient<R>,
        rows: usize,
    ) -> (CubeCount, CubeDim) {
        let cube_dim = CubeDim::new_2d(self.group as u32, self.rows_per_cube as u32);
        (
            calculate_cube_count_elemwise(client, rows * self.group, cube_dim),
            cube_dim,
        )
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
    rot: usize,
    tokens: usize,
    geometry: Geometry,
}

impl<R: CubeRuntime> Operands<R> {
    /// `x` `[..., tokens, dim]`, `scale` with `dim` values, `cos` and `sin` `[tokens, rot]`
    /// (every pair's value repeated for both its lanes; `rot` even and a divisor of `dim`).
    fn new(x: CubeTensor<R>, scale: CubeTensor<R>, cos: CubeTensor<R>, sin: CubeTensor<R>) -> Self {
        let shape = x.meta.shape().to_vec();
        let (tokens, dim) = (shape[shape.len() - 2], shape[shape.len() - 1]);
        let rot = *cos
            .meta
            .shape()
            .last()
            .expect("a rotary table of two dimensions");
        assert!(
            rot > 0 && rot.is_multiple_of(2) && dim.is_multiple_of(rot),
            "rotary pairs need an even head size dividing the row of {dim}, got {rot}"
        );
        assert_eq!(scale.meta.shape().num_elements(), dim, "norm scale size");
        for table in [&cos, &sin] {
            assert_eq!(
                table.meta.shape().num_elements(),
                tokens * rot,
                "rotary table size"
            );
        }
        let geometry = Geometry::new(&x.client, x.dtype, dim, rot);
        Self {
            rows: shape.iter().product::<usize>() / dim,
            scale: contiguous_as(scale, x.dtype),
            x: into_contiguous(x),
            cos: contiguous_as(cos, DType::F32),
            sin: contiguous_as(sin, DType::F32),
            dim,
            rot,
            tokens,
            geometry,
        }
    }

    /// Cubes and units for the call's rows.
    fn launch_dims(&self) -> (CubeCount, CubeDim) {
        self.geometry.launch_dims(&self.x.client, self.rows)
    }

    /// A tensor of `x`'s size as an array of vectors of the geometry's width.
    fn vectors(&self, tensor: &CubeTensor<R>) -> ArrayArg<R> {
        vector_array(tensor, self.geometry.width)
    }
}

/// The RMS norm of each row of `x` (`[..., tokens, dim]`) times `scale`, rotated by the
/// token's angles (`cos`, `sin`: `[tokens, rot]`, lane `c` by the angle of lane `c mod rot`).
pub fn norm_rope<R: CubeRuntime>(
    x: CubeTensor<R>,
    scale: CubeTensor<R>,
    cos: CubeTensor<R>,
    sin: CubeTensor<R>,
    eps: f32,
) -> CubeTensor<R> {
    let o = Operands::new(x, scale, cos, sin);
    let out = empty_like(&o.x);
    if o.rows == 0 {
        return out;
    }
    let (count, cube_dim) = o.launch_dims();
    norm_rope_kernel::launch(
        &o.x.client,
        count,
        cube_dim,
        o.geometry.width,
        o.vectors(&o.x),
        o.vectors(&o.scale),
        array(&o.cos),
        array(&o.sin),
        o.vectors(&out),
        o.rows,
        o.tokens,
        eps,
        o.dim,
        o.rot,
        o.geometry.spread,
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
    if o.rows == 0 {
        return dx;
    }
    let (count, cube_dim) = o.launch_dims();
    norm_rope_backward_kernel::launch(
        &o.x.client,
        count,
        cube_dim,
        o.geometry.width,
        o.vectors(&o.x),
        o.vectors(&o.scale),
        array(&o.cos),
        array(&o.sin),
        o.vectors(&grad),
        o.vectors(&dx),
        o.rows,
        o.tokens,
        eps,
        o.dim,
        o.rot,
        o.geometry.spread,
        o.x.dtype.into(),
    );
    dx
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use burn::backend::Wgpu;
    use burn::tensor::{Distribution, Tensor, TensorPrimitive};

    /// One row's output in f64; lane `c` takes the angle of lane `c mod rot` of the tables.
    fn reference(x: &[f64], scale: &[f64], cos: &[f64], sin: &[f64], eps: f64) -> Vec<f64> {
        let inverse = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64 + eps).sqrt();
        let n: Vec<f64> = x.iter().zip(scale).map(|(v, s)| v * inverse * s).collect();
        let rot = cos.len();
        (0..x.len())
            .map(|c| {
                let pair = c - c % 2;
                let (n0, n1) = (n[pair], n[pair + 1]);
                let (co, si) = (cos[c % rot], sin[c % rot]);
                if c % 2 == 0 {
                    n0 * co - n1 * si
                } else {
                    n1 * co + n0 * si
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

    /// The kernels on a strided view of `[batch, heads, tokens, dim]` (made contiguous first)
    /// with tables of `rot` lanes against the formula in f64, and the gradient of
    /// `Σ grad ∘ out` against its central differences; returns the launch's geometry.
    fn check(batch: usize, heads: usize, tokens: usize, dim: usize, rot: usize) -> Geometry {
        let device = Default::default();
        let eps = 1e-6;
        let normal = Distribution::Normal(0.0, 1.5);
        let x =
            Tensor::<Wgpu, 4>::random([batch, tokens, heads, dim], normal, &device).swap_dims(1, 2);
        let scale = Tensor::<Wgpu, 1>::random([dim], Distribution::Uniform(0.5, 1.5), &device);
        let angles =
            Tensor::<Wgpu, 2>::random([tokens, rot / 2], Distribution::Uniform(-3.0, 3.0), &device)
                .unsqueeze_dim::<3>(2)
                .repeat_dim(2, 2)
                .reshape([tokens, rot]);
        let (cos, sin) = (angles.clone().cos(), angles.sin());
        let grad =
            Tensor::<Wgpu, 4>::random([batch, heads, tokens, dim], Distribution::Default, &device);
        let (xs, ss, cs, ns, gs) = (
            values(&x),
            values(&scale),
            values(&cos),
            values(&sin),
            values(&grad),
        );
        let prim = |t: Tensor<Wgpu, 2>| t.into_primitive().tensor();
        let x = x.into_primitive().tensor();
        let geometry = Geometry::new(&x.client, x.dtype, dim, rot);
        let out = from(norm_rope(
            x.clone(),
            scale.clone().into_primitive().tensor(),
            prim(cos.clone()),
            prim(sin.clone()),
            eps as f32,
        ));
        let dx = from(norm_rope_backward(
            x,
            scale.into_primitive().tensor(),
            prim(cos),
            prim(sin),
            grad.into_primitive().tensor(),
            eps as f32,
        ));
        for row in 0..batch * heads * tokens {
            let t = row % tokens;
            let at = |v: &[f64]| v[row * dim..][..dim].to_vec();
            let table = |v: &[f64]| v[t * rot..][..rot].to_vec();
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
                    "dim {dim}, row {row} lane {c}: {got}, expected {}",
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
                    "dim {dim}, gradient at row {row} lane {c}: {got}, expected {slope}"
                );
            }
        }
        geometry
    }

    /// Rows of 8 values, and rows of 6, which take vectors of 2 values (one pair per unit).
    #[test]
    fn short_rows_match_float64() {
        check(1, 3, 5, 8, 8);
        let geometry = check(1, 2, 3, 6, 6);
        assert_eq!((geometry.width, geometry.group), (2, 3));
    }

    /// The models' head sizes, 64 and 128, over several cubes of rows of two batches, the last
    /// cube part full.
    #[test]
    fn head_sizes_64_and_128_match_float64() {
        for (batch, heads, tokens, dim) in [(1, 5, 9, 64), (2, 3, 7, 128)] {
            let geometry = check(batch, heads, tokens, dim, dim);
            let rows = batch * heads * tokens;
            assert!(geometry.width >= 2 && geometry.group > 1, "{geometry:?}");
            assert!(
                rows > geometry.rows_per_cube && rows % geometry.rows_per_cube != 0,
                "{rows} rows fill whole cubes of {geometry:?}"
            );
        }
    }

    /// Rows of all heads together (Wan's norm across heads): rows wider than a cube's units
    /// take several vectors per unit, and each head of 8 or 128 lanes its token's angles.
    #[test]
    fn rows_across_heads_match_float64() {
        check(1, 2, 3, 48, 8);
        let geometry = check(2, 1, 3, 2560, 128);
        assert!(
            geometry.spread > 1 && geometry.rows_per_cube == 1,
            "{geometry:?}"
        );
    }
}
