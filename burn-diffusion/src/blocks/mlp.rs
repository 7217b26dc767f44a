//! Activations of the feed-forward layers.

use burn::tensor::Tensor;
use burn_kernels::Kernels;

/// GELU with the tanh approximation, `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`
/// (PyTorch's `gelu(approximate="tanh")`): one fused kernel each way where
/// [`burn_kernels::gelu_tanh`] has one (unless the installed `KernelOptions` switch it off), elsewhere separate
/// ops, with `x³` as two products so that it is exact for negative inputs on every backend.
pub fn gelu_tanh<B: Kernels, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    if let Some(y) = burn_kernels::gelu_tanh(&x) {
        return y;
    }
    const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
    let cube = x.clone() * x.clone() * x.clone();
    let inner = (x.clone() + cube * 0.044715) * SQRT_2_OVER_PI;
    x * (inner.tanh() + 1.0) * 0.5
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn matches_the_formula_in_float64() {
        let xs = [-6.0f32, -2.5, -1.0, -0.3, 0.0, 0.2, 1.0, 3.7, 8.0];
        let out = gelu_tanh(Tensor::<Flex, 1>::from_floats(xs, &Default::default()))
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        for (x, y) in xs.iter().zip(out) {
            let x = *x as f64;
            let expected = 0.5
                * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
            assert!(
                (y as f64 - expected).abs() < 1e-6,
                "gelu_tanh({x}) = {y}, expected {expected}"
            );
        }
    }
}
