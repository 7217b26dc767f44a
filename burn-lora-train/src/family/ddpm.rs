//! The DDPM objective SDXL trains with: the scaled-linear noise schedule, the noisy input and
//! target (ε or v) of a batch of latents at integer timesteps, the noise offset, and the
//! min-SNR-γ loss weights, as diffusers' `DDPMScheduler` and SDXL training script compute them.
//!
//! Min-SNR-γ follows diffusers (`compute_snr`, `train_text_to_image_sdxl.py`): with
//! `snr = ᾱ / (1 − ᾱ)`, the weight is `min(snr, γ) / snr` for ε and `min(snr, γ) / (snr + 1)` for
//! v. kohya's sd-scripts (`apply_snr_weight` with `v_prediction`) computes the same weights from
//! the same SNR table; its versions before the `v_prediction` argument used `min(snr, γ) / snr`
//! for v too, and its `--zero_terminal_snr` makes the last SNR 0 (an infinite ε weight), which
//! this schedule never does.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/schedulers/scheduling_ddpm.py (DDPMScheduler.__init__, add_noise, get_velocity)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/training_utils.py (compute_snr)
// ref: huggingface/diffusers@v0.42.1 examples/text_to_image/train_text_to_image_sdxl.py (noise offset, timesteps, min-SNR weights)

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::config::{DdpmSettings, Prediction, TimestepRange, TimestepSampling};
use crate::rng::Rng;

/// The number of training timesteps of SDXL's scheduler (`num_train_timesteps`).
pub(crate) const NUM_TRAIN_TIMESTEPS: usize = 1000;
/// The first β of SDXL's scaled-linear schedule (`beta_start`).
const BETA_START: f64 = 0.00085;
/// The last β of SDXL's scaled-linear schedule (`beta_end`).
const BETA_END: f64 = 0.012;

/// A DDPM noise schedule: `ᾱ_t` of every training timestep, in f32 as `DDPMScheduler` holds
/// it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct DdpmSchedule {
    alphas_cumprod: Vec<f32>,
}

impl DdpmSchedule {
    /// SDXL's schedule (`scaled_linear`, β from 0.00085 to 0.012, 1000 steps).
    pub fn sdxl() -> Self {
        Self::scaled_linear(BETA_START, BETA_END, NUM_TRAIN_TIMESTEPS)
    }

    /// `β = linspace(√beta_start, √beta_end, steps)²` and `ᾱ_t = ∏_{s ≤ t} (1 − β_s)`, in the
    /// arithmetic `DDPMScheduler` runs on the CPU: the linspace in f32 (torch's formula, from
    /// the start for the first half and from the end for the second), its square and `1 − β`
    /// in f32, the cumulative product accumulated in f64 and stored in f32 (torch's CPU
    /// `cumprod` of f32). torch's vectorized linspace rounds some values one ulp apart from its
    /// formula, so `ᾱ` agrees with diffusers' within 1.2e-7 relative.
    pub fn scaled_linear(beta_start: f64, beta_end: f64, steps: usize) -> Self {
        let (start, end) = (beta_start.sqrt() as f32, beta_end.sqrt() as f32);
        let step = (end - start) / (steps - 1) as f32;
        let mut product = 1.0f64;
        let alphas_cumprod = (0..steps)
            .map(|i| {
                let root = if i < steps / 2 {
                    start + step * i as f32
                } else {
                    end - step * (steps - 1 - i) as f32
                };
                product *= f64::from(1.0 - root * root);
                product as f32
            })
            .collect();
        Self { alphas_cumprod }
    }

    /// `(√ᾱ_t, √(1 − ᾱ_t))` in f32: the scales of the latent and of the noise at timestep `t`.
    ///
    /// # Panics
    /// If `t` is not a timestep of the schedule.
    pub fn scales(&self, t: u32) -> (f32, f32) {
        let alpha = self.alphas_cumprod[t as usize];
        (alpha.sqrt(), (1.0 - alpha).sqrt())
    }

    /// The signal-to-noise ratio `(√ᾱ_t / √(1 − ᾱ_t))²` in f32 (`compute_snr`).
    pub fn snr(&self, t: u32) -> f32 {
        let (signal, noise) = self.scales(t);
        let ratio = signal / noise;
        ratio * ratio
    }

    /// The min-SNR-γ loss weight of timestep `t`: `min(snr, γ) / snr` for ε, `min(snr, γ) /
    /// (snr + 1)` for v (in f32, as the training script).
    pub fn min_snr_weight(&self, t: u32, gamma: f64, prediction: Prediction) -> f32 {
        let snr = self.snr(t);
        let clipped = snr.min(gamma as f32);
        match prediction {
            Prediction::Epsilon => clipped / snr,
            Prediction::Velocity => clipped / (snr + 1.0),
        }
    }
}

