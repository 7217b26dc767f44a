//! Where a FLUX.1-dev single-stream block spends its training time on `Autodiff<Offload<Cuda>>`:
//! the block as a whole and each of its parts alone, forward and forward + backward, at 1024²
//! (4096 image + 512 text tokens), bf16, with LoRA rank 32 on its two Linears as in
//! `flux_full_step`. The parts are the model's own functions on tensors of the shapes the
//! block hands them; what the whole block takes beyond their sum is its reshapes, splits and
//! copies. The last column scales each part to the 38 single blocks of one checkpointed
//! training step (each block runs a forward, then a forward and a backward).
//!
//! ```text
//! cargo run --release --features cuda --example flux_breakdown [-- --tokens 4608]
//! ```
//!
//! The matrix products, attention and the fused elementwise kernels take the paths
//! `BURNLORA_KERNELS__BLAS`, `__ATTENTION` and `__ELEMENTWISE` set.

mod kernels;
mod timing;

use burn::backend::cuda::CudaDevice;
use burn::backend::{Autodiff, Cuda};
use burn::module::Module;
use burn::tensor::{Distribution, FloatDType, IntDType, Tensor};
use burn_diffusion::blocks::{Modulation, Rope, gelu_tanh, layer_norm, sdpa};
use burn_diffusion::flux::FluxConfig;
use burn_kernels::counters;
use burn_lora::{LoraConfig, LoraPlan};
use burn_offload::Offload;
use timing::{clock, time};

type B = Autodiff<Offload<Cuda>>;
type Device = CudaDevice;

/// The model's layer-norm and RMS-norm epsilon.
const EPS: f64 = 1e-6;
/// The row of the linear1 without its adapter, which only shows what the adapter adds.
const BASE_ONLY_ROW: usize = 2;
/// Single-stream blocks in FLUX.1-dev.
const SINGLE_BLOCKS: f64 = 38.0;

fn random<const D: usize>(shape: [usize; D], device: &Device) -> Tensor<B, D> {
    Tensor::random(shape, Distribution::Normal(0.0, 1.0), device).require_grad()
}

/// Times `loss` forward and forward + backward; prints a row and returns the two, in seconds.
fn measure(name: &str, device: &Device, loss: impl Fn() -> Tensor<B, 1>) -> [f64; 2] {
    eprintln!("[{:7.1} s] {name}", clock());
    let forward = time::<B>(device, 2, 5, || drop(loss()));
    let both = time::<B>(device, 2, 5, || drop(loss().backward()));
    println!(
        "  {name:34} {:9.2} {:9.2} {:9.2} {:9.3}",
        forward * 1e3,
        both * 1e3,
        (both - forward) * 1e3,
        SINGLE_BLOCKS * (forward + both)
    );
    [forward, both]
}

