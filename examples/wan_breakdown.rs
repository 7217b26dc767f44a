//! Where a Wan 2.1 14B-shaped transformer (random bf16 weights, LoRA rank 32 on every Linear of
//! its blocks, as `examples/wan/bench.yaml`) spends its training time on
//! `Autodiff<Offload<Cuda>>`, at 33 frames of 480×832 (14,040 tokens, 512 text tokens): one
//! block and each kind of part alone, forward and forward + backward. The last column scales
//! each part by how often one checkpointed training step runs it (each part runs a forward,
//! then a forward and a backward). benches/wan_breakdown.py prints the same rows for
//! diffusers' modules on PyTorch.
//!
//! ```text
//! cargo run --release --features cuda --example wan_breakdown
//! ```
//!
//! The matrix products, attention and the fused elementwise kernels take the paths
//! `BURNLORA_KERNELS__BLAS`, `__ATTENTION` and `__ELEMENTWISE` set.

mod breakdown;
mod kernels;
mod timing;

use breakdown::{B, measure, random};
use burn::module::Module;
use burn::tensor::{DType, FloatDType, IntDType, Tensor};
use burn_diffusion::blocks::{Rope, gelu_tanh, layer_norm, rms_norm, sdpa};
use burn_diffusion::wan::WanConfig;
use burn_kernels::counters;
use burn_lora::{LoraConfig, LoraPlan};

/// Latent frames, rows and columns of patches: 33 frames of 480×832.
const GRID: [usize; 3] = [9, 30, 52];
/// Text tokens the captions are padded to.
const TEXT: usize = 512;

fn main() {
    let _kernels = kernels::install_from_env();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let device = Default::default();
    burn::tensor::set_default_dtypes::<B>(&device, FloatDType::BF16, IntDType::I32)
        .expect("bf16 as the default float type");
    let config = WanConfig {
        num_layers: 1,
        ..WanConfig::wan21_14b()
    };
    let plan = LoraPlan::new(LoraConfig::new(32))
        .and_then(|plan| plan.include("^blocks\\."))
        .expect("a valid LoRA plan");
    let (model, _) = plan.apply(config.init::<B>(&device).no_grad());
    let block = &model.blocks[0];
    let width = config.inner_dim();
    let [f, h, w] = GRID;
    let tokens = f * h * w;
    let positions: Vec<f64> = (0..f)
        .flat_map(|t| (0..h).flat_map(move |y| (0..w).flat_map(move |x| [t, y, x])))
        .map(|p| p as f64)
        .collect();
    let rope = Rope::<B>::new(&positions, &config.rope_axes(), 10000.0, &device);
    let x = random([1, tokens, width], &device);
    let context = random([1, TEXT, width], &device);
    let modulation = random([1, 6, width], &device);
    let heads = |t: Tensor<B, 3>, rows: usize| {
        t.reshape([
            1,
            rows,
            config.num_attention_heads,
            config.attention_head_dim,
        ])
        .swap_dims(1, 2)
    };
    let layers = WanConfig::wan21_14b().num_layers;

    println!(
        "== Wan 2.1 14B block at 33 × 480 × 832 ({tokens} tokens), bf16, LoRA r32, on Autodiff<Offload<Cuda>>"
    );
    println!(
        "  {:40} {:>9} {:>9} {:>6} {:>9}",
        "part", "fwd ms", "fwd+bwd", "uses", "step s"
    );
    let per_block = |n: usize| (n * layers) as f64;
    let parts = [
        measure("self-attention module", per_block(1), &device, || {
            block
                .attn1
                .forward(x.clone(), None, Some(&rope), &config)
                .sum()
        }),
        measure("cross-attention module", per_block(1), &device, || {
            block
                .attn2
                .forward(x.clone(), Some(context.clone()), None, &config)
                .sum()
        }),
        measure("feed-forward", per_block(1), &device, || {
            block.ffn.forward(x.clone()).sum()
        }),
    ];
    let whole = measure("block", per_block(1), &device, || {
        block
            .forward(
                x.clone(),
                context.clone(),
                modulation.clone(),
                &rope,
                &config,
            )
            .sum()
    });
    println!(
        "  {:40} {:>9} {:>9} {:>6} {:9.3}",
        "block beyond its three modules",
        "",
        "",
        "",
        whole - parts.iter().sum::<f64>()
    );
    println!("  of which:");
    measure(
        "  attention, self, 40 heads of 128",
        per_block(1),
        &device,
        || {
            sdpa(
                heads(x.clone(), tokens),
                heads(x.clone(), tokens),
                heads(x.clone(), tokens),
            )
            .sum()
        },
    );
    measure(
        "  attention, cross to 512 tokens",
        per_block(1),
        &device,
        || {
            sdpa(
                heads(x.clone(), tokens),
                heads(context.clone(), TEXT),
                heads(context.clone(), TEXT),
            )
            .sum()
        },
    );
    measure("  LoRA Linear 5120 → 5120", per_block(6), &device, || {
        block.attn1.to_q.forward(x.clone()).sum()
    });
    measure(
        "  LoRA Linear 5120 → 13824",
        per_block(1),
        &device,
        || block.ffn.net.0.proj.forward(x.clone()).sum(),
    );
    measure(
        "  RMS norm across heads + rotary, fused",
        per_block(2),
        &device,
        || {
            let scale = block.attn1.norm_q.weight.val();
            let heads = config.num_attention_heads;
            rope.apply_normalized_across_heads(x.clone(), scale, heads, config.eps)
                .sum()
        },
    );
    measure(
        "  RMS norm across heads (5120)",
        per_block(1),
        &device,
        || rms_norm(x.clone(), block.attn1.norm_q.weight.val(), config.eps).sum(),
    );
    measure("  layer norm in f32", per_block(3), &device, || {
        layer_norm(x.clone().cast(DType::F32), config.eps)
            .cast(DType::BF16)
            .sum()
    });
    let hidden = random([1, tokens, config.ffn_dim], &device);
    measure("  GELU (tanh) 13824", per_block(1), &device, || {
        gelu_tanh(hidden.clone()).sum()
    });

    println!(
        "{} products through cuBLAS, {} fused attentions, {} fused elementwise ops",
        counters().blas_products,
        counters().fused_attention,
        counters().fused_elementwise
    );
}