/// One timestep per sample, `n` of them: `⌊u · 1000⌋` (at most 999) for `u` drawn by
/// `sampling` within `range` (`uniform` gives the training scripts' `randint(min, max)`;
/// `tokens` is the latent's size in 2×2 patches, which only the resolution-dependent shift
/// reads).
pub(crate) fn sample_timesteps(
    sampling: TimestepSampling,
    range: TimestepRange,
    n: usize,
    tokens: usize,
    rng: &mut Rng,
) -> Vec<u32> {
    let last = NUM_TRAIN_TIMESTEPS as u32 - 1;
    (0..n)
        .map(|_| {
            let u = range.sample(sampling, tokens, rng);
            ((u * NUM_TRAIN_TIMESTEPS as f64) as u32).min(last)
        })
        .collect()
}

/// One batch's DDPM pair under SDXL's schedule: `x_t = √ᾱ·x₀ + √(1 − ᾱ)·ε`, the target (`ε`, or
/// `v = √ᾱ·ε − √(1 − ᾱ)·x₀`), the timesteps and each sample's loss weight (all f32).
pub(crate) struct DdpmPair<B: Backend> {
    /// The noisy latents, `[n, c, h, w]`.
    pub x_t: Tensor<B, 4>,
    /// What the model is trained to predict, `[n, c, h, w]`.
    pub target: Tensor<B, 4>,
    /// The timestep of each sample as a float, `[n]` (what the UNet embeds).
    pub timesteps: Tensor<B, 1>,
    /// The weight of each sample's mean squared error, `[n]`: min-SNR-γ when configured, else 1.
    pub weights: Tensor<B, 1>,
}

impl<B: Backend> DdpmPair<B> {
    /// The pair for latents `x0` (`[n, c, h, w]`, f32) at `timesteps` (one per sample, below
    /// [`NUM_TRAIN_TIMESTEPS`]) of `schedule`, with noise drawn on the CPU from a generator seeded by
    /// `rng.next_u64()` ([`host_noise`]), so that it is the same on every backend.
    pub fn new(
        x0: Tensor<B, 4>,
        timesteps: &[u32],
        schedule: &DdpmSchedule,
        settings: &DdpmSettings,
        rng: &mut Rng,
        device: &B::Device,
    ) -> Self {
        let noise = host_noise(x0.dims(), settings.noise_offset, rng);
        let noise = Tensor::from_data(noise, device);
        Self::with_noise(x0, noise, timesteps, schedule, settings)
    }

    /// The pair for latents `x0` and their `noise` (both `[n, c, h, w]`, f32) at `timesteps`:
    /// `add_noise`, the target `get_velocity` or the noise itself, and the weights.
    fn with_noise(
        x0: Tensor<B, 4>,
        noise: Tensor<B, 4>,
        timesteps: &[u32],
        schedule: &DdpmSchedule,
        settings: &DdpmSettings,
    ) -> Self {
        let n = timesteps.len();
        let device = x0.device();
        let per_sample =
            |values: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(values, [n]), &device);
        let (signal, noise_scale): (Vec<f32>, Vec<f32>) =
            timesteps.iter().map(|&t| schedule.scales(t)).unzip();
        let signal = per_sample(signal).reshape([n, 1, 1, 1]);
        let noise_scale = per_sample(noise_scale).reshape([n, 1, 1, 1]);
        let x_t = x0.clone() * signal.clone() + noise.clone() * noise_scale.clone();
        let target = match settings.prediction {
            Prediction::Epsilon => noise,
            Prediction::Velocity => noise * signal - x0 * noise_scale,
        };
        let weights = timesteps
            .iter()
            .map(|&t| {
                settings.min_snr_gamma.map_or(1.0, |gamma| {
                    schedule.min_snr_weight(t, gamma, settings.prediction)
                })
            })
            .collect();
        Self {
            x_t,
            target,
            timesteps: per_sample(timesteps.iter().map(|&t| t as f32).collect()),
            weights: per_sample(weights),
        }
    }
}

/// Standard normal noise of `shape` (`[n, c, h, w]`, f32), plus `offset` times one more normal
/// draw per sample and channel (the noise offset; 0: none). The values come from
/// [`Rng::normal`] of a generator seeded by one `rng.next_u64()`, the noise first, then the
/// offsets: the run's stream advances by one draw whatever the shape, and nothing global is
/// read.
fn host_noise(shape: [usize; 4], offset: f64, rng: &mut Rng) -> TensorData {
    let [n, c, h, w] = shape;
    let mut draws = Rng::seeded(rng.next_u64());
    let mut values = draws.normals(n * c * h * w);
    if offset != 0.0 {
        add_offset(&mut values, &draws.normals(n * c), offset as f32);
    }
    TensorData::new(values, shape)
}

