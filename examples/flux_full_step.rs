//! A FLUX.1-dev-shaped transformer (random bf16 weights, 11.9 B parameters), or with `--model
//! flux2-dev` a FLUX.2-dev-shaped one (32.2 B; `flux2-klein-4b` and `flux2-klein-9b` too), on
//! one GPU: two forward passes, then training steps with block-level gradient checkpointing,
//! timed, with the device's peak memory.
//!
//! The model runs on `Autodiff<Offload<Cuda>>`, as the trainer's does: its matrix products go
//! to cuBLAS, its attention and elementwise ops to burn-kernels' fused kernels, as the
//! `BURNLORA_KERNELS__*` variables leave them (see `kernels/mod.rs`). With `--stream-budget-gb X`
//! its frozen weights are made in page-locked host memory (never on the device) and stream
//! through burn-offload's ring, all but those that fit in an X GB VRAM budget (`--wire e5m2`
//! sends them as FP8); without it they stay resident. `--no-decorator` runs it resident on `Autodiff<Cuda>` instead (fused
//! attention and elementwise ops, Burn's products).
//!
//! The trainable parameters are LoRA adapters of rank 32 (alpha 32) on every Linear of the
//! double and single blocks (FLUX.1-dev: 304 layers, 153 M parameters), as in the PyTorch
//! anchor's step; AdamW updates them.
//!
//! ```text
//! cargo run --release --features cuda --example flux_full_step -- \
//!     [--model flux1-dev|flux2-dev|flux2-klein-4b|flux2-klein-9b] [--img-tokens 4096] [--txt-tokens 512] [--steps 3] [--no-checkpointing] \
//!     [--stream-budget-gb 12 [--wire bf16|e5m2|e4m3] | --no-decorator]
//! ```
//! Peak memory is read from `nvidia-smi` (every 20 ms; the whole GPU, as the driver sees it).

mod common;
mod kernels;

use std::time::Instant;

use burn::backend::{Autodiff, Cuda};
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, IntDType, Tensor, TensorData};
use burn_diffusion::flux::{Flux, FluxConfig, FluxInput};
use burn_diffusion::flux2::{Flux2, Flux2Config, Flux2Input};
use burn_diffusion::{BlockRunner, BlockTape, Checkpointing, Direct, PlaceWeight, random_placed};
use burn_kernels::{FusedOps, Kernels};
use burn_lora::{LoraConfig, LoraPlan};
use burn_offload::{Offload, OffloadConfig, WeightStream, WireFormat};

/// The transformers this program steps.
#[derive(Clone, Copy)]
enum Model {
    Flux1Dev,
    Flux2(fn() -> Flux2Config),
}

struct Args {
    model: Model,
    img_tokens: usize,
    txt_tokens: usize,
    steps: usize,
    checkpointing: Checkpointing,
    /// VRAM budget of the streamed run, in bytes; `None` for a resident run.
    stream_budget: Option<u64>,
    wire: WireFormat,
    /// A resident run on `Autodiff<Cuda>`, without the decorator.
    plain: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        model: Model::Flux1Dev,
        img_tokens: 4096,
        txt_tokens: 512,
        steps: 3,
        checkpointing: Checkpointing::Blocks,
        stream_budget: None,
        wire: WireFormat::Native,
        plain: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value =
            || -> String { it.next().unwrap_or_else(|| panic!("{flag} needs a value")) };
        let number = |v: String| -> f64 {
            v.parse()
                .unwrap_or_else(|_| panic!("{flag} needs a number, not {v}"))
        };
        match flag.as_str() {
            "--model" => {
                args.model = match value().as_str() {
                    "flux1-dev" => Model::Flux1Dev,
                    "flux2-dev" => Model::Flux2(Flux2Config::dev),
                    "flux2-klein-4b" => Model::Flux2(Flux2Config::klein_4b),
                    "flux2-klein-9b" => Model::Flux2(Flux2Config::klein_9b),
                    other => panic!("unknown --model {other}"),
                }
            }
            "--img-tokens" => args.img_tokens = number(value()) as usize,
            "--txt-tokens" => args.txt_tokens = number(value()) as usize,
            "--steps" => args.steps = number(value()) as usize,
            "--stream-budget-gb" => args.stream_budget = Some((number(value()) * 1e9) as u64),
            "--wire" => {
                args.wire = match value().as_str() {
                    "bf16" => WireFormat::Native,
                    "e5m2" => WireFormat::E5M2,
                    "e4m3" => WireFormat::E4M3,
                    other => panic!("--wire takes bf16, e5m2 or e4m3, not {other}"),
                }
            }
            "--no-checkpointing" => args.checkpointing = Checkpointing::Off,
            "--no-decorator" => args.plain = true,
            other => panic!("unknown argument {other}"),
        }
    }
    args
}

