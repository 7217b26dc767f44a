//! What the breakdown programs share: the backend the trainer runs on CUDA, random inputs that
//! take gradients, and one timed row per part of a model.

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::tensor::{Distribution, Tensor};

use crate::timing::{clock, time};

/// The trainer's backend on CUDA.
pub type B = Autodiff<burn_offload::Offload<Cuda>>;
/// Its device.
pub type Device = CudaDevice;

/// A standard-normal tensor that takes gradients.
pub fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device).require_grad()
}

/// Times `loss` forward and forward + backward; prints a row scaled by `uses` per step and
/// returns the step's seconds for it.
pub fn measure(name: &str, uses: f64, device: &Device, loss: impl Fn() -> Tensor<B, 1>) -> f64 {
    eprintln!("[{:7.1} s] {name}", clock());
    let forward = time::<B>(device, 2, 5, || drop(loss()));
    let both = time::<B>(device, 2, 5, || drop(loss().backward()));
    let step = uses * (forward + both);
    println!(
        "  {name:40} {:9.2} {:9.2} {:6} {:9.3}",
        forward * 1e3,
        both * 1e3,
        uses,
        step
    );
    step
}
