//! Where an SDXL-base-shaped UNet (random bf16 weights, LoRA rank 32 on every Linear of its
//! transformer blocks, as `examples/sdxl/bench.yaml`) spends its training time on
//! `Autodiff<Offload<Cuda>>`, at 1024² (a 128² latent): each kind of part alone, forward and
//! forward + backward, at the shapes the UNet hands it. The last column scales each part by how often one checkpointed training step
//! runs it (each part runs a forward, then a forward and a backward). benches/sdxl_breakdown.py
//! prints the same rows for diffusers' modules on PyTorch.
//!
//! ```text
//! cargo run --release --features cuda --example sdxl_breakdown
//! ```
//!
//! The matrix products, attention and the fused elementwise kernels take the paths
//! `BURNLORA_KERNELS__BLAS`, `__ATTENTION` and `__ELEMENTWISE` set.

mod breakdown;
mod kernels;
mod timing;

use breakdown::{B, measure, random};
use burn::module::Module;
use burn::tensor::{FloatDType, IntDType, Tensor};
use burn_diffusion::blocks::sdpa;
use burn_diffusion::sdxl::UNetConfig;
use burn_diffusion::vae::norm_in_f32;
use burn_kernels::counters;
use burn_lora::{LoraConfig, LoraPlan};

fn main() {
    let _kernels = kernels::install_from_env();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let device = Default::default();
    burn::tensor::set_default_dtypes::<B>(&device, FloatDType::BF16, IntDType::I32)
        .expect("bf16 as the default float type");
    let plan = LoraPlan::new(LoraConfig::new(32))
        .and_then(|plan| plan.include("attentions"))
        .expect("a valid LoRA plan");
    let (unet, _) = plan.apply(UNetConfig::sdxl().init::<B>(&device).no_grad());
    let temb = random([1, 1280], &device);
    let context = random([1, 77, 2048], &device);
    let latent = |channels: usize, side: usize| random([1, channels, side, side], &device);
    let tokens = |width: usize, count: usize| random([1, count, width], &device);
    let (x320, x640, x1280) = (latent(320, 128), latent(640, 64), latent(1280, 32));
    let (t640, t1280) = (tokens(640, 4096), tokens(1280, 1024));

    println!(
        "== SDXL-base UNet parts at 1024², bf16, LoRA r32 on the attentions, on Autodiff<Offload<Cuda>>"
    );
    println!(
        "  {:40} {:>9} {:>9} {:>6} {:>9}",
        "part", "fwd ms", "fwd+bwd", "uses", "step s"
    );
    let down = |level: usize| &unet.down_blocks[level];
    let block = |level: usize| &down(level).attentions[0].transformer_blocks[0];
    let parts = [
        measure("ResNet 320, 128² (down 0.0)", 5.0, &device, || {
            down(0).resnets[0].forward(x320.clone(), temb.clone()).sum()
        }),
        measure("ResNet 640, 64² (down 1.1)", 5.0, &device, || {
            down(1).resnets[1].forward(x640.clone(), temb.clone()).sum()
        }),
        measure("ResNet 1280, 32² (down 2.1)", 7.0, &device, || {
            down(2).resnets[1]
                .forward(x1280.clone(), temb.clone())
                .sum()
        }),
        measure(
            "transformer block 640 × 4096 tokens",
            10.0,
            &device,
            || block(1).forward(t640.clone(), context.clone()).sum(),
        ),
        measure(
            "transformer block 1280 × 1024 tokens",
            60.0,
            &device,
            || block(2).forward(t1280.clone(), context.clone()).sum(),
        ),
    ];
    println!(
        "  {:40} {:>9} {:>9} {:>6} {:9.3}",
        "sum of the parts × uses",
        "",
        "",
        "",
        parts.iter().sum::<f64>()
    );
    println!("  of which:");
    let resnet = &down(0).resnets[0];
    measure(
        "  group norm 320, 128² (f32 statistics)",
        34.0,
        &device,
        || norm_in_f32(&resnet.norm1, x320.clone()).sum(),
    );
    measure("  convolution 3×3 320, 128²", 10.0, &device, || {
        resnet.conv1.forward(x320.clone()).sum()
    });
    let proj = &resnet.time_emb_proj;
    measure(
        "  time-embedding product 1 × 1280 × 320",
        17.0,
        &device,
        || proj.forward(temb.clone()).sum(),
    );
    let attention = block(1);
    let heads = |t: &Tensor<B, 3>| t.clone().reshape([1, 4096, 10, 64]).swap_dims(1, 2);
    measure(
        "  attention 4096 tokens, 10 heads of 64",
        10.0,
        &device,
        || sdpa(heads(&t640), heads(&t640), heads(&t640)).sum(),
    );
    measure("  self-attention module 640 × 4096", 10.0, &device, || {
        attention.attn1.forward(t640.clone(), t640.clone()).sum()
    });
    measure("  feed-forward (GEGLU) 640 × 4096", 10.0, &device, || {
        attention.ff.forward(t640.clone()).sum()
    });
    measure("  feed-forward (GEGLU) 1280 × 1024", 60.0, &device, || {
        block(2).ff.forward(t1280.clone()).sum()
    });

    println!(
        "{} products through cuBLAS, {} fused attentions, {} fused elementwise ops",
        counters().blas_products,
        counters().fused_attention,
        counters().fused_elementwise
    );
}
