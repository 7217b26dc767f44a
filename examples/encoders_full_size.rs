//! The full-size FLUX.1 VAE, CLIP-L and a T5-XXL-shaped encoder with random bf16 weights on one
//! CUDA GPU: time and peak device memory to encode a 1024×1024 image (and decode its latent,
//! for previews), a 77-token and a 512-token caption.
//!
//! ```text
//! cargo run --release --features cuda --example encoders_full_size
//! ```
//!
//! On the GPU machine set `CUDA_PATH=/usr/local/cuda` and add `/usr/local/cuda/lib64` to
//! `LD_LIBRARY_PATH`. Each model runs three times: the first includes creating its weights and
//! compiling and autotuning kernels, the other two are warm. Peak memory is the device's used
//! memory as `nvidia-smi` samples it every 20 ms, minus what was used before the program began.

mod common;

use std::time::Instant;

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, Int, IntDType, Tensor, set_default_dtypes};
use burn_diffusion::clip::ClipTextConfig;
use burn_diffusion::t5::T5Config;
use burn_diffusion::vae::VaeConfig;

type B = Cuda;

/// Runs of each measurement.
const RUNS: usize = 3;

fn main() {
    let device = CudaDevice::default();
    set_default_dtypes::<B>(&device, FloatDType::BF16, IntDType::I32)
        .expect("bf16 weights need a fresh device");
    let memory =
        common::DeviceMemory::start().expect("nvidia-smi is needed to sample device memory");
    println!(
        "device memory in use before start: {:.2} GB",
        memory.baseline_gb()
    );

    let started = Instant::now();
    let stage = |what: &str| println!("[{:7.1} s] {what}", started.elapsed().as_secs_f64());
    stage("creating the VAE");
    let vae = VaeConfig::flux().init::<B>(&device);
    let image = Tensor::<B, 4>::random(
        [1, 3, 1024, 1024],
        Distribution::Uniform(-1.0, 1.0),
        &device,
    );
    stage("encoding");
    measure("FLUX.1 VAE encode 1024x1024", &device, &memory, || {
        vae.encode(image.clone()).mean
    });
    let latent = Tensor::<B, 4>::random([1, 16, 128, 128], Distribution::Normal(0.0, 1.0), &device);
    measure("FLUX.1 VAE decode 128x128 latent", &device, &memory, || {
        vae.decode(latent.clone())
    });
    drop((vae, image, latent));
    B::memory_cleanup(&device);

    stage("creating CLIP-L");
    let clip = ClipTextConfig::clip_l().init::<B>(&device);
    let ids = Tensor::<B, 2, Int>::random([1, 77], Distribution::Uniform(0.0, 49407.0), &device);
    measure("CLIP-L encode 77 tokens", &device, &memory, || {
        clip.forward(ids.clone()).pooled
    });
    drop((clip, ids));
    B::memory_cleanup(&device);

    stage("creating T5-XXL");
    let t5 = T5Config::xxl().init::<B>(&device);
    let ids = Tensor::<B, 2, Int>::random([1, 512], Distribution::Uniform(0.0, 32127.0), &device);
    measure("T5-XXL encode 512 tokens", &device, &memory, || {
        t5.forward(ids.clone())
    });
    drop((t5, ids));
    B::memory_cleanup(&device);
}

/// Times `RUNS` runs of `f` (each waited for on the device) and prints the peak memory seen
/// since the previous measurement.
fn measure<T>(label: &str, device: &CudaDevice, memory: &common::DeviceMemory, f: impl Fn() -> T) {
    memory.take_peak();
    let mut times = Vec::with_capacity(RUNS);
    for run in 0..RUNS {
        println!("  {label}: run {run}");
        let start = Instant::now();
        let out = f();
        B::sync(device).expect("device error");
        times.push(start.elapsed().as_secs_f64());
        drop(out);
    }
    let shown: Vec<String> = times.iter().map(|t| format!("{t:.3} s")).collect();
    println!(
        "{label}: runs {} (first one cold); peak device memory {:.2} GB above the start",
        shown.join(", "),
        memory.take_peak() - memory.baseline_gb()
    );
}
