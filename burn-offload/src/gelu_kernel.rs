//! GELU with the tanh approximation as one CubeCL kernel each way, for any CubeCL runtime:
//! `y = x/2 · (1 + tanh(z))`, `z = √(2/π) · (x + 0.044715 x³)`, and its derivative, computed in
//! f32 and stored in the tensor's dtype. They use the same function written with the logistic
//! σ, `(1 + tanh z) / 2 = σ(2z)` and `1 − tanh² z = 4 σ(2z) σ(−2z)`, each σ from its own
//! exponential, so that no difference of nearly equal numbers loses the tails (the tanh form
//! gives a zero gradient below x ≈ −4.5 in f32). As separate ops the forward is nine passes over the tensor and
//! the backward more; here each is one. The mechanism behind
//! [`gelu_tanh`](crate::gelu_tanh); tested on wgpu (f32), run on CUDA (bf16).

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;

/// √(2/π).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic term's coefficient.
const CUBIC: f32 = 0.044_715;

#[cube(launch)]
fn gelu_tanh_kernel<F: Float>(x: &Array<F>, y: &mut Array<F>, #[define(F)] _dtype: StorageType) {
    let i = ABSOLUTE_POS;
    if i >= x.len() {
        terminate!();
    }
    let v = f32::cast_from(x[i]);
    let z = SQRT_2_OVER_PI * (v + CUBIC * v * v * v);
    y[i] = F::cast_from(v / (1.0f32 + f32::exp(-2.0f32 * z)));
}

#[cube(launch)]
fn gelu_tanh_backward_kernel<F: Float>(
    x: &Array<F>,
    grad: &Array<F>,
    dx: &mut Array<F>,
    #[define(F)] _dtype: StorageType,
) {
    let i = ABSOLUTE_POS;
    if i >= x.len() {
        terminate!();
    }
    let v = f32::cast_from(x[i]);
    let z = SQRT_2_OVER_PI * (v + CUBIC * v * v * v);
    let dz = SQRT_2_OVER_PI * (1.0f32 + 3.0f32 * CUBIC * v * v);
    let s = 1.0f32 / (1.0f32 + f32::exp(-2.0f32 * z));
    let s_complement = 1.0f32 / (1.0f32 + f32::exp(2.0f32 * z));
    let slope = s + 2.0f32 * v * s * s_complement * dz;
    dx[i] = F::cast_from(f32::cast_from(grad[i]) * slope);
}

/// The buffer of a contiguous tensor as an array argument.
fn array<R: CubeRuntime>(tensor: &CubeTensor<R>) -> ArrayArg<R> {
    let len = tensor.meta.shape().num_elements();
    // SAFETY: a contiguous tensor's handle starts at its first element and holds `len` of them;
    // every caller passes a tensor `into_contiguous` returned or one it allocated.
    unsafe { ArrayArg::from_raw_parts(tensor.handle.clone(), len) }
}

/// A new contiguous tensor shaped and typed like `like`.
fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(like.meta.shape().to_vec()),
        like.dtype,
    )
}

/// GELU (tanh) of the float tensor `x` (made contiguous first when it is a strided view).
pub fn gelu_tanh<R: CubeRuntime>(x: CubeTensor<R>) -> CubeTensor<R> {
    let x = into_contiguous(x);
    let out = empty_like(&x);
    let n = x.meta.shape().num_elements();
    let cube_dim = CubeDim::new(&x.client, n);
    let cube_count = calculate_cube_count_elemwise(&x.client, n, cube_dim);
    gelu_tanh_kernel::launch(
        &x.client,
        cube_count,
        cube_dim,
        array(&x),
        array(&out),
        x.dtype.into(),
    );
    out
}

/// The gradient of `x` given `grad`, the gradient of GELU (tanh) of `x` (same shape and dtype).
pub fn gelu_tanh_backward<R: CubeRuntime>(x: CubeTensor<R>, grad: CubeTensor<R>) -> CubeTensor<R> {
    assert_eq!(x.meta.shape(), grad.meta.shape(), "GELU gradient shape");
    assert_eq!(x.dtype, grad.dtype, "GELU gradient dtype");
    let (x, grad) = (into_contiguous(x), into_contiguous(grad));
    let out = empty_like(&x);
    let n = x.meta.shape().num_elements();
    let cube_dim = CubeDim::new(&x.client, n);
    let cube_count = calculate_cube_count_elemwise(&x.client, n, cube_dim);
    gelu_tanh_backward_kernel::launch(
        &x.client,
        cube_count,
        cube_dim,
        array(&x),
        array(&grad),
        array(&out),
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

    /// The kernels on a strided view (made contiguous first) against the formula in f64, and
    /// the gradient against a central difference of that formula.
    #[test]
    fn forward_and_gradient_match_float64() {
        let device = Default::default();
        let x = Tensor::<Wgpu, 2>::random([37, 129], Distribution::Normal(0.0, 2.5), &device)
            .swap_dims(0, 1);
        let grad = Tensor::<Wgpu, 2>::random([129, 37], Distribution::Default, &device);
        let xs: Vec<f32> = x.to_data().to_vec().unwrap();
        let gs: Vec<f32> = grad.to_data().to_vec().unwrap();
        let x = x.into_primitive().tensor();
        let y = values(gelu_tanh(x.clone()));
        let dx = values(gelu_tanh_backward(x, grad.into_primitive().tensor()));
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
    }
}