/// Creates every lazily initialized parameter now.
fn materialize<B: Backend, M: Module<B>>(model: &M) {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    model.visit(&mut Touch);
}

/// Image position ids of a square of `tokens` tokens: `(row, column)` after `lead` zeros and
/// before `trail` zeros.
fn grid_ids(tokens: usize, lead: usize, trail: usize) -> TensorData {
    let side = (tokens as f64).sqrt().ceil() as usize;
    let width = lead + 2 + trail;
    let mut ids = vec![0f32; tokens * width];
    for (i, row) in ids.chunks_exact_mut(width).enumerate() {
        row[lead] = (i / side) as f32;
        row[lead + 1] = (i % side) as f32;
    }
    TensorData::new(ids, [tokens, width])
}

/// What one step of the benchmark runs: the model on a random input, and a random target.
trait Denoiser<B: Backend>: Module<B> {
    fn step(&self, args: &Args, runner: &mut impl BlockRunner<B>) -> (Tensor<B, 3>, Tensor<B, 3>);
}

impl<B: Kernels> Denoiser<B> for Flux<B> {
    fn step(&self, args: &Args, runner: &mut impl BlockRunner<B>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (config, device) = (self.config(), &self.devices()[0]);
        let normal = Distribution::Normal(0.0, 1.0);
        let input = FluxInput {
            img: Tensor::random([1, args.img_tokens, config.in_channels], normal, device),
            txt: Tensor::random([1, args.txt_tokens, config.context_in_dim], normal, device),
            y: Tensor::random([1, config.vec_in_dim], normal, device),
            timesteps: Tensor::from_floats([0.6], device),
            guidance: Some(Tensor::from_floats([3.5], device)),
            img_ids: grid_ids(args.img_tokens, 1, 0),
            txt_ids: TensorData::new(vec![0f32; args.txt_tokens * 3], [args.txt_tokens, 3]),
        };
        let target = Tensor::random([1, args.img_tokens, config.out_channels], normal, device);
        (self.forward_with(input, runner), target)
    }
}

impl<B: Kernels> Denoiser<B> for Flux2<B> {
    fn step(&self, args: &Args, runner: &mut impl BlockRunner<B>) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let (config, device) = (self.config(), &self.devices()[0]);
        let normal = Distribution::Normal(0.0, 1.0);
        let txt_ids: Vec<f32> = (0..args.txt_tokens)
            .flat_map(|l| [0.0, 0.0, 0.0, l as f32])
            .collect();
        let input = Flux2Input {
            img: Tensor::random([1, args.img_tokens, config.in_channels], normal, device),
            txt: Tensor::random([1, args.txt_tokens, config.context_in_dim], normal, device),
            timesteps: Tensor::from_floats([0.6], device),
            guidance: config
                .guidance_embed
                .then(|| Tensor::from_floats([3.5], device)),
            img_ids: grid_ids(args.img_tokens, 1, 1),
            txt_ids: TensorData::new(txt_ids, [args.txt_tokens, 4]),
        };
        let target = Tensor::random([1, args.img_tokens, config.out_channels], normal, device);
        (self.forward_with(input, runner), target)
    }
}

/// What brackets each step: nothing for a resident model, the weight stream's
/// `begin_step` / `end_step` for a streamed one (returning its statistics to print).
struct Hooks<'a> {
    begin: &'a dyn Fn(),
    end: &'a dyn Fn() -> String,
}

