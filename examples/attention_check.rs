//! burn-kernels' fused attention checked on one CUDA GPU: outputs and the gradients of q, k and
//! v compared with the separate-ops attention on the same backend and with a float64 reference
//! on the CPU, for tile-aligned and ragged lengths, both head sizes, cross attention and a
//! strided v; attention at FLUX size is timed first on `Autodiff<Offload<Cuda>>`, forward and
//! forward + backward, with the fused path as the switch sets it (cuDNN's engine where it has
//! one, the project's kernels with `kernels`, the separate ops with `separate`).
//!
//! ```text
//! BURNLORA_KERNELS__BLAS=all cargo run --release --features cuda --example attention_check
//! BURNLORA_KERNELS__ATTENTION=kernels cargo run --release --features cuda --example attention_check   # the project's kernels only
//! BURNLORA_KERNELS__ATTENTION=separate cargo run --release --features cuda --example attention_check   # timing of the separate ops
//! ```
//!
//! With `BURNLORA_KERNELS__BLAS=all` the separate ops' products of the small cases go through cuBLAS
//! too, so the check does not wait on Burn's autotune.
//!
//! The fused kernels compute the probabilities in f32 and round them to bf16 for the second
//! product, as the separate-ops path rounds the softmax's output: a case passes when the fused
//! result is no further from the float64 reference than the separate-ops one (within 25 %, plus
//! 2e-3). The program exits with an error when a case fails or the fused path did not run.

mod checks;
mod kernels;
mod timing;

use burn::backend::{Autodiff, Cuda, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_diffusion::blocks::{ScoreBias, attention, sdpa};
use burn_kernels::counters;
use burn_offload::Offload;
use checks::{Precision, input, relative_error};
use timing::{clock, time};

type Fused = Autodiff<Offload<Cuda>>;

/// One case: `[batch, heads, len_q, len_k, head_dim]`, and whether v is a strided view.
struct Case {
    name: &'static str,
    dims: [usize; 5],
    strided_v: bool,
}

const CASES: [Case; 4] = [
    Case {
        name: "tile-aligned, head 128",
        dims: [1, 3, 128, 128, 128],
        strided_v: false,
    },
    Case {
        name: "ragged 200, head 128, strided v",
        dims: [2, 2, 200, 200, 128],
        strided_v: true,
    },
    Case {
        name: "cross 100 → 300, head 64",
        dims: [1, 2, 100, 300, 64],
        strided_v: false,
    },
    Case {
        name: "one row, head 64",
        dims: [1, 1, 1, 70, 64],
        strided_v: false,
    },
];

/// Which attention [`run`] computes.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// `sdpa`: the fused kernels where they apply.
    Sdpa,
    /// The separate ops, forced by a zero score bias, which only they take.
    Separate,
}

/// Output, then the gradients of q, k and v, of the attention `path` names on `B` for `case`.
fn run<B: AutodiffBackend + burn_kernels::Kernels>(
    case: &Case,
    path: Path,
    precision: Precision,
    device: &B::Device,
) -> [TensorData; 4] {
    let [b, h, lq, lk, d] = case.dims;
    let q = input::<B, 4>([b, h, lq, d], 1, precision, device).require_grad();
    let k = input::<B, 4>([b, h, lk, d], 2, precision, device).require_grad();
    let v = if case.strided_v {
        // [b, lk, h, d] seen as [b, h, lk, d], as a projection split into heads is.
        input::<B, 4>([b, lk, h, d], 3, precision, device)
            .swap_dims(1, 2)
            .require_grad()
    } else {
        input::<B, 4>([b, h, lk, d], 3, precision, device).require_grad()
    };
    let out = match path {
        Path::Sdpa => sdpa(q.clone(), k.clone(), v.clone()),
        Path::Separate => {
            let zero = Tensor::<B, 4>::zeros([1, 1, 1, 1], device).cast(precision.compute);
            let scale = (d as f64).sqrt().recip();
            attention(q.clone(), k.clone(), v.clone(), scale, ScoreBias::Add(zero))
        }
    };
    let r = input::<B, 4>([b, h, lq, d], 4, precision, device);
    let wide = precision.wide();
    let grads = (out.clone().cast(wide) * r.cast(wide)).sum().backward();
    let grad = |t: &Tensor<B, 4>| t.grad(&grads).expect("a gradient").into_data();
    [out.into_data(), grad(&q), grad(&k), grad(&v)]
}

