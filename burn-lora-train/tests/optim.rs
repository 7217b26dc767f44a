//! AdamW against an f64 reference: the f32 optimizer tightly, the 8-bit one within its stated
//! tolerance; state memory of both; a saved state restored bit for bit.
//!
//! Each step computes the gradients of a least-squares loss at the optimizer's own parameters
//! (Burn autodiff) and hands the very same gradients, in f64, to the reference, so the only
//! differences are the optimizer's arithmetic (f32) and, for `AdamW8bit`, its quantized moments.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use burn_lora_train::config::{OptimizerKind, SchedulerKind};
use burn_lora_train::optim::{AdamW, AdamWConfig, LrSchedule, OnDevice, OnHost, StatePlacement};
use burn_lora_train::rng::Rng;

type AD = Autodiff<Flex>;

const ROWS: usize = 64;
const COLS: usize = 128;
const SAMPLES: usize = 32;

#[derive(Module, Debug)]
struct Regression<B: Backend> {
    weight: Param<Tensor<B, 2>>,
    bias: Param<Tensor<B, 1>>,
}

fn random(rng: &mut Rng, n: usize, scale: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * scale) as f32).collect()
}

struct Problem {
    x: Tensor<AD, 2>,
    y: Tensor<AD, 2>,
    start: (Vec<f32>, Vec<f32>),
}

fn problem() -> Problem {
    let device = Default::default();
    let mut rng = Rng::seeded(11);
    let x = random(&mut rng, SAMPLES * ROWS, 1.0);
    // Targets from a hidden linear map, with gradients of very different sizes per column.
    let hidden: Vec<f32> = (0..ROWS * COLS)
        .map(|i| (rng.normal() * (1.0 + (i % COLS) as f64 / 8.0)) as f32)
        .collect();
    let xt = Tensor::<AD, 2>::from_data(TensorData::new(x, [SAMPLES, ROWS]), &device);
    let h = Tensor::<AD, 2>::from_data(TensorData::new(hidden, [ROWS, COLS]), &device);
    let y = xt.clone().matmul(h).detach();
    Problem {
        x: xt,
        y,
        start: (
            random(&mut rng, ROWS * COLS, 0.1),
            random(&mut rng, COLS, 0.1),
        ),
    }
}

fn model(p: &Problem, dtype: DType) -> Regression<AD> {
    let device = Default::default();
    let (w, b) = &p.start;
    let weight = Tensor::<AD, 2>::from_data(TensorData::new(w.clone(), [ROWS, COLS]), &device);
    let bias = Tensor::<AD, 1>::from_data(TensorData::new(b.clone(), [COLS]), &device);
    Regression {
        weight: Param::from_tensor(weight.cast(dtype)),
        bias: Param::from_tensor(bias.cast(dtype)),
    }
}

fn values<const D: usize>(t: Tensor<AD, D>) -> Vec<f64> {
    t.cast(DType::F32)
        .into_data()
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// PyTorch's AdamW (with clip_grad_norm_ before it), in f64.
struct Reference {
    params: Vec<Vec<f64>>,
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    t: i32,
    config: AdamWConfig,
}

impl Reference {
    fn new(params: Vec<Vec<f64>>, config: AdamWConfig) -> Self {
        let zeros: Vec<Vec<f64>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        Self {
            params,
            m: zeros.clone(),
            v: zeros,
            t: 0,
            config,
        }
    }

    fn step(&mut self, grads: &[Vec<f64>], lr: f64) {
        let c = self.config;
        let norm = grads.iter().flatten().map(|g| g * g).sum::<f64>().sqrt();
        let scale = c
            .max_grad_norm
            .map_or(1.0, |max| (max / (norm + 1e-6)).min(1.0));
        self.t += 1;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.t), 1.0 - c.beta2.powi(self.t));
        for (k, grad) in grads.iter().enumerate() {
            for (i, g) in grad.iter().enumerate() {
                let g = g * scale;
                let m = &mut self.m[k][i];
                let v = &mut self.v[k][i];
                *m = c.beta1 * *m + (1.0 - c.beta1) * g;
                *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
                let p = &mut self.params[k][i];
                *p *= 1.0 - lr * c.weight_decay;
                *p -= lr * (*m / bc1) / ((*v / bc2).sqrt() + c.epsilon);
            }
        }
    }
}

