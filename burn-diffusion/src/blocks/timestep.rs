//! Sinusoidal embedding of diffusion timesteps.

use burn::tensor::{DType, Tensor, TensorData};
use burn_kernels::Kernels;

/// `[cos(t·f₀) … cos(t·fₙ₋₁), sin(t·f₀) … sin(t·fₙ₋₁)]` with `t = timestep · time_factor`,
/// `n = dim / 2` and `fᵢ = exp(-ln(10000) · i / n)`, in f32.
///
/// The product `timestep · time_factor` is taken in the input's dtype and the rest in f32, the
/// order in which FLUX and diffusers compute it, so that a bf16 model sees the same rounding.
///
/// # Shapes
/// - `timesteps`: `[batch]`
/// - output: `[batch, dim]`
pub fn timestep_embedding<B: Kernels>(
    timesteps: Tensor<B, 1>,
    dim: usize,
    time_factor: f64,
) -> Tensor<B, 2> {
    let half = dim / 2;
    let log_period = -(10000f64.ln() as f32);
    // Each step rounded to f32 as the reference does; exp rounded once from f64.
    let freqs: Vec<f32> = (0..half)
        .map(|i| ((log_period * i as f32 / half as f32) as f64).exp() as f32)
        .collect();
    let device = timesteps.device();
    let freqs = Tensor::<B, 2>::from_data(TensorData::new(freqs, [1, half]), (&device, DType::F32));
    let args = (timesteps * time_factor)
        .cast(DType::F32)
        .unsqueeze_dim::<2>(1)
        * freqs;
    Tensor::cat(vec![args.clone().cos(), args.sin()], 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn cosines_then_sines_of_scaled_time() {
        let device = Default::default();
        let t = [0.25f32, 0.8];
        let out = timestep_embedding(Tensor::<Flex, 1>::from_floats(t, &device), 8, 1000.0);
        assert_eq!(out.dims(), [2, 8]);
        let out = out.into_data().to_vec::<f32>().unwrap();
        for (b, &t) in t.iter().enumerate() {
            for i in 0..4 {
                let arg = t as f64 * 1000.0 * (-(10000f64.ln()) * i as f64 / 4.0).exp();
                assert!((out[b * 8 + i] as f64 - arg.cos()).abs() < 1e-4);
                assert!((out[b * 8 + 4 + i] as f64 - arg.sin()).abs() < 1e-4);
            }
        }
    }
}
