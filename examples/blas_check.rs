//! burn-offload's cuBLAS route checked on one CUDA GPU: every routed product is compared with
//! Burn's own kernels and with a float64 reference computed on the CPU (matrix products of odd
//! sizes, transposed views, batched and broadcast operands, a linear layer and attention with
//! their gradients), in f32 and in bf16; then each path is timed on FLUX-sized work.
//!
//! ```text
//! BURNLORA_KERNELS__BLAS=all cargo run --release --features cuda --example blas_check
//! ```
//!
//! `BURNLORA_KERNELS__BLAS=all` sends the small products of the cases to cuBLAS too (by default only
//! those worth the host waits go). `--reference-only` compares the routed products with the
//! float64 reference alone (relative L2 error ≤ 1e-5 in f32, 1e-2 in bf16) and skips Burn's
//! kernels and the timings: a check that a fresh machine finishes in seconds.
//!
//! `Offload<Cuda>` without streamed weights is Burn's CUDA backend with its products sent to
//! cuBLAS; `Cuda` is Burn's own; `Autodiff<Flex>` in float64 on the same inputs (rounded to the
//! tested dtype first) is the reference. Burn's f32 matmul rounds its operands to TF32 on
//! tensor cores while cuBLAS computes in full f32, so the two differ by TF32's rounding (about
//! 5e-4); the check is that the routed result is no further from the reference than Burn's
//! (within 25 %, plus 1e-6 in f32 and 1e-3 in bf16). The program exits with an error when a
//! case fails or when the products did not go through cuBLAS.

mod checks;
mod kernels;
mod timing;

use burn::backend::{Autodiff, Cuda, Flex};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData, module::linear};
use burn_kernels::{Kernels, counters};
use burn_offload::Offload;
use checks::{Precision, input, relative_error};
use timing::{clock, time};

type Routed = Offload<Cuda>;

fn out<B: Backend, const D: usize>(name: &str, t: Tensor<B, D>) -> (String, TensorData) {
    let data = t.into_data().convert::<f64>();
    eprintln!(
        "[{:7.1} s] {name} ({} products through cuBLAS so far)",
        clock(),
        counters().blas_products
    );
    (name.to_string(), data)
}

