//! Where the full-size FLUX.1 VAE with random weights first gives non-finite values: the
//! trainer's `random:flux1-dev` VAE (seeded with `train.seed ^ 1` of examples/flux/bench.yaml,
//! created in f32 and cast to the model's dtype) encodes examples/flux/bench_images/blue_gradient.png
//! as the trainer loads it, in bf16 and then in f32, on plain `Cuda` (or `Flex` with `--cpu`).
//!
//! ```text
//! cargo run --release --features cuda --example vae_check [-- --size 1024] [--cpu]
//! ```
//!
//! Each dtype first runs the whole `encode` as the trainer does, then the encoder step by step
//! (every norm, convolution and residual sum of each resnet, the attention's projections, the
//! output convolution), printing for each step its shape, dtype, non-finite count (NaN among
//! them) and largest finite magnitude, and stopping at the first non-finite step. The program
//! exits with an error when any step gave non-finite values.

use std::path::Path;

use burn::backend::{Cuda, Flex};
use burn::nn::Linear;
use burn::tensor::activation::silu;
use burn::tensor::{FloatDType, Tensor};
use burn_diffusion::blocks::sdpa;
use burn_diffusion::materialize;
use burn_diffusion::pipeline::load_image;
use burn_diffusion::vae::{Encoder, ResnetBlock2D, SpatialAttention, VaeConfig, norm_in_f32};

/// The image the trainer reported.
const IMAGE: &str = "examples/flux/bench_images/blue_gradient.png";
/// The trainer's VAE seed: `train.seed` of examples/flux/bench.yaml (42) `^ 1`.
const SEED: u64 = 42 ^ 1;

/// A step gave non-finite values.
#[derive(Debug)]
struct NonFinite;

/// Prints `name` and the statistics of `x`; `Err` when `x` holds a non-finite value.
fn probe<B: burn_kernels::Kernels, const D: usize>(
    name: &str,
    x: Tensor<B, D>,
) -> Result<Tensor<B, D>, NonFinite> {
    let data = x.clone().into_data();
    let (mut bad, mut nan, mut max) = (0usize, 0usize, 0f32);
    for v in data.iter::<f32>() {
        if v.is_finite() {
            max = max.max(v.abs());
        } else {
            bad += 1;
            nan += usize::from(v.is_nan());
        }
    }
    println!(
        "{name:<28} {:<20} {:<5} non-finite {bad:>9} (NaN {nan:>9})  max|x| {max:.4e}",
        format!("{:?}", x.dims()),
        format!("{:?}", x.dtype()),
    );
    if bad == 0 { Ok(x) } else { Err(NonFinite) }
}

/// `ResnetBlock2D::forward`, each step probed.
fn resnet<B: burn_kernels::Kernels>(
    name: &str,
    r: &ResnetBlock2D<B>,
    x: Tensor<B, 4>,
) -> Result<Tensor<B, 4>, NonFinite> {
    let h = probe(
        &format!("{name}.norm1+silu"),
        silu(norm_in_f32(&r.norm1, x.clone())),
    )?;
    let h = probe(&format!("{name}.conv1"), r.conv1.forward(h))?;
    let h = probe(
        &format!("{name}.norm2+silu"),
        silu(norm_in_f32(&r.norm2, h)),
    )?;
    let h = probe(&format!("{name}.conv2"), r.conv2.forward(h))?;
    let shortcut = match &r.conv_shortcut {
        Some(conv) => probe(&format!("{name}.conv_shortcut"), conv.forward(x))?,
        None => x,
    };
    probe(&format!("{name} (sum)"), shortcut + h)
}

/// `SpatialAttention::forward`, each step probed.
fn attention<B: burn_kernels::Kernels>(
    name: &str,
    a: &SpatialAttention<B>,
    x: Tensor<B, 4>,
) -> Result<Tensor<B, 4>, NonFinite> {
    let [b, c, h, w] = x.dims();
    let normed = probe(
        &format!("{name}.group_norm"),
        norm_in_f32(&a.group_norm, x.clone()),
    )?;
    let tokens = normed.reshape([b, c, h * w]).swap_dims(1, 2);
    let head = |label: &str, linear: &Linear<B>| {
        let projected = linear.forward(tokens.clone()).unsqueeze_dim::<4>(1);
        probe(&format!("{name}.{label}"), projected)
    };
    let (q, k, v) = (
        head("to_q", &a.to_q)?,
        head("to_k", &a.to_k)?,
        head("to_v", &a.to_v)?,
    );
    let attended = probe(&format!("{name}.sdpa"), sdpa(q, k, v))?;
    let out = probe(
        &format!("{name}.to_out"),
        a.to_out.forward(attended.squeeze_dim::<3>(1)),
    )?;
    probe(
        &format!("{name} (sum)"),
        out.swap_dims(1, 2).reshape([b, c, h, w]) + x,
    )
}

/// `Encoder::forward`, each step probed.
fn encode<B: burn_kernels::Kernels>(e: &Encoder<B>, x: Tensor<B, 4>) -> Result<(), NonFinite> {
    let mut x = probe("conv_in", e.conv_in.forward(x))?;
    for (i, block) in e.down_blocks.iter().enumerate() {
        for (j, r) in block.resnets.iter().enumerate() {
            x = resnet(&format!("down{i}.resnet{j}"), r, x)?;
        }
        for d in &block.downsamplers {
            x = probe(&format!("down{i}.downsample"), d.forward(x))?;
        }
    }
    let mid = &e.mid_block;
    x = resnet("mid.resnet0", &mid.resnets[0], x)?;
    for (i, r) in mid.resnets.iter().enumerate().skip(1) {
        if let Some(a) = mid.attentions.get(i - 1) {
            x = attention(&format!("mid.attention{}", i - 1), a, x)?;
        }
        x = resnet(&format!("mid.resnet{i}"), r, x)?;
    }
    let x = probe("conv_norm_out+silu", silu(norm_in_f32(&e.conv_norm_out, x)))?;
    probe("conv_out", e.conv_out.forward(x)).map(drop)
}

/// Encodes the image at `size`² with the trainer's random VAE in `dtype`, whole and then step
/// by step; `false` when a non-finite value appeared.
fn check<B: burn_kernels::Kernels>(device: &B::Device, dtype: FloatDType, size: usize) -> bool {
    println!("== {} {dtype:?}, {size}x{size}", B::name(device));
    B::seed(device, SEED);
    let vae = materialize(VaeConfig::flux().init::<B>(device), dtype);
    let pixels = load_image(Path::new(IMAGE), size, size).expect("the benchmark image loads");
    let image = probe(
        "image",
        Tensor::<B, 3>::from_data(pixels, device).unsqueeze::<4>(),
    )
    .expect("the image is finite")
    .cast(dtype);
    let whole = probe("encode (whole).mode", vae.encode(image.clone()).mode()).is_ok();
    encode(&vae.encoder, image).is_ok() && whole
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let (mut size, mut cpu) = (1024, false);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--cpu" => cpu = true,
            "--size" => {
                size = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--size takes a number")
            }
            _ => panic!("usage: vae_check [--size N] [--cpu]"),
        }
    }
    let mut finite = true;
    for dtype in [FloatDType::BF16, FloatDType::F32] {
        finite &= if cpu {
            check::<Flex>(&Default::default(), dtype, size)
        } else {
            check::<Cuda>(&Default::default(), dtype, size)
        };
    }
    if !finite {
        eprintln!("non-finite values appeared");
        std::process::exit(1);
    }
}
