//! The offload engine on the GPU: a FLUX-shaped stack of frozen Linear layers (MLP pairs
//! hidden → mlp → hidden, bf16) with trainable LoRA on each, one training step = forward +
//! backward. Times the step with every weight resident, then streamed under several VRAM budgets
//! and wire formats, and once without lookahead (each weight fetched when its op needs it), all
//! in one run; prints a markdown table with the ratio streamed/resident and the upload rate.
//!
//! Build here, run on the GPU machine (see benches/RESULTS.md, section "Offload (issue 4)"):
//! `cargo build --release --features cuda --bench offload`, then
//! `offload-<hash> --pairs 160 --tokens 4608 --budgets 0,12,24 --wires bf16,e5m2`.
//! `--check` first compares streamed and resident outputs bit for bit (and FP8 against bf16);
//! `--decode-ahead` has the loader decode the FP8 weights ahead of their use.

use std::time::Instant;

use burn::backend::{Autodiff, Cuda};
use burn::module::{Module, Param, ParamId};
use burn::nn::Linear;
use burn::tensor::activation::gelu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use burn_offload::{
    Offload, OffloadBackend, OffloadConfig, OnDemand, StepStats, WeightStream, WireFormat,
};
use half::bf16;
use rayon::prelude::*;

#[derive(Module, Debug)]
struct LoraLinear<B: Backend> {
    base: Linear<B>,
    a: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 2>>,
}

impl<B: Backend> LoraLinear<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.base.forward(x.clone()) + x.matmul(self.a.val()).matmul(self.b.val())
    }
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    up: LoraLinear<B>,
    down: LoraLinear<B>,
}

#[derive(Module, Debug)]
struct Stack<B: Backend> {
    layers: Vec<Mlp<B>>,
}

impl<B: Backend> Stack<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.layers.iter().fold(x, |x, mlp| {
            x.clone() + mlp.down.forward(gelu(mlp.up.forward(x)))
        })
    }
}

struct Args {
    pairs: usize,
    tokens: usize,
    hidden: usize,
    mlp: usize,
    rank: usize,
    slots: usize,
    warmup: usize,
    steps: usize,
    budgets_gb: Vec<f64>,
    wires: Vec<WireFormat>,
    decode_ahead: bool,
    check: bool,
}

impl Args {
    fn parse() -> Self {
        let mut args = Args {
            pairs: 160,
            tokens: 4608,
            hidden: 3072,
            mlp: 12288,
            rank: 32,
            slots: 3,
            warmup: 2,
            steps: 3,
            budgets_gb: vec![0.0, 12.0, 24.0],
            wires: vec![WireFormat::Native, WireFormat::E5M2],
            decode_ahead: false,
            check: false,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
            let number = |v: String| -> usize { v.parse().unwrap_or_else(|_| panic!("{v}")) };
            match flag.as_str() {
                "--pairs" => args.pairs = number(value()),
                "--tokens" => args.tokens = number(value()),
                "--hidden" => args.hidden = number(value()),
                "--mlp" => args.mlp = number(value()),
                "--rank" => args.rank = number(value()),
                "--slots" => args.slots = number(value()),
                "--warmup" => args.warmup = number(value()),
                "--steps" => args.steps = number(value()),
                "--budgets" => {
                    args.budgets_gb = value().split(',').map(|b| b.parse().unwrap()).collect()
                }
                "--wires" => {
                    args.wires = value()
                        .split(',')
                        .map(|w| match w {
                            "bf16" => WireFormat::Native,
                            "e5m2" => WireFormat::E5M2,
                            "e4m3" => WireFormat::E4M3,
                            other => panic!("unknown wire format {other}"),
                        })
                        .collect()
                }
                "--decode-ahead" => args.decode_ahead = true,
                "--check" => args.check = true,
                // cargo bench passes --bench
                "--bench" => {}
                other => panic!("unknown flag {other}"),
            }
        }
        args
    }

    fn weight_bytes(&self) -> u64 {
        (self.pairs * 2 * self.hidden * self.mlp * 2) as u64
    }
}

/// Deterministic bf16 values uniform in [-scale, scale], generated on all cores.
fn bf16_values(seed: u64, n: usize, scale: f32) -> Vec<u8> {
    const CHUNK: usize = 1 << 16;
    let mut bytes = vec![0u8; n * 2];
    bytes
        .par_chunks_mut(CHUNK * 2)
        .enumerate()
        .for_each(|(c, out)| {
            let mut s = (seed << 32) ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for v in out.chunks_exact_mut(2) {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                v.copy_from_slice(&bf16::from_f32(u * scale).to_le_bytes());
            }
        });
    bytes
}

