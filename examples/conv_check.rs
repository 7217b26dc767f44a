//! burn-offload's cuDNN route for convolutions checked on one CUDA GPU: each convolution of a
//! set of shapes (3×3 with padding, stride 2, 1×1, groups, dilation, bias, odd sizes) through
//! cuDNN is compared with Burn's own kernel and with a float64 reference computed on the CPU, in
//! f32 and in bf16, and so are its gradients with respect to its input and filter (through
//! cuDNN's backward passes under autodiff) against the reference; then the full-size FLUX.1 VAE
//! encodes a 1024×1024 image through cuDNN (and with `--burn-vae` through Burn's kernels too),
//! cold (first call: kernel compilation and tuning included) and warm. `--reference-only`
//! leaves out Burn's kernels (whose first use of a shape tunes for seconds) and the VAE.
//!
//! ```text
//! cargo run --release --features cuda --example conv_check [-- --burn-vae | --reference-only]
//! ```
//!
//! On the GPU machine set `CUDA_PATH=/usr/local/cuda`, and add `/usr/local/cuda/lib64` and the
//! folder that holds `libcudnn.so.9` to `LD_LIBRARY_PATH`. `Offload<Cuda>` without streamed
//! weights is Burn's CUDA backend with its convolutions sent to cuDNN; `Cuda` is Burn's own;
//! `Flex` in float64 on the same inputs (rounded to the tested dtype first) is the reference.
//! cuDNN may use TF32 for f32 (as PyTorch's convolutions do) and Burn's kernels do too, so the
//! check is that the routed result is no further from the reference than Burn's (within 25 %,
//! plus 1e-6 in f32 and 1e-3 in bf16); the gradients must be within 5e-3 (f32, TF32 allowed)
//! and 2e-2 (bf16) of the reference. The program exits with an error when a case fails or
//! when the convolutions did not go through cuDNN.

mod checks;
mod kernels;
mod timing;

use std::time::Instant;

use burn::backend::{Autodiff, Cuda, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use burn_diffusion::materialize;
use burn_diffusion::vae::VaeConfig;
use burn_kernels::counters;
use burn_offload::Offload;
use checks::{Precision, input, relative_error};
use timing::{clock, time};

type Routed = Offload<Cuda>;

/// One convolution: input shape, filter shape, stride, padding, dilation, groups, bias.
struct Case {
    name: &'static str,
    x: [usize; 4],
    w: [usize; 4],
    stride: usize,
    padding: usize,
    dilation: usize,
    groups: usize,
    bias: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "3x3, padding 1, bias",
        x: [2, 16, 33, 31],
        w: [24, 16, 3, 3],
        stride: 1,
        padding: 1,
        dilation: 1,
        groups: 1,
        bias: true,
    },
    Case {
        name: "3x3, stride 2, no padding",
        x: [1, 8, 65, 64],
        w: [8, 8, 3, 3],
        stride: 2,
        padding: 0,
        dilation: 1,
        groups: 1,
        bias: true,
    },
    Case {
        name: "1x1, no bias",
        x: [3, 32, 17, 19],
        w: [12, 32, 1, 1],
        stride: 1,
        padding: 0,
        dilation: 1,
        groups: 1,
        bias: false,
    },
    Case {
        name: "3x3, 4 groups",
        x: [1, 16, 20, 20],
        w: [8, 4, 3, 3],
        stride: 1,
        padding: 1,
        dilation: 1,
        groups: 4,
        bias: true,
    },
    Case {
        name: "3x3, dilation 2",
        x: [1, 6, 23, 23],
        w: [5, 6, 3, 3],
        stride: 1,
        padding: 2,
        dilation: 2,
        groups: 1,
        bias: false,
    },
];

/// Every case's output on `B`.
fn outputs<B: Backend>(precision: Precision, device: &B::Device) -> Vec<TensorData> {
    CASES
        .iter()
        .enumerate()
        .map(|(i, case)| {
            let seed = 10 * i as u64;
            let x = input::<B, 4>(case.x, seed + 1, precision, device);
            let w = input::<B, 4>(case.w, seed + 2, precision, device);
            let bias = case
                .bias
                .then(|| input::<B, 1>([case.w[0]], seed + 3, precision, device));
            let options = ConvOptions::new(
                [case.stride; 2],
                [case.padding; 2],
                [case.dilation; 2],
                case.groups,
            );
            conv2d(x, w, bias, options)
                .cast(precision.wide())
                .into_data()
                .convert::<f64>()
        })
        .collect()
}