fn main() {
    let _kernels = kernels::install_from_env();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let mut tokens = 4608;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match (flag.as_str(), args.next().and_then(|v| v.parse().ok())) {
            ("--tokens", Some(n)) => tokens = n,
            _ => panic!("usage: flux_breakdown [--tokens N]"),
        }
    }
    let device = Default::default();
    burn::tensor::set_default_dtypes::<B>(&device, FloatDType::BF16, IntDType::I32)
        .expect("bf16 as the default float type");
    let config = FluxConfig {
        depth: 0,
        depth_single_blocks: 1,
        ..FluxConfig::dev()
    };
    let (hidden, heads, head_dim) = (config.hidden_size, config.num_heads, config.head_dim());
    let mlp_hidden = config.mlp_hidden_dim();
    let plan = LoraPlan::new(LoraConfig::new(32))
        .and_then(|plan| plan.include("single_blocks"))
        .expect("a valid LoRA plan");
    let (model, _) = plan.apply(config.init::<B>(&device).no_grad());
    let block = &model.single_blocks[0];

    let img_tokens = tokens - 512.min(tokens / 2);
    let txt_tokens = tokens - img_tokens;
    let side = (img_tokens as f64).sqrt().ceil() as usize;
    let positions: Vec<f64> = (0..txt_tokens)
        .flat_map(|_| [0.0; 3])
        .chain((0..img_tokens).flat_map(|i| [0.0, (i / side) as f64, (i % side) as f64]))
        .collect();
    let pe = Rope::<B>::new(&positions, &config.axes_dim, config.theta, &device);

    let x = random([1, tokens, hidden], &device);
    let modulation = Modulation {
        shift: random([1, 1, hidden], &device),
        scale: random([1, 1, hidden], &device),
        gate: random([1, 1, hidden], &device),
    };
    let [q, k, v] = [0; 3].map(|_| random([1, heads, tokens, head_dim], &device));
    let norm_scale = Tensor::<B, 1>::ones([head_dim], &device);
    let mlp = random([1, tokens, mlp_hidden], &device);
    let attn = random([1, tokens, hidden], &device);
    let joined = random([1, tokens, hidden + mlp_hidden], &device);
    let (img, txt) = (
        random([1, img_tokens, hidden], &device),
        random([1, txt_tokens, hidden], &device),
    );
    let vec = random([1, hidden], &device);

    println!(
        "== FLUX.1-dev single-stream block, {tokens} tokens, bf16, LoRA r32, on Autodiff<Offload<Cuda>>"
    );
    println!(
        "  {:34} {:>9} {:>9} {:>9} {:>9}",
        "part", "fwd ms", "fwd+bwd", "bwd ms", "step s"
    );
    let parts = [
        measure("layer norm + scale/shift", &device, || {
            modulation.scale_shift(layer_norm(x.clone(), EPS)).sum()
        }),
        measure("linear1 (LoRA r32)", &device, || {
            block.linear1.forward(x.clone()).sum()
        }),
        measure("linear1 base only (its LoRA off)", &device, || {
            block.linear1.base().forward(x.clone()).sum()
        }),
        measure("RMS norm + RoPE of q and k", &device, || {
            pe.apply_normalized(q.clone(), norm_scale.clone(), EPS)
                .sum()
                + pe.apply_normalized(k.clone(), norm_scale.clone(), EPS)
                    .sum()
        }),
        measure("attention", &device, || {
            sdpa(q.clone(), k.clone(), v.clone()).sum()
        }),
        measure("GELU (tanh)", &device, || gelu_tanh(mlp.clone()).sum()),
        measure("concatenation of attention | MLP", &device, || {
            Tensor::cat(vec![attn.clone(), mlp.clone()], 2).sum()
        }),
        measure("linear2 (LoRA r32)", &device, || {
            block.linear2.forward(joined.clone()).sum()
        }),
        measure("gate + residual", &device, || {
            (x.clone() + modulation.gate(attn.clone())).sum()
        }),
    ];
    let whole = measure("whole block", &device, || {
        let (img, txt) = block.forward(img.clone(), txt.clone(), vec.clone(), &pe);
        img.sum() + txt.sum()
    });
    // Every row but the base-only one is a part of the block.
    let [forward, both] = [0, 1].map(|i| {
        parts
            .iter()
            .enumerate()
            .filter(|&(row, _)| row != BASE_ONLY_ROW)
            .map(|(_, p)| p[i])
            .sum::<f64>()
    });
    println!(
        "  {:34} {:9.2} {:9.2} {:9.2} {:9.3}",
        "sum of the parts",
        forward * 1e3,
        both * 1e3,
        (both - forward) * 1e3,
        SINGLE_BLOCKS * (forward + both)
    );
    println!(
        "  {:34} {:9.2} {:9.2}",
        "whole block − sum of the parts",
        (whole[0] - forward) * 1e3,
        (whole[1] - both) * 1e3
    );
    println!(
        "{} products through cuBLAS, {} fused attentions, {} fused elementwise ops",
        counters().blas_products,
        counters().fused_attention,
        counters().fused_elementwise
    );
}