fn main() {
    let _kernels = kernels::install_from_env();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let args = parse_args();
    let device = Default::default();
    let memory = common::DeviceMemory::start();
    if let Some(memory) = &memory {
        println!(
            "device memory in use before start: {:.2} GB",
            memory.baseline_gb()
        );
    }
    let peak = || {
        memory
            .as_ref()
            .map_or(f64::NAN, common::DeviceMemory::take_peak)
    };
    peak();
    match args.model {
        Model::Flux1Dev => bench(
            &args,
            &device,
            &peak,
            "FLUX.1-dev",
            |d| FluxConfig::dev().init(d),
            |d| FluxConfig::dev().init(d),
        ),
        Model::Flux2(config) => bench(
            &args,
            &device,
            &peak,
            "FLUX.2",
            |d| config().init(d),
            |d| config().init(d),
        ),
    }
}

type Device = burn::backend::cuda::CudaDevice;

/// The run `args` ask for, of the model `plain` / `offload` make (lazily initialized) on the
/// two backends.
fn bench<P, O>(
    args: &Args,
    device: &Device,
    peak: &dyn Fn() -> f64,
    name: &str,
    plain: impl Fn(&Device) -> P,
    offload: impl Fn(&Device) -> O,
) where
    P: AutodiffModule<Autodiff<Cuda>> + Denoiser<Autodiff<Cuda>>,
    P::InnerModule: Denoiser<Cuda>,
    O: AutodiffModule<Autodiff<Offload<Cuda>>> + Denoiser<Autodiff<Offload<Cuda>>>,
    O::InnerModule: Denoiser<Offload<Cuda>>,
{
    let resident = Hooks {
        begin: &|| {},
        end: &String::new,
    };
    match args.stream_budget {
        None if args.plain => {
            let model = create::<Cuda, _>(device, peak, name, plain(device), None);
            run(model, args, device, peak, &resident);
        }
        None => {
            let model = create::<Offload<Cuda>, _>(device, peak, name, offload(device), None);
            run(model, args, device, peak, &resident);
        }
        Some(budget) => {
            type Streamed = Autodiff<Offload<Cuda>>;
            let config = OffloadConfig::default()
                .with_vram_budget(budget)
                .with_wire(args.wire);
            let stream = WeightStream::<Streamed>::new(device, config).expect("weight stream");
            let start = Instant::now();
            let mut place = |name: &str, data: TensorData| -> Result<_, _> {
                stream.streamed_tensor::<2>(name, data).map_err(Into::into)
            };
            let model =
                create::<Offload<Cuda>, _>(device, peak, name, offload(device), Some(&mut place));
            let model = stream
                .stream_frozen(model)
                .expect("streaming the frozen weights");
            Streamed::memory_cleanup(device);
            println!(
                "frozen weights made in host memory in {:.1} s (budget {:.1} GB, wire {:?}); peak {:.1} GB",
                start.elapsed().as_secs_f64(),
                budget as f64 / 1e9,
                args.wire,
                peak()
            );
            let hooks = Hooks {
                begin: &|| stream.begin_step(),
                end: &|| {
                    let s = stream.end_step();
                    format!(
                        "\n  stream: {:?}, {} uses ({} prefetched, {} kept, {} on demand, {} resident), {:.1} GB uploaded at {:.1} GB/s, host waited {:.2} s, resident {:.1} GB, ring {:.2} GB, pool peak {:.1} GB",
                        s.schedule,
                        s.weight_uses,
                        s.prefetched,
                        s.kept,
                        s.on_demand,
                        s.resident_hits,
                        s.bytes_uploaded as f64 / 1e9,
                        s.upload_gbps(),
                        s.wait_seconds,
                        s.resident_bytes as f64 / 1e9,
                        s.ring_bytes as f64 / 1e9,
                        s.peak_device_bytes.unwrap_or(0) as f64 / 1e9
                    )
                },
            };
            run(model, args, device, peak, &hooks);
        }
    }
}