struct Outcome<P: StatePlacement<Flex> = OnDevice> {
    /// Largest |p - p_ref| over all values.
    max_error: f64,
    /// ‖p_ref - p_start‖: how far the reference moved.
    movement: f64,
    /// ‖p - p_ref‖ / ‖p_ref - p_start‖.
    relative_error: f64,
    optimizer: AdamW<Flex, P>,
    model: Regression<AD>,
}

/// Trains with `kind` (and `beta2` for the optimizer under test) and the reference (always
/// β₂ = 0.999) on the same gradients.
fn run(kind: OptimizerKind, dtype: DType, steps: u64, beta2: f64) -> Outcome {
    run_on::<OnDevice>(kind, dtype, steps, beta2)
}

/// [`run`] with the optimizer state where `P` puts it.
fn run_on<P: StatePlacement<Flex>>(
    kind: OptimizerKind,
    dtype: DType,
    steps: u64,
    beta2: f64,
) -> Outcome<P> {
    let p = problem();
    let mut config = AdamWConfig::new(kind, 0.1);
    config.max_grad_norm = Some(24.5);
    let schedule = LrSchedule {
        peak: 1e-2,
        warmup: 5,
        total: steps,
        kind: SchedulerKind::Cosine,
    };
    let mut model = model(&p, dtype);
    let start = vec![values(model.weight.val()), values(model.bias.val())];
    let mut reference = Reference::new(start.clone(), config);
    let mut optimizer = AdamW::<Flex, P>::new(AdamWConfig { beta2, ..config });
    let mut clipped = 0;
    for step in 0..steps {
        let prediction = p.x.clone().matmul(model.weight.val().cast(DType::F32))
            + model.bias.val().cast(DType::F32).unsqueeze::<2>();
        let loss = (prediction - p.y.clone()).square().mean();
        let mut grads = loss.backward();
        let g = vec![
            values(Tensor::<AD, 2>::from_inner(
                model.weight.grad(&grads).unwrap(),
            )),
            values(Tensor::<AD, 1>::from_inner(
                model.bias.grad(&grads).unwrap(),
            )),
        ];
        let params = GradientsParams::from_module(&mut grads, &model);
        let lr = schedule.lr(step);
        let (next, report) = optimizer.step(model, params, lr);
        let norm = g.iter().flatten().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            (report.grad_norm - norm).abs() <= 1e-4 * norm,
            "step {step}"
        );
        clipped += usize::from(norm > 24.5);
        model = next;
        reference.step(&g, lr);
    }
    assert!(clipped > 0, "clipping is exercised");
    let now = [values(model.weight.val()), values(model.bias.val())];
    let (mut max_error, mut err2, mut moved2) = (0f64, 0f64, 0f64);
    for k in 0..2 {
        for i in 0..now[k].len() {
            let e = now[k][i] - reference.params[k][i];
            max_error = max_error.max(e.abs());
            err2 += e * e;
            moved2 += (reference.params[k][i] - start[k][i]).powi(2);
        }
    }
    Outcome {
        max_error,
        movement: moved2.sqrt(),
        relative_error: err2.sqrt() / moved2.sqrt(),
        optimizer,
        model,
    }
}

#[test]
fn f32_adamw_matches_the_f64_reference() {
    let out = run(OptimizerKind::AdamW, DType::F32, 60, 0.999);
    println!(
        "adamw f32: max error {:.3e}, relative {:.3e}, movement {:.3}",
        out.max_error, out.relative_error, out.movement
    );
    assert!(out.movement > 1.0, "the parameters moved: {}", out.movement);
    assert!(out.max_error < 2e-6, "max error {}", out.max_error);
}

