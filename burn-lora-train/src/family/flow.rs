//! The flow-matching objective FLUX.1 and FLUX.2 train with: the noisy input and target of a
//! batch of packed latents, and the loss's value and adapter gradients.

use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::module::AutodiffModule;
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, ElementConversion, Tensor, TensorData};
use burn_diffusion::{BlockTape, Checkpointing};
use burn_kernels::FusedOps;

use crate::config::TrainPlan;
use crate::rng::Rng;

/// Where the noise is drawn before it is copied to the device, so that it is the same on every
/// backend.
const HOST: FlexDevice = FlexDevice;

/// One batch's flow-matching pair: `x_t = (1 − σ)·x₀ + σ·noise` and the target `noise − x₀`,
/// each sample at its own σ, the noise drawn on the CPU (`Flex` seeded with `rng.next_u64()`),
/// with σ itself (all f32).
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
        Flex::seed(&HOST, rng.next_u64());
        let noise = Tensor::<Flex, 3>::random(x0.shape(), Distribution::Normal(0.0, 1.0), &HOST);
        let noise = Tensor::<B, 3>::from_data(noise.into_data(), device);
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

/// What the run's `train.gradient_checkpointing` asks the block tape for.
pub(crate) fn checkpointing(plan: &TrainPlan) -> Checkpointing {
    if plan.train.gradient_checkpointing {
        Checkpointing::Blocks
    } else {
        Checkpointing::Off
    }
}

/// The mean squared error of `prediction` against `target` (in f32), and the gradients of
/// `model`'s adapters through `tape`.
pub(crate) fn mse_gradients<B: FusedOps, M: AutodiffModule<Autodiff<B>>>(
    prediction: Tensor<Autodiff<B>, 3>,
    target: Tensor<B, 3>,
    tape: BlockTape<B, NoCheckpointing>,
    model: &M,
) -> (f64, GradientsParams) {
    let loss = (prediction.cast(DType::F32) - Tensor::from_inner(target))
        .powi_scalar(2)
        .mean();
    let grads = GradientsParams::from_grads(tape.backward(&loss, model), model);
    // Read after the backward is queued: reading first would leave the device idle while the
    // host queues the backward.
    let value = loss.into_scalar().elem::<f64>();
    (value, grads)
}