fn lora_linear<B: OffloadBackend + AutodiffBackend>(
    stream: &WeightStream<B>,
    name: &str,
    seed: u64,
    [d_in, d_out]: [usize; 2],
    scale: f32,
    rank: usize,
    device: &B::Device,
) -> LoraLinear<B> {
    let data = TensorData::from_bytes_vec(
        bf16_values(seed, d_in * d_out, scale),
        [d_in, d_out],
        DType::BF16,
    );
    let weight = stream.streamed_tensor::<2>(name, data).unwrap();
    let lora = |shape: [usize; 2], std: f64| {
        let t =
            Tensor::<B, 2>::random(shape, Distribution::Normal(0.0, std), (device, DType::BF16));
        Param::from_tensor(t)
    };
    LoraLinear {
        base: Linear {
            weight: Param::initialized(ParamId::new(), weight),
            bias: None,
        },
        a: lora([d_in, rank], 0.01),
        b: lora([rank, d_out], 0.01),
    }
}

/// The stack, its frozen weights generated on the host and kept there by `stream`.
fn build<B: OffloadBackend + AutodiffBackend>(
    stream: &WeightStream<B>,
    args: &Args,
    device: &B::Device,
) -> Stack<B> {
    let (h, m) = (args.hidden, args.mlp);
    let layers = (0..args.pairs as u64)
        .map(|i| Mlp {
            up: lora_linear(
                stream,
                &format!("layers.{i}.up"),
                2 * i,
                [h, m],
                1.7 / (h as f32).sqrt(),
                args.rank,
                device,
            ),
            down: lora_linear(
                stream,
                &format!("layers.{i}.down"),
                2 * i + 1,
                [m, h],
                0.17 / (m as f32).sqrt(),
                args.rank,
                device,
            ),
        })
        .collect();
    Stack { layers }
}

/// The input activations, the same for every run.
fn input<B: Backend>(args: &Args, device: &B::Device) -> Tensor<B, 2> {
    let shape = [args.tokens, args.hidden];
    let values = bf16_values(u64::MAX, shape[0] * shape[1], 1.0);
    Tensor::from_data(
        TensorData::from_bytes_vec(values, shape, DType::BF16),
        device,
    )
}

/// One training step (forward + backward, completed on the device): seconds, stats, output.
fn step<B: OffloadBackend + AutodiffBackend>(
    stream: &WeightStream<B>,
    model: &Stack<B>,
    x: &Tensor<B, 2>,
    keep_output: bool,
) -> (f64, StepStats, Option<TensorData>) {
    let device = x.device();
    B::sync(&device).unwrap();
    let started = Instant::now();
    stream.begin_step();
    let out = model.forward(x.clone());
    let grads = out.clone().mean().backward();
    B::sync(&device).unwrap();
    let stats = stream.end_step();
    let seconds = started.elapsed().as_secs_f64();
    drop(grads);
    let output = keep_output.then(|| out.into_data());
    (seconds, stats, output)
}

struct Row {
    label: String,
    seconds: f64,
    stats: StepStats,
}

/// Runs `warmup` then `steps` steps with `budget` bytes and returns the mean step time and the
/// last step's statistics.
fn measure<B: OffloadBackend + AutodiffBackend>(
    stream: &WeightStream<B>,
    model: &Stack<B>,
    x: &Tensor<B, 2>,
    label: String,
    budget: u64,
    args: &Args,
) -> Row {
    stream
        .reconfigure(stream.config().with_vram_budget(budget))
        .unwrap();
    for _ in 0..args.warmup {
        step(stream, model, x, false);
    }
    let mut total = 0.0;
    let mut last = None;
    for _ in 0..args.steps {
        let (seconds, stats, _) = step(stream, model, x, false);
        total += seconds;
        last = Some(stats);
    }
    let row = Row {
        label,
        seconds: total / args.steps as f64,
        stats: last.unwrap(),
    };
    eprintln!("{}: {:.3} s/step {:?}", row.label, row.seconds, row.stats);
    row
}

fn config(args: &Args, wire: WireFormat) -> OffloadConfig {
    OffloadConfig::default()
        .with_ring_slots(args.slots)
        .with_wire(wire)
        .with_decode_ahead(args.decode_ahead)
}

fn wire_name(wire: WireFormat) -> &'static str {
    match wire {
        WireFormat::Native | WireFormat::Bf16 => "bf16",
        WireFormat::E5M2 => "e5m2",
        WireFormat::E4M3 => "e4m3",
    }
}