/// Every checked output, computed on `B` (products, then gradients through autodiff).
fn cases<B: AutodiffBackend + Kernels>(
    dtype: Precision,
    device: &B::Device,
) -> Vec<(String, TensorData)> {
    let mut outs = Vec::new();
    let a = input::<B, 2>([513, 769], 1, dtype, device);
    let b = input::<B, 2>([769, 257], 2, dtype, device);
    outs.push(out("matmul 513x769 · 769x257", a.clone().matmul(b)));
    let bt = input::<B, 2>([257, 769], 3, dtype, device);
    outs.push(out(
        "matmul with a transposed rhs",
        a.matmul(bt.transpose()),
    ));
    let at = input::<B, 2>([769, 300], 4, dtype, device);
    let b = input::<B, 2>([769, 257], 5, dtype, device);
    outs.push(out(
        "matmul with a transposed lhs",
        at.transpose().matmul(b),
    ));
    let x = input::<B, 3>([2, 33, 65], 6, dtype, device);
    let w = input::<B, 3>([1, 65, 31], 7, dtype, device);
    outs.push(out("matmul with a broadcast rhs", x.matmul(w)));
    let w = input::<B, 3>([3, 65, 31], 8, dtype, device);
    let x = input::<B, 3>([1, 33, 65], 9, dtype, device);
    outs.push(out("matmul with a broadcast lhs", x.matmul(w)));

    // A linear layer on [batch, tokens, features], bias included, and its gradients.
    let x = input::<B, 3>([2, 65, 130], 10, dtype, device).require_grad();
    let w = input::<B, 2>([130, 70], 11, dtype, device).require_grad();
    let bias = input::<B, 1>([70], 12, dtype, device).require_grad();
    let y = linear(x.clone(), w.clone(), Some(bias.clone()));
    let r = input::<B, 3>([2, 65, 70], 13, dtype, device);
    let grads = (y.clone() * r).sum().backward();
    outs.push(out("linear forward", y));
    outs.push(out("linear x gradient", x.grad(&grads).unwrap()));
    outs.push(out("linear weight gradient", w.grad(&grads).unwrap()));
    outs.push(out("linear bias gradient", bias.grad(&grads).unwrap()));

    // A LoRA layer: the up factor's product accumulated into the base's output (scaled), and
    // the gradients of every operand.
    let x = input::<B, 3>([2, 65, 130], 18, dtype, device).require_grad();
    let w = input::<B, 2>([130, 70], 19, dtype, device).require_grad();
    let down = input::<B, 2>([130, 8], 20, dtype, device).require_grad();
    let up = input::<B, 2>([8, 70], 21, dtype, device).require_grad();
    let y = linear(x.clone(), w.clone(), None);
    let h = burn_kernels::linear(x.clone(), down.clone(), None);
    let lora = burn_kernels::linear_add(h, up.clone(), y, 0.5);
    let r = input::<B, 3>([2, 65, 70], 22, dtype, device);
    let grads = (lora.clone() * r).sum().backward();
    outs.push(out("LoRA forward", lora));
    outs.push(out("LoRA x gradient", x.grad(&grads).unwrap()));
    outs.push(out("LoRA base gradient", w.grad(&grads).unwrap()));
    outs.push(out("LoRA down gradient", down.grad(&grads).unwrap()));
    outs.push(out("LoRA up gradient", up.grad(&grads).unwrap()));

    // A LoRA layer on a frozen base (`lora_linear`, down and up as a layer passes them): its
    // three products in one ordering, and the five of its gradients likewise.
    let x = input::<B, 3>([2, 65, 130], 23, dtype, device).require_grad();
    let w = input::<B, 2>([130, 70], 24, dtype, device);
    let bias = input::<B, 1>([70], 25, dtype, device);
    let down = input::<B, 2>([8, 130], 26, dtype, device).require_grad();
    let up = input::<B, 2>([70, 8], 27, dtype, device).require_grad();
    let lora = burn_kernels::lora_linear(
        x.clone(),
        w,
        Some(bias),
        down.clone().transpose(),
        up.clone().transpose(),
        0.5,
    );
    let r = input::<B, 3>([2, 65, 70], 28, dtype, device);
    let grads = (lora.clone() * r).sum().backward();
    outs.push(out("fused LoRA forward", lora));
    outs.push(out("fused LoRA x gradient", x.grad(&grads).unwrap()));
    outs.push(out("fused LoRA down gradient", down.grad(&grads).unwrap()));
    outs.push(out("fused LoRA up gradient", up.grad(&grads).unwrap()));

    // Attention as explicit products (kᵀ a transposed view), and its gradients.
    let q = input::<B, 4>([2, 3, 77, 64], 14, dtype, device).require_grad();
    let k = input::<B, 4>([2, 3, 77, 64], 15, dtype, device).require_grad();
    let v = input::<B, 4>([2, 3, 77, 64], 16, dtype, device).require_grad();
    let scores = q.clone().matmul(k.clone().swap_dims(2, 3)) * 0.125;
    let wide = dtype.wide();
    let o = softmax(scores.cast(wide), 3)
        .cast(dtype.compute)
        .matmul(v.clone());
    let r = input::<B, 4>([2, 3, 77, 64], 17, dtype, device);
    let grads = (o.clone() * r).sum().backward();
    outs.push(out("attention output", o));
    outs.push(out("attention q gradient", q.grad(&grads).unwrap()));
    outs.push(out("attention k gradient", k.grad(&grads).unwrap()));
    outs.push(out("attention v gradient", v.grad(&grads).unwrap()));
    outs
}

/// Seconds per call for each timed workload on `B`, with their FLOP.
fn timings<B: Backend>(device: &B::Device) -> Vec<(&'static str, f64, f64)> {
    let bf16 = Precision {
        input: DType::BF16,
        compute: DType::BF16,
    };
    let mut rows = Vec::new();
    let n = 8192;
    let a = input::<B, 2>([n, n], 1, bf16, device);
    let b = input::<B, 2>([n, n], 2, bf16, device);
    let t = time::<B>(device, 3, 20, || drop(a.clone().matmul(b.clone())));
    rows.push(("bf16 GEMM 8192³", t, 2.0 * (n as f64).powi(3)));

    // FLUX's MLP: 4608 tokens, 3072 → 12288 → 3072, gelu between, 20 layers.
    let (tokens, hidden, inner, layers) = (4608, 3072, 12288, 20);
    let w1 = input::<B, 2>([hidden, inner], 3, bf16, device);
    let w2 = input::<B, 2>([inner, hidden], 4, bf16, device);
    let x = input::<B, 3>([1, tokens, hidden], 5, bf16, device);
    let t = time::<B>(device, 1, 3, || {
        let mut h = x.clone();
        for _ in 0..layers {
            h = linear(gelu(linear(h, w1.clone(), None)), w2.clone(), None) * 0.01;
        }
        drop(h);
    });
    let flop = layers as f64 * 4.0 * (tokens * hidden * inner) as f64;
    rows.push(("FLUX MLP x20 (linear, gelu, linear)", t, flop));

    // Attention's two products at FLUX size: [1, 24, 4608, 128].
    let shape = [1, 24, 4608, 128];
    let (q, k, v) = (
        input::<B, 4>(shape, 6, bf16, device),
        input::<B, 4>(shape, 7, bf16, device),
        input::<B, 4>(shape, 8, bf16, device),
    );
    let t = time::<B>(device, 2, 10, || {
        let p = softmax(
            q.clone().matmul(k.clone().swap_dims(2, 3)).cast(DType::F32),
            3,
        );
        drop(p.cast(DType::BF16).matmul(v.clone()));
    });
    rows.push((
        "attention q·kᵀ, softmax, ·v (FLUX size)",
        t,
        4.0 * 24.0 * 4608.0 * 4608.0 * 128.0,
    ));

    // Small products: what each routed call costs beyond its arithmetic.
    let s = input::<B, 2>([256, 256], 9, bf16, device);
    let t = time::<B>(device, 10, 500, || drop(s.clone().matmul(s.clone())));
    rows.push(("bf16 GEMM 256³ (per call)", t, 2.0 * 256f64.powi(3)));
    rows
}

