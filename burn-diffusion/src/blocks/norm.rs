//! Normalizations over the last dimension, computed in f32 whatever the input dtype.

use burn::tensor::{DType, Tensor};
use burn_kernels::Kernels;

/// Layer norm without learned parameters: `(x - mean) / √(var + eps)` (biased variance); one
/// fused kernel each way where [`burn_kernels::layer_norm`] has one (unless the
/// installed `KernelOptions` switch it off), elsewhere separate ops.
pub fn layer_norm<B: Kernels, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    if let Some(y) = burn_kernels::layer_norm(&x, eps) {
        return y;
    }
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let centered = x.clone() - x.mean_dim(D - 1);
    let var = centered.clone().square().mean_dim(D - 1);
    (centered / (var + eps).sqrt()).cast(dtype)
}

/// RMS norm with a learned scale: `x / √(mean(x²) + eps) · scale`; the normalized value is
/// rounded to the input dtype before the scale multiplies it. The norm is one fused kernel each
/// way where [`burn_kernels::rms_norm`] has one (unless the installed `KernelOptions` switch it
/// off), elsewhere separate ops.
///
/// # Shapes
/// - `x`: `[..., dim]`
/// - `scale`: `[dim]`
pub fn rms_norm<B: Kernels, const D: usize>(
    x: Tensor<B, D>,
    scale: Tensor<B, 1>,
    eps: f64,
) -> Tensor<B, D> {
    if let Some(normalized) = burn_kernels::rms_norm(&x, eps) {
        return normalized * scale.unsqueeze::<D>();
    }
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let rms = (x.clone().square().mean_dim(D - 1) + eps).sqrt();
    (x / rms).cast(dtype) * scale.unsqueeze::<D>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    const ROWS: [[f32; 4]; 2] = [[1.0, -2.0, 0.5, 4.0], [0.1, 0.1, 0.3, -0.2]];

    fn rows(out: Tensor<Flex, 2>) -> Vec<f32> {
        out.into_data().to_vec::<f32>().unwrap()
    }

    #[test]
    fn layer_norm_matches_float64() {
        let x = Tensor::<Flex, 2>::from_floats(ROWS, &Default::default());
        let out = rows(layer_norm(x, 1e-6));
        for (r, row) in ROWS.iter().enumerate() {
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / 4.0;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / 4.0;
            for (c, &v) in row.iter().enumerate() {
                let expected = (v as f64 - mean) / (var + 1e-6).sqrt();
                assert!((out[r * 4 + c] as f64 - expected).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn rms_norm_matches_float64() {
        let device = Default::default();
        let x = Tensor::<Flex, 2>::from_floats(ROWS, &device);
        let scale = [0.5f32, 1.0, -1.5, 2.0];
        let out = rows(rms_norm(x, Tensor::from_floats(scale, &device), 1e-6));
        for (r, row) in ROWS.iter().enumerate() {
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 4.0;
            for (c, &v) in row.iter().enumerate() {
                let expected = v as f64 / (ms + 1e-6).sqrt() * scale[c] as f64;
                assert!((out[r * 4 + c] as f64 - expected).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn bf16_input_gives_bf16_output() {
        let device = Default::default();
        let x = Tensor::<Flex, 2>::from_data(ROWS, (&device, DType::BF16));
        let out = layer_norm(x, 1e-6);
        assert_eq!(out.dtype(), DType::BF16);
    }
}