/// `noise += offset · draws` with one draw per `[h, w]` plane of `noise` (in f32, as the
/// training script's `noise += noise_offset * randn(b, c, 1, 1)`).
fn add_offset(noise: &mut [f32], draws: &[f32], offset: f32) {
    let plane = noise.len() / draws.len();
    for (values, draw) in noise.chunks_exact_mut(plane).zip(draws) {
        let shift = offset * draw;
        values.iter_mut().for_each(|v| *v += shift);
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use burn::backend::Flex;
    use safetensors::{Dtype, SafeTensors};

    use super::*;

    type B = Flex;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ddpm/ddpm.safetensors")
    }

    /// The tensors of the fixture: f32 values (i64 cast) with their shapes.
    struct Fixture(Vec<u8>);

    impl Fixture {
        fn open() -> Self {
            Self(std::fs::read(fixture()).unwrap())
        }

        fn get(&self, key: &str) -> (Vec<f32>, Vec<usize>) {
            let tensors = SafeTensors::deserialize(&self.0).unwrap();
            let view = tensors.tensor(key).unwrap();
            let values = match view.dtype() {
                Dtype::F32 => view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                Dtype::I64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32)
                    .collect(),
                other => panic!("{key}: {other:?}"),
            };
            (values, view.shape().to_vec())
        }

        fn values(&self, key: &str) -> Vec<f32> {
            self.get(key).0
        }

        fn tensor(&self, key: &str) -> Tensor<B, 4> {
            let (values, shape) = self.get(key);
            let shape: [usize; 4] = shape.try_into().unwrap();
            Tensor::from_data(TensorData::new(values, shape), &Default::default())
        }

        fn timesteps(&self) -> Vec<u32> {
            self.values("timesteps").iter().map(|&t| t as u32).collect()
        }
    }

    /// The largest relative error of one element, `|a − e| / |e|`.
    fn max_relative_error(actual: &[f32], expected: &[f32]) -> f64 {
        assert_eq!(actual.len(), expected.len());
        actual
            .iter()
            .zip(expected)
            .map(|(&a, &e)| (f64::from(a) - f64::from(e)).abs() / f64::from(e).abs())
            .fold(0.0, f64::max)
    }

    /// `‖a − e‖ / ‖e‖` in f64.
    fn relative_error(actual: &[f32], expected: &[f32]) -> f64 {
        assert_eq!(actual.len(), expected.len());
        let (diff, norm) = actual
            .iter()
            .zip(expected)
            .fold((0.0, 0.0), |(d, n), (&a, &e)| {
                let (a, e) = (f64::from(a), f64::from(e));
                (d + (a - e).powi(2), n + e * e)
            });
        (diff / norm).sqrt()
    }

    /// Checks an `error` of `what` against `tolerance`, and prints it.
    fn check(what: &str, error: f64, tolerance: f64) {
        println!("{what}: relative error {error:.2e}");
        assert!(error <= tolerance, "{what}: relative error {error:.2e}");
    }

    fn data(tensor: Tensor<B, 4>) -> Vec<f32> {
        tensor.into_data().to_vec().unwrap()
    }

    fn settings(prediction: Prediction, min_snr_gamma: Option<f64>) -> DdpmSettings {
        DdpmSettings {
            prediction,
            min_snr_gamma,
            noise_offset: 0.0,
        }
    }

    #[test]
    fn the_schedule_is_diffusers_ddpm_scheduler() {
        let fixture = Fixture::open();
        let schedule = DdpmSchedule::sdxl();
        let expected = fixture.values("alphas_cumprod");
        let error = max_relative_error(&schedule.alphas_cumprod, &expected);
        check("alphas_cumprod", error, 1.2e-7);
        let equal = schedule
            .alphas_cumprod
            .iter()
            .zip(&expected)
            .filter(|(a, e)| a == e)
            .count();
        println!("alphas_cumprod: {equal} of 1000 values are diffusers' own");
        assert!(equal >= 850, "{equal} of 1000 values are diffusers' own");
        let snr: Vec<f32> = (0..NUM_TRAIN_TIMESTEPS as u32)
            .map(|t| schedule.snr(t))
            .collect();
        check(
            "snr",
            max_relative_error(&snr, &fixture.values("snr_all")),
            1e-6,
        );
    }

    #[test]
    fn the_pair_is_add_noise_and_get_velocity() {
        let fixture = Fixture::open();
        let timesteps = fixture.timesteps();
        assert_eq!((timesteps[0], timesteps[5]), (0, 999));
        let pair = |prediction, gamma| {
            DdpmPair::<B>::with_noise(
                fixture.tensor("x0"),
                fixture.tensor("noise"),
                &timesteps,
                &DdpmSchedule::sdxl(),
                &settings(prediction, gamma),
            )
        };
        let epsilon = pair(Prediction::Epsilon, Some(5.0));
        let x_t = data(epsilon.x_t);
        check("x_t", relative_error(&x_t, &fixture.values("x_t")), 1e-6);
        assert_eq!(data(epsilon.target), fixture.values("noise"));
        let t: Vec<f32> = epsilon.timesteps.into_data().to_vec().unwrap();
        assert_eq!(t, fixture.values("timesteps"));
        let weights: Vec<f32> = epsilon.weights.into_data().to_vec().unwrap();
        check(
            "ε weights",
            max_relative_error(&weights, &fixture.values("weights_epsilon")),
            1e-6,
        );

        let velocity = pair(Prediction::Velocity, Some(5.0));
        assert_eq!(data(velocity.x_t), x_t);
        check(
            "v",
            relative_error(&data(velocity.target), &fixture.values("velocity")),
            1e-6,
        );
        let weights: Vec<f32> = velocity.weights.into_data().to_vec().unwrap();
        check(
            "v weights",
            max_relative_error(&weights, &fixture.values("weights_v_prediction")),
            1e-6,
        );

        let unweighted = pair(Prediction::Velocity, None);
        let weights: Vec<f32> = unweighted.weights.into_data().to_vec().unwrap();
        assert_eq!(weights, [1.0; 6]);
    }

    #[test]
    fn the_offset_is_added_per_sample_and_channel() {
        let fixture = Fixture::open();
        let mut noise = fixture.values("noise");
        add_offset(&mut noise, &fixture.values("offset_draws"), 0.05);
        assert_eq!(noise, fixture.values("noise_offset"));
    }

    #[test]
    fn draws_follow_the_run_seed() {
        let draw = |seed: u64, offset: f64| {
            let mut rng = Rng::seeded(seed);
            let timesteps = sample_timesteps(
                TimestepSampling::Uniform,
                TimestepRange::FULL,
                64,
                16,
                &mut rng,
            );
            let noise = host_noise([2, 4, 3, 5], offset, &mut rng);
            (timesteps, noise.to_vec::<f32>().unwrap(), rng.state())
        };
        let (timesteps, noise, state) = draw(9, 0.0);
        assert_eq!(draw(9, 0.0), (timesteps.clone(), noise.clone(), state));
        assert_ne!(draw(10, 0.0).0, timesteps);
        assert_ne!(draw(10, 0.0).1, noise);
        assert!(
            timesteps
                .iter()
                .all(|&t| (t as usize) < NUM_TRAIN_TIMESTEPS)
        );
        assert!(timesteps.iter().any(|&t| t >= 500) && timesteps.iter().any(|&t| t < 500));

        // The offset adds one value per [h, w] plane, and leaves the rest of the stream as it is.
        let (_, offset, offset_state) = draw(9, 0.1);
        assert_eq!(offset_state, state);
        let shifts: Vec<f32> = offset.iter().zip(&noise).map(|(a, b)| a - b).collect();
        for plane in shifts.chunks_exact(15) {
            assert!(plane[0] != 0.0);
            assert!(
                plane.iter().all(|s| (s - plane[0]).abs() <= 1e-6),
                "{plane:?}"
            );
        }
    }

    #[test]
    fn the_pair_draws_its_noise_from_the_run_seed() {
        let device = Default::default();
        let x0 = Tensor::<B, 4>::ones([2, 4, 3, 5], &device);
        let settings = DdpmSettings {
            noise_offset: 0.05,
            ..settings(Prediction::Epsilon, None)
        };
        let pair = |seed| {
            let mut rng = Rng::seeded(seed);
            let schedule = DdpmSchedule::sdxl();
            let pair = DdpmPair::<B>::new(
                x0.clone(),
                &[10, 900],
                &schedule,
                &settings,
                &mut rng,
                &device,
            );
            (data(pair.x_t), data(pair.target))
        };
        let (x_t, target) = pair(4);
        let noise = host_noise([2, 4, 3, 5], 0.05, &mut Rng::seeded(4));
        assert_eq!(target, noise.to_vec::<f32>().unwrap());
        assert_eq!(pair(4), (x_t.clone(), target));
        assert_ne!(pair(5).0, x_t);
    }
}