/// Streamed and resident outputs of a small stack must be identical (same kernels, same
/// weights, slots poisoned on release), e5m2 decoded at each use and by the loader alike;
/// prints how far the e5m2 stack is from the bf16 one.
fn check(args: &Args, device: &burn::tensor::Device<Cuda>) {
    type B = Autodiff<Offload<Cuda>>;
    let mut outputs = Vec::new();
    for (wire, decode_ahead) in [
        (WireFormat::Native, false),
        (WireFormat::E5M2, false),
        (WireFormat::E5M2, true),
    ] {
        let config = config(args, wire)
            .with_decode_ahead(decode_ahead)
            .with_poisoning(true);
        let stream = WeightStream::<B>::new(device, config).unwrap();
        let model = build(&stream, args, device);
        let x = input::<B>(args, device);
        let mut per_budget = Vec::new();
        for budget in [0, u64::MAX] {
            stream
                .reconfigure(stream.config().with_vram_budget(budget))
                .unwrap();
            for _ in 0..2 {
                let (_, stats, out) = step(&stream, &model, &x, true);
                let wire = wire_name(wire);
                eprintln!("check {wire} decode_ahead {decode_ahead} budget {budget}: {stats:?}");
                per_budget.push(out.unwrap());
            }
        }
        let first = per_budget[0].clone();
        for (i, out) in per_budget.iter().enumerate() {
            assert_eq!(
                out,
                &first,
                "{} run {i} differs from the first",
                wire_name(wire)
            );
        }
        let values: Vec<f32> = first.convert::<f32>().to_vec().unwrap();
        assert!(values.iter().all(|v| v.is_finite()), "non-finite output");
        outputs.push(values);
    }
    let bits = |values: &[f32]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&outputs[2]),
        bits(&outputs[1]),
        "e5m2 decoded by the loader differs from e5m2 decoded at each use"
    );
    let (exact, fp8) = (&outputs[0], &outputs[1]);
    let err = exact
        .iter()
        .zip(fp8)
        .map(|(a, b)| (a - b).abs())
        .sum::<f32>()
        / exact.iter().map(|a| a.abs()).sum::<f32>();
    println!(
        "check: streamed == resident bit for bit (bf16, e5m2, e5m2 decoded ahead); e5m2 vs bf16 mean relative error {err:.4}"
    );
}

fn main() {
    let args = Args::parse();
    let device = Default::default();
    if args.check {
        check(&args, &device);
    }
    let gb = |b: f64| (b * 1e9) as u64;
    let mut rows = Vec::new();
    for (w, &wire) in args.wires.iter().enumerate() {
        type B = Autodiff<Offload<Cuda>>;
        let stream = WeightStream::<B>::new(&device, config(&args, wire)).unwrap();
        let started = Instant::now();
        let model = build(&stream, &args, &device);
        eprintln!(
            "built {} weights ({}) in {:.1} s",
            args.pairs * 2,
            wire_name(wire),
            started.elapsed().as_secs_f64()
        );
        let x = input::<B>(&args, &device);
        if w == 0 {
            rows.push(measure(
                &stream,
                &model,
                &x,
                "resident".into(),
                u64::MAX,
                &args,
            ));
        }
        for &budget in &args.budgets_gb {
            let label = format!("streamed {}, budget {budget} GB", wire_name(wire));
            rows.push(measure(&stream, &model, &x, label, gb(budget), &args));
        }
    }
    {
        type B = Autodiff<Offload<Cuda, OnDemand>>;
        let stream = WeightStream::<B>::new(&device, config(&args, WireFormat::Native)).unwrap();
        let model = build(&stream, &args, &device);
        let x = input::<B>(&args, &device);
        rows.push(measure(
            &stream,
            &model,
            &x,
            "no lookahead, bf16, budget 0 GB".into(),
            0,
            &args,
        ));
    }

    let resident = rows[0].seconds;
    println!(
        "\n{} MLP pairs ({} frozen Linear, {:.1} GB bf16), {} tokens, hidden {}, mlp {}, LoRA rank {}, ring of {} slots; step = forward + backward\n",
        args.pairs,
        args.pairs * 2,
        args.weight_bytes() as f64 / 1e9,
        args.tokens,
        args.hidden,
        args.mlp,
        args.rank,
        args.slots
    );
    println!(
        "| run | s/step | / resident | GB uploaded | upload GB/s | host waited (s) | resident GB | ring GB | peak GB |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let s = &r.stats;
        println!(
            "| {} | {:.3} | {:.3} | {:.1} | {:.1} | {:.3} | {:.1} | {:.2} | {} |",
            r.label,
            r.seconds,
            r.seconds / resident,
            s.bytes_uploaded as f64 / 1e9,
            s.upload_gbps(),
            s.wait_seconds,
            s.resident_bytes as f64 / 1e9,
            s.ring_bytes as f64 / 1e9,
            s.peak_device_bytes
                .map_or("-".into(), |b| format!("{:.1}", b as f64 / 1e9)),
        );
    }
}