/// Relative L2 error against float64 that a routed product passes without Burn's result to
/// compare with (`--reference-only`): f32 and bf16 rounding of the operands and the output.
fn reference_bound(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-5 } else { 1e-2 }
}

fn main() {
    let _kernels = kernels::install_from_env();
    // `--reference-only`: the routed products against float64 alone, without Burn's kernels
    // (which tune themselves for minutes on a fresh machine) and without the timings.
    let reference_only = std::env::args().any(|a| a == "--reference-only");
    let device = Default::default();
    let mut failed = false;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    clock();
    for (dtype, floor) in [(DType::F32, 1e-6), (DType::BF16, 1e-3)] {
        let precision = Precision {
            input: dtype,
            compute: dtype,
        };
        eprintln!("[{:7.1} s] {dtype:?} through cuBLAS", clock());
        let before = counters();
        let routed = cases::<Autodiff<Routed>>(precision, &device);
        let after = counters().since(before);
        let (products, accumulated) = (after.blas_products, after.blas_accumulated);
        let (plain, plain_products) = if reference_only {
            (None, 0)
        } else {
            eprintln!("[{:7.1} s] {dtype:?} through Burn's kernels", clock());
            let before = counters();
            let plain = cases::<Autodiff<Cuda>>(precision, &device);
            (Some(plain), counters().since(before).blas_products)
        };
        eprintln!("[{:7.1} s] {dtype:?} inputs in float64 on the CPU", clock());
        let reference = cases::<Autodiff<Flex>>(
            Precision {
                input: dtype,
                compute: DType::F64,
            },
            &Default::default(),
        );
        // The cases hold 31 products (5 matmuls, 3 for the linear layer, 9 for the LoRA layer,
        // 8 for the LoRA layer in one ordering, 6 for attention), three of them accumulated:
        // fewer means some fell back to Burn. On Burn's backend only the entry points of
        // burn-kernels reach cuBLAS: the LoRA layer's down factor and its accumulated up
        // factor, forward and backward (6 products), and the one-ordering layer (8).
        if products < 31 || accumulated != 3 || plain_products > 14 {
            eprintln!(
                "{products} products went through cuBLAS, {accumulated} accumulated, \
                 {plain_products} on Burn's backend: the route was not taken as planned \
                 (is BURNLORA_KERNELS__BLAS=all set?)"
            );
            failed = true;
        }
        println!("== {dtype:?}: relative L2 errors (cuBLAS vs f64 | Burn vs f64 | cuBLAS vs Burn)");
        for (i, ((name, routed), (_, reference))) in routed.iter().zip(&reference).enumerate() {
            let ours = relative_error(routed, reference);
            let (ok, burns, apart) = match &plain {
                Some(plain) => {
                    let burns = relative_error(&plain[i].1, reference);
                    let apart = relative_error(routed, &plain[i].1);
                    (ours <= 1.25 * burns + floor, burns, apart)
                }
                None => (ours <= reference_bound(dtype), f64::NAN, f64::NAN),
            };
            failed |= !ok;
            println!(
                "  {name:32} {ours:9.2e} | {burns:9.2e} | {apart:9.2e}  {}",
                if ok { "ok" } else { "FAILED" }
            );
        }
    }
    if !reference_only {
        eprintln!("[{:7.1} s] timing cuBLAS", clock());
        let routed = timings::<Routed>(&device);
        eprintln!("[{:7.1} s] timing Burn's kernels", clock());
        let plain = timings::<Cuda>(&device);
        println!("== timings, bf16 (seconds per call, TFLOP/s)");
        for ((name, tr, flop), (_, tp, _)) in routed.iter().zip(&plain) {
            println!(
                "  {name:40} cuBLAS {:9.3} ms {:6.0} TFLOP/s | Burn {:9.3} ms {:6.0} TFLOP/s | \
                 {:.2}x",
                tr * 1e3,
                flop / tr / 1e12,
                tp * 1e3,
                flop / tp / 1e12,
                tp / tr
            );
        }
    }
    if counters().blas_products == 0 {
        failed = true;
    }
    if failed {
        eprintln!("a routed product differs from its reference beyond its tolerance");
        std::process::exit(1);
    }
}
