//! The flow-matching objective FLUX.1 and FLUX.2 train with: the noisy input and target of a
//! batch of packed latents.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::rng::Rng;

/// One batch's flow-matching pair: `x_t = (1 − σ)·x₀ + σ·noise` and the target `noise − x₀`,
/// each sample at its own σ, with σ itself (all f32). The noise is drawn on the CPU from a
/// generator seeded by one `rng.next_u64()`, so that it is the same on every backend and
/// nothing global is read.
pub(crate) struct FlowPair<B: Backend> {
    /// The noisy latents.
    pub x_t: Tensor<B, 3>,
    /// What the model is trained to predict.
    pub target: Tensor<B, 3>,
    /// The noise level of each sample, `[n]`.
    pub sigma: Tensor<B, 1>,
}

impl<B: Backend> FlowPair<B> {
    /// The pair for packed latents `x0` (`[n, tokens, channels]`, f32) at noise levels `sigmas`.
    pub fn new(x0: Tensor<B, 3>, sigmas: Vec<f32>, rng: &mut Rng, device: &B::Device) -> Self {
        let n = sigmas.len();
        let shape = x0.dims();
        let noise = Rng::seeded(rng.next_u64()).normals(shape.iter().product());
        let noise = Tensor::<B, 3>::from_data(TensorData::new(noise, shape), device);
        let sigma = Tensor::<B, 1>::from_data(TensorData::new(sigmas, [n]), device);
        let s = sigma.clone().reshape([n, 1, 1]);
        let x_t = x0.clone() * (s.clone().neg() + 1.0) + noise.clone() * s;
        Self {
            x_t,
            target: noise - x0,
            sigma,
        }
    }
}