#[test]
fn bf16_parameters_follow_their_f32_master_copy() {
    let out = run(OptimizerKind::AdamW, DType::BF16, 60, 0.999);
    // The master copy follows the reference as tightly as f32 parameters do; the parameter is
    // that copy rounded to bf16 (relative step 2^-8).
    let state = out.optimizer.to_tensors();
    let master: Vec<f32> = state
        .iter()
        .find(|(k, _)| k == "weight.master")
        .unwrap()
        .1
        .to_vec()
        .unwrap();
    let rounded: Vec<f32> = TensorData::new(master.clone(), [master.len()])
        .convert_dtype(DType::BF16)
        .convert::<f32>()
        .to_vec()
        .unwrap();
    let param: Vec<f32> = out
        .model
        .weight
        .val()
        .cast(DType::F32)
        .into_data()
        .to_vec()
        .unwrap();
    assert_eq!(param, rounded);
    assert!(out.max_error < 1e-2, "max error {}", out.max_error);
}

#[test]
fn adamw8bit_matches_the_reference_within_its_quantization_error() {
    let out = run(OptimizerKind::AdamW8bit, DType::F32, 60, 0.999);
    println!(
        "adamw8bit: max error {:.3e}, relative {:.3e}, movement {:.3}",
        out.max_error, out.relative_error, out.movement
    );
    // Stated tolerance: after 60 steps the parameters are within 3 % (in L2, relative to how
    // far the reference moved) of the f64 reference.
    assert!(
        out.relative_error < 0.03,
        "relative error {}",
        out.relative_error
    );
    // Sign descent (AdamW with β₂ → 0) is the nearest cheap stand-in; it is far off, so the
    // tolerance above does tell a correct second moment from a wrong one.
    let wrong = run(OptimizerKind::AdamW, DType::F32, 60, 0.0).relative_error;
    println!("sign descent (beta2 = 0): relative {wrong:.3e}");
    assert!(
        wrong > 5.0 * out.relative_error,
        "{wrong} vs {}",
        out.relative_error
    );
}

#[test]
fn a_restored_state_continues_bit_for_bit() {
    for kind in [OptimizerKind::AdamW, OptimizerKind::AdamW8bit] {
        let out = run(kind, DType::F32, 8, 0.999);
        let saved = out.optimizer.to_tensors();
        // A fresh model (other parameter ids, other values) takes the saved values back.
        let mut fresh = AdamW::<Flex>::new(*out.optimizer.config());
        let restored = fresh
            .restore(
                model(&problem(), DType::F32),
                out.optimizer.steps(),
                saved.clone(),
            )
            .unwrap();
        let again = fresh.to_tensors();
        assert_eq!(saved.len(), again.len());
        for ((k1, a), (k2, b)) in saved.iter().zip(&again) {
            assert_eq!(k1, k2);
            assert_eq!(a.dtype, b.dtype, "{k1}");
            assert_eq!(a.as_bytes(), b.as_bytes(), "{k1}");
        }
        assert_eq!(
            values(restored.weight.val()),
            values(out.model.weight.val())
        );
        // A state that does not fit the model is refused, naming the tensor.
        let mut bad = saved.clone();
        bad.retain(|(k, _)| k != "weight.master");
        let err = AdamW::<Flex>::new(*out.optimizer.config())
            .restore(model(&problem(), DType::F32), 8, bad)
            .unwrap_err();
        assert!(err.to_string().contains("weight"), "{err}");
    }
}

/// The f32 values of a model's parameters and of the saved state's float tensors (8-bit codes
/// as their integers), by key.
fn fingerprint<P: StatePlacement<Flex>>(out: &Outcome<P>) -> Vec<(String, Vec<f64>)> {
    let mut all = vec![
        ("weight".to_string(), values(out.model.weight.val())),
        ("bias".to_string(), values(out.model.bias.val())),
    ];
    for (key, data) in out.optimizer.to_tensors() {
        all.push((key, data.convert::<f64>().to_vec().unwrap()));
    }
    all
}