/// Every case's gradients of `sum(output · g)` (`g` drawn like the inputs) with respect to its
/// input and its filter, on `B`.
fn gradients<B: AutodiffBackend>(precision: Precision, device: &B::Device) -> Vec<[TensorData; 2]> {
    CASES
        .iter()
        .enumerate()
        .map(|(i, case)| {
            let seed = 10 * i as u64;
            let x = input::<B, 4>(case.x, seed + 1, precision, device).require_grad();
            let w = input::<B, 4>(case.w, seed + 2, precision, device).require_grad();
            let options = ConvOptions::new(
                [case.stride; 2],
                [case.padding; 2],
                [case.dilation; 2],
                case.groups,
            );
            let y = conv2d(x.clone(), w.clone(), None, options);
            let g = input::<B, 4>(y.dims(), seed + 4, precision, device);
            let grads = (y * g).sum().backward();
            [x, w].map(|t| {
                t.grad(&grads)
                    .expect("a gradient")
                    .cast(precision.wide())
                    .into_data()
                    .convert::<f64>()
            })
        })
        .collect()
}

/// Seconds for the full-size FLUX.1 VAE to encode a 1024×1024 image on `B`: the first call,
/// then the mean of two more.
fn vae_encode<B: burn_kernels::Kernels>(device: &B::Device) -> (f64, f64) {
    let vae = materialize(
        VaeConfig::flux().init::<B>(device),
        burn::tensor::FloatDType::F32,
    );
    let image =
        Tensor::<B, 4>::random([1, 3, 1024, 1024], Distribution::Uniform(-1.0, 1.0), device);
    let started = Instant::now();
    let _ = vae.encode_latents(image.clone()).into_data();
    let cold = started.elapsed().as_secs_f64();
    let warm = time::<B>(device, 0, 2, || drop(vae.encode_latents(image.clone())));
    (cold, warm)
}

fn main() {
    let _kernels = kernels::install_from_env();
    let device = Default::default();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    clock();
    let mut failed = false;
    let reference_only = std::env::args().any(|a| a == "--reference-only");
    for (dtype, floor) in [(DType::F32, 1e-6), (DType::BF16, 1e-3)] {
        let precision = Precision {
            input: dtype,
            compute: dtype,
        };
        let wide = Precision {
            input: dtype,
            compute: DType::F64,
        };
        let before = counters().dnn_convolutions;
        let routed = outputs::<Routed>(precision, &device);
        let routed_gradients = gradients::<Autodiff<Routed>>(precision, &device);
        let convolutions = counters().dnn_convolutions - before;
        let reference = outputs::<Flex>(wide, &Default::default());
        let reference_gradients = gradients::<Autodiff<Flex>>(wide, &Default::default());
        // Each case: the forward, then the forward and both gradients under autodiff.
        if convolutions != 4 * CASES.len() as u64 {
            eprintln!(
                "{convolutions} of {} convolutions went through cuDNN (is libcudnn.so.9 on \
                 LD_LIBRARY_PATH?)",
                4 * CASES.len()
            );
            failed = true;
        }
        let bound = if dtype == DType::F32 { 5e-3 } else { 2e-2 };
        println!("{dtype:?}: gradients' relative error against float64 (input, filter)");
        for ((case, got), want) in CASES
            .iter()
            .zip(&routed_gradients)
            .zip(&reference_gradients)
        {
            let errors = [0, 1].map(|i| relative_error(&got[i], &want[i]));
            let ok = errors.iter().all(|e| *e <= bound);
            failed |= !ok;
            println!(
                "  {:<28} {:.3e}  {:.3e}  {}",
                case.name,
                errors[0],
                errors[1],
                if ok { "ok" } else { "FAILED" }
            );
        }
        if reference_only {
            continue;
        }
        let plain = outputs::<Cuda>(precision, &device);
        println!("{dtype:?}: relative error against float64 (cuDNN, Burn)");
        for ((case, got), (burn, want)) in
            CASES.iter().zip(&routed).zip(plain.iter().zip(&reference))
        {
            let (ours, theirs) = (relative_error(got, want), relative_error(burn, want));
            let ok = ours <= theirs * 1.25 + floor;
            failed |= !ok;
            println!(
                "  {:<28} {ours:.3e}  {theirs:.3e}  {}",
                case.name,
                if ok { "ok" } else { "FAILED" }
            );
        }
    }
    if reference_only {
        std::process::exit(i32::from(failed));
    }
    eprintln!("[{:7.1} s] VAE encode through cuDNN", clock());
    let (cold, warm) = vae_encode::<Routed>(&device);
    println!("FLUX.1 VAE encode 1024², cuDNN: first {cold:.2} s, then {warm:.3} s");
    if std::env::args().any(|a| a == "--burn-vae") {
        eprintln!("[{:7.1} s] VAE encode through Burn's kernels", clock());
        let (cold, warm) = vae_encode::<Cuda>(&device);
        println!("FLUX.1 VAE encode 1024², Burn: first {cold:.2} s, then {warm:.3} s");
    }
    if failed {
        std::process::exit(1);
    }
}
