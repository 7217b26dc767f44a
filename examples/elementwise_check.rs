//! burn-kernels' fused elementwise ops checked on one CUDA GPU in bf16: GELU (tanh), layer norm
//! and the q/k RMS norm with the rotary embedding, output and input gradient, on
//! `Autodiff<Offload<Cuda>>` (the fused CubeCL kernels) and on `Autodiff<Cuda>` (the separate
//! ops), both against a reference on the CPU from the same bf16 inputs held in float64 (the
//! norms and the rotation compute in f32 inside, as written).
//!
//! ```text
//! cargo run --release --features cuda --example elementwise_check
//! ```
//!
//! A case passes when the fused result is no further from the reference than the separate ops'
//! (within 25 %, plus 2e-3). The program exits with an error when a case fails or
//! a fused op did not run.

mod checks;
mod kernels;

use burn::backend::{Autodiff, Cuda, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, TensorData};
use burn_diffusion::blocks::{Rope, gelu_tanh, layer_norm};
use burn_kernels::counters;
use burn_offload::Offload;
use checks::{Precision, input, relative_error};

type Fused = Autodiff<Offload<Cuda>>;

/// The ops checked.
#[derive(Clone, Copy, Debug)]
enum Op {
    Gelu,
    LayerNorm,
    NormRope,
}

/// One case: the op and the input's shape (`[batch, heads, tokens, head_dim]` for the norm and
/// rotation, any rank-4 shape otherwise).
const CASES: [(Op, [usize; 4]); 5] = [
    (Op::Gelu, [1, 2, 77, 300]),
    (Op::LayerNorm, [1, 2, 77, 3072]),
    (Op::LayerNorm, [1, 3, 5, 300]),
    (Op::NormRope, [1, 3, 77, 128]),
    (Op::NormRope, [2, 2, 33, 64]),
];

/// Rotary tables for `tokens` tokens of `head_dim` lanes (FLUX's three axes, scaled).
fn rope<B: burn_kernels::Kernels>(tokens: usize, head_dim: usize, device: &B::Device) -> Rope<B> {
    let axes = [head_dim / 8, 7 * head_dim / 16, 7 * head_dim / 16];
    let positions: Vec<f64> = (0..tokens)
        .flat_map(|i| [0.0, (i / 9) as f64, (i % 9) as f64])
        .collect();
    Rope::new(&positions, &axes, 10_000.0, device)
}

/// The op's output on the case's input and the gradient of `Σ r ∘ output` (`r` fixed), on `B`.
fn run<B: AutodiffBackend + burn_kernels::Kernels>(
    op: Op,
    shape: [usize; 4],
    precision: Precision,
    device: &B::Device,
) -> [TensorData; 2] {
    let x = input::<B, 4>(shape, 1, precision, device).require_grad();
    let out = match op {
        Op::Gelu => gelu_tanh(x.clone()),
        Op::LayerNorm => layer_norm(x.clone(), 1e-6),
        Op::NormRope => {
            let [_, _, tokens, dim] = shape;
            let scale = input::<B, 1>([dim], 2, precision, device) + 1.5;
            rope::<B>(tokens, dim, device).apply_normalized(x.clone(), scale, 1e-6)
        }
    };
    let r = input::<B, 4>(shape, 3, precision, device);
    let wide = precision.wide();
    let grads = (out.clone().cast(wide) * r.cast(wide)).sum().backward();
    [
        out.into_data(),
        x.grad(&grads).expect("a gradient").into_data(),
    ]
}

fn main() {
    let _kernels = kernels::install_from_env();
    let device = Default::default();
    let bf16 = Precision {
        input: DType::BF16,
        compute: DType::BF16,
    };
    let f64_reference = Precision {
        input: DType::BF16,
        compute: DType::F64,
    };
    let mut failed = false;
    println!("== bf16: relative L2 errors (fused vs reference | separate ops vs reference)");
    for (op, shape) in CASES {
        let before = counters().fused_elementwise;
        let fused = run::<Fused>(op, shape, bf16, &device);
        if counters().fused_elementwise == before {
            eprintln!(
                "{op:?} {shape:?}: the fused op did not run (BURNLORA_KERNELS__ELEMENTWISE=separate?)"
            );
            failed = true;
        }
        let separate = run::<Autodiff<Cuda>>(op, shape, bf16, &device);
        let reference = run::<Autodiff<Flex>>(op, shape, f64_reference, &Default::default());
        for (i, what) in ["output", "gradient"].iter().enumerate() {
            let ours = relative_error(&fused[i], &reference[i]);
            let theirs = relative_error(&separate[i], &reference[i]);
            let ok = ours.is_finite() && ours <= 1.25 * theirs + 2e-3;
            failed |= !ok;
            println!(
                "  {:28} {what:8} {ours:9.2e} | {theirs:9.2e}  {}",
                format!("{op:?} {shape:?}"),
                if ok { "ok" } else { "FAILED" }
            );
        }
    }
    if failed {
        eprintln!("a fused elementwise op differs from the separate ops beyond its tolerance");
        std::process::exit(1);
    }
}