#[test]
fn a_state_in_host_memory_trains_and_resumes_as_on_the_device() {
    // bf16 parameters: the master copies live with the state; clipping is exercised by `run`.
    // The host's update does each value's arithmetic in IEEE f32 on all cores; Flex's tensor
    // ops may round a quotient differently in the last bit, and the host sums the gradients'
    // squares in f64 where the device sums them in f32 (so the clipping factors differ in their
    // last bits), so the two agree to f32 rounding carried over 8 steps, not bit for bit.
    for kind in [OptimizerKind::AdamW, OptimizerKind::AdamW8bit] {
        let device = run_on::<OnDevice>(kind, DType::BF16, 8, 0.999);
        let host = run_on::<OnHost>(kind, DType::BF16, 8, 0.999);
        let (a, b) = (fingerprint(&device), fingerprint(&host));
        assert_eq!(a.len(), b.len());
        for ((key, x), (key_b, y)) in a.iter().zip(&b) {
            assert_eq!(key, key_b);
            let scale = x.iter().fold(0f64, |m, v| m.max(v.abs()));
            // 8-bit codes: at most one code apart, and identical for almost all; values:
            // within 1 % of the tensor's scale (a bf16 weight one step apart).
            let tolerance = if key.ends_with(".codes") {
                1.0
            } else {
                1e-2 * scale
            };
            let apart = x.iter().zip(y).filter(|(u, v)| u != v).count();
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                assert!(
                    (u - v).abs() <= tolerance,
                    "{kind:?} {key}[{i}]: {u} against {v}"
                );
            }
            assert!(
                !key.ends_with(".codes") || apart * 100 <= x.len(),
                "{kind:?} {key}: {apart} of {} differ",
                x.len()
            );
        }
        // A state saved from the host restores on the device, and the reverse.
        let saved = host.optimizer.to_tensors();
        let mut on_device = AdamW::<Flex, OnDevice>::new(*host.optimizer.config());
        on_device
            .restore(model(&problem(), DType::BF16), 8, saved)
            .unwrap();
        let saved = on_device.to_tensors();
        let mut on_host = AdamW::<Flex, OnHost>::new(*host.optimizer.config());
        let restored = on_host
            .restore(model(&problem(), DType::BF16), 8, saved.clone())
            .unwrap();
        // The restored weights are the master copies rounded by Flex's cast, which rounds a
        // value within 2⁻³² of a tie between two bf16 values to the even one: a step apart at
        // most.
        let weights = values(restored.weight.val());
        for (u, v) in weights.iter().zip(values(host.model.weight.val())) {
            let (u, v): (f64, f64) = (*u, v);
            assert!((u - v).abs() <= v.abs() / 128.0, "{u} against {v}");
        }
        let again = on_host.to_tensors();
        for ((k1, a), (k2, b)) in saved.iter().zip(&again) {
            assert_eq!((k1, a.as_bytes()), (k2, b.as_bytes()));
        }
    }
}

#[test]
fn state_memory_of_f32_and_8bit_moments() {
    // A LoRA-shaped parameter set: 16 matrices of rank 16 x 4096 (1 048 576 values).
    #[derive(Module, Debug)]
    struct Lora<B: Backend> {
        mats: Vec<Param<Tensor<B, 2>>>,
    }
    let device = Default::default();
    let n = 16 * 16 * 4096;
    let mut sizes = Vec::new();
    for kind in [OptimizerKind::AdamW, OptimizerKind::AdamW8bit] {
        let lora = Lora::<AD> {
            mats: (0..16)
                .map(|_| Param::from_tensor(Tensor::ones([16, 4096], &device).require_grad()))
                .collect(),
        };
        let loss = lora
            .mats
            .iter()
            .map(|m| m.val().square().sum())
            .reduce(|a, b| a + b)
            .unwrap();
        let grads = GradientsParams::from_grads(loss.backward(), &lora);
        let mut optimizer = AdamW::<Flex>::new(AdamWConfig::new(kind, 0.0));
        optimizer.step(lora, grads, 1e-3);
        let bytes = optimizer.state_bytes();
        let on_disk: usize = optimizer
            .to_tensors()
            .iter()
            .filter(|(k, _)| !k.ends_with(".master"))
            .map(|(_, d)| d.as_bytes().len())
            .sum();
        assert_eq!(bytes, on_disk);
        println!(
            "{kind:?}: {n} parameters, state {bytes} bytes ({:.4} bytes per parameter)",
            bytes as f64 / n as f64
        );
        sizes.push(bytes);
    }
    // f32: m and v, 4 bytes each. 8-bit: a byte each plus an f32 scale per 256 values.
    assert_eq!(sizes[0], 8 * n);
    assert_eq!(sizes[1], 2 * n + 2 * 4 * n / 256);
}