/// `model` (lazily initialized) with random bf16 weights, created on the device, or with
/// `place` its Linear weights made in host memory and handed there; frozen, with trainable
/// LoRA adapters on the blocks.
fn create<B: FusedOps, M: Module<Autodiff<B>>>(
    device: &B::Device,
    peak: &dyn Fn() -> f64,
    name: &str,
    model: M,
    place: Option<&mut PlaceWeight<'_, Autodiff<B>>>,
) -> M {
    burn::tensor::set_default_dtypes::<B>(device, FloatDType::BF16, IntDType::I32)
        .expect("bf16 as the default float type");
    let start = Instant::now();
    let model = match place {
        Some(place) => random_placed(model, FloatDType::BF16, 42, place).expect("host weights"),
        None => {
            materialize(&model);
            model
        }
    };
    let model = model.no_grad();
    let plan = LoraPlan::new(LoraConfig::new(32))
        .and_then(|plan| plan.include("double_blocks"))
        .and_then(|plan| plan.include("single_blocks"))
        .expect("a valid LoRA plan");
    let (model, applied) = plan.apply(model);
    materialize(&model);
    B::sync(device).unwrap();
    let params = model.num_params();
    println!(
        "{name} shape: {:.2} B parameters ({:.1} GB bf16) with {} LoRA layers ({:.1} M trainable), created in {:.1} s; peak {:.1} GB",
        (params - applied.params()) as f64 / 1e9,
        (params - applied.params()) as f64 * 2.0 / 1e9,
        applied.count(),
        applied.params() as f64 / 1e6,
        start.elapsed().as_secs_f64(),
        peak()
    );
    model
}

/// Two forward passes, then `args.steps` checkpointed training steps.
fn run<B: FusedOps, M>(
    model: M,
    args: &Args,
    device: &B::Device,
    peak: &dyn Fn() -> f64,
    hooks: &Hooks,
) where
    M: AutodiffModule<Autodiff<B>> + Denoiser<Autodiff<B>>,
    M::InnerModule: Denoiser<B>,
{
    let cold = |run: usize| {
        if run == 0 {
            " (includes kernel compilation and autotune)"
        } else {
            ""
        }
    };
    let inference = model.valid();
    for run in 0..2 {
        let start = Instant::now();
        (hooks.begin)();
        let (out, _) = inference.step(args, &mut Direct);
        B::sync(device).unwrap();
        let stats = (hooks.end)();
        let seconds = start.elapsed().as_secs_f64();
        drop(out);
        println!(
            "forward {run} ({} image + {} text tokens): {seconds:.3} s; peak {:.1} GB{}{stats}",
            args.img_tokens,
            args.txt_tokens,
            peak(),
            cold(run)
        );
    }
    drop(inference);

    let mut model = model;
    let mut optimizer = AdamWConfig::new().init::<Autodiff<B>, M>();
    for step in 0..args.steps {
        let start = Instant::now();
        (hooks.begin)();
        let mut tape = BlockTape::new(args.checkpointing);
        let (out, target) = model.step(args, &mut tape);
        let loss = (out - target).powi_scalar(2).mean();
        let forward = start.elapsed().as_secs_f64();
        let grads = GradientsParams::from_grads(tape.backward(&loss, &model), &model);
        model = optimizer.step(1e-4, model, grads);
        Autodiff::<B>::sync(device).unwrap();
        let stats = (hooks.end)();
        let loss = loss.into_data().convert::<f32>().to_vec::<f32>().unwrap()[0];
        println!(
            "train step {step} ({:?} checkpointing): {:.3} s (forward {forward:.3} s queued), loss {loss:.4}; peak {:.1} GB; {} products through cuBLAS, {} fused attentions, {} fused elementwise ops so far{}{stats}",
            args.checkpointing,
            start.elapsed().as_secs_f64(),
            peak(),
            burn_kernels::counters().blas_products,
            burn_kernels::counters().fused_attention,
            burn_kernels::counters().fused_elementwise,
            cold(step)
        );
    }
}