fn main() {
    let _kernels = kernels::install_from_env();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let device = Default::default();
    let mut failed = false;
    let bf16 = Precision {
        input: DType::BF16,
        compute: DType::BF16,
    };
    clock();
    // FLUX.1 at 1024²: 24 heads of 128 over 4096 + 512 tokens.
    eprintln!("[{:7.1} s] timing at FLUX size", clock());
    let shape = [1, 24, 4608, 128];
    let calls = counters();
    let [q, k, v] = [5, 6, 7].map(|seed| input::<Fused, 4>(shape, seed, bf16, &device));
    let forward = time::<Fused>(&device, 2, 10, || {
        drop(sdpa(q.clone(), k.clone(), v.clone()));
    });
    let (q, k, v) = (q.require_grad(), k.require_grad(), v.require_grad());
    let both = time::<Fused>(&device, 2, 10, || {
        let out = sdpa(q.clone(), k.clone(), v.clone());
        drop(out.sum().backward());
    });
    let flop = 4.0 * 24.0 * 4608.0 * 4608.0 * 128.0;
    let ran = counters().since(calls);
    let fused_on = ran.fused_attention > 0;
    let path = match (fused_on, ran.dnn_attention > 0) {
        (false, _) => "separate ops",
        (true, true) => "fused, cuDNN",
        (true, false) => "fused, own kernels",
    };
    println!("== attention [1, 24, 4608, 128] bf16 on Autodiff<Offload<Cuda>>, {path}");
    println!(
        "  forward {:8.3} ms ({:5.0} TFLOP/s) | forward + backward {:8.3} ms",
        forward * 1e3,
        flop / forward / 1e12,
        both * 1e3
    );

    if fused_on {
        println!(
            "== bf16: relative L2 errors (fused vs f64 | separate ops vs f64 | fused vs separate)"
        );
        for case in &CASES {
            eprintln!("[{:7.1} s] {}", clock(), case.name);
            let before = counters();
            let fused = run::<Fused>(case, Path::Sdpa, bf16, &device);
            let ran = counters().since(before);
            if ran.fused_attention != 1 {
                eprintln!("{}: the fused path did not run", case.name);
                failed = true;
            }
            let engine = if ran.dnn_attention == 1 {
                "cuDNN"
            } else {
                "kernels"
            };
            let plain = run::<Fused>(case, Path::Separate, bf16, &device);
            let reference = run::<Autodiff<Flex>>(
                case,
                Path::Sdpa,
                Precision {
                    input: DType::BF16,
                    compute: DType::F64,
                },
                &Default::default(),
            );
            for (i, what) in ["output", "q gradient", "k gradient", "v gradient"]
                .iter()
                .enumerate()
            {
                let ours = relative_error(&fused[i], &reference[i]);
                let burns = relative_error(&plain[i], &reference[i]);
                let ok = ours.is_finite() && ours <= 1.25 * burns + 2e-3;
                failed |= !ok;
                println!(
                    "  {:34} {engine:7} {what:11} {ours:9.2e} | {burns:9.2e} | {:9.2e}  {}",
                    case.name,
                    relative_error(&fused[i], &plain[i]),
                    if ok { "ok" } else { "FAILED" }
                );
            }
        }
    }

    if failed {
        eprintln!("the fused attention differs from the separate ops beyond its tolerance");
        std::process::exit(1);
    }
}
