//! The training configuration: a YAML file in the spirit of ai-toolkit's, with environment
//! overrides (`BURNLORA_TRAIN__STEPS=10` sets `train.steps`).
//!
//! Parsing ([`TrainYaml`], plain serde, unknown keys rejected) is separate from validation
//! ([`TrainPlan::from_yaml`]), which checks every value, resolves relative paths against the
//! folder of the configuration file, and names each field at fault with what is allowed.
//! CONFIG.md at the repository root documents every key and its default.
//!
//! ```no_run
//! let plan = burn_lora_train::config::TrainPlan::load("flux_lora.yaml".as_ref())?;
//! println!("{} steps, writing to {}", plan.train.steps, plan.run_dir().display());
//! # Ok::<(), burn_lora_train::config::ConfigError>(())
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use burn::tensor::{DType, FloatDType};
use burn_diffusion::Checkpointing;
use burn_diffusion::sdxl::TEXT_ENCODERS;
use burn_kernels::{AttentionRoute, BlasRoute, KernelOptions, StreamOrder};
use burn_lora::{AdapterConfig, AdapterKind, Format, LokrConfig, LoraConfig, LoraPlan};
use burn_quant::Fp8Format;
use serde::{Deserialize, Deserializer, Serialize};

use crate::dataset::FrameExtraction;
pub use crate::family::{Arch, Objective};
use crate::rng::Rng;

/// The prefix of environment variables that override configuration keys.
pub const ENV_PREFIX: &str = "BURNLORA_";

/// One problem in a configuration: the dotted path of the field and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldProblem {
    /// The dotted path of the field (`train.steps`, `datasets[0].resolution`); empty for the
    /// file as a whole.
    pub field: String,
    /// What is wrong and what is allowed.
    pub message: String,
}

impl fmt::Display for FieldProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "`{}`: {}", self.field, self.message)
        }
    }
}

/// A configuration that cannot be used: the file and every problem found in it.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    /// The configuration file.
    pub file: PathBuf,
    /// Every problem, in the order of the file's sections (at least one).
    pub problems: Vec<FieldProblem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.problems.as_slice() {
            [one] => write!(f, "{}: {one}", self.file.display()),
            many => {
                write!(f, "{}: {} problems", self.file.display(), many.len())?;
                many.iter().try_for_each(|p| write!(f, "\n  {p}"))
            }
        }
    }
}

impl ConfigError {
    fn one(file: &Path, field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            file: file.to_path_buf(),
            problems: vec![FieldProblem {
                field: field.into(),
                message: message.into(),
            }],
        }
    }

    /// Whether some problem is about `field` (a dotted path such as `datasets[0].resolution`).
    pub fn concerns(&self, field: &str) -> bool {
        self.problems.iter().any(|p| p.field == field)
    }
}

/// The configuration as written in the YAML file (after environment overrides).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainYaml {
    /// Name of the run: its folder is `<output_dir>/<name>`, its LoRA files `<name>_<step>`.
    pub name: String,
    /// Folder that holds run folders (relative to the config file).
    #[serde(default = "defaults::output_dir")]
    pub output_dir: PathBuf,
    /// The adapter.
    pub network: NetworkYaml,
    /// The base model.
    pub model: ModelYaml,
    /// The optimisation.
    #[serde(default = "defaults::section")]
    pub train: TrainSectionYaml,
    /// The training data (at least one folder).
    pub datasets: Vec<DatasetYaml>,
    /// Checkpointing.
    #[serde(default = "defaults::section")]
    pub save: SaveYaml,
    /// Logging.
    #[serde(default = "defaults::section")]
    pub logging: LoggingYaml,
    /// Which fast kernels run (absent when every choice is the default, so that the resume
    /// fingerprint of a configuration without the section does not depend on it).
    #[serde(
        default = "defaults::section",
        skip_serializing_if = "KernelsYaml::is_default"
    )]
    pub kernels: KernelsYaml,
}

/// `network`: the adapter type, rank and alpha, and which layers it wraps.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkYaml {
    /// `lora` or `lokr`.
    #[serde(rename = "type", default = "defaults::network_type")]
    pub kind: String,
    /// Rank of the adapters on linear layers.
    pub linear: usize,
    /// Alpha of the adapters on linear layers (defaults to the rank: scale 1).
    pub linear_alpha: Option<f64>,
    /// Rank of the adapters on conv layers (0: convs are not wrapped).
    #[serde(default)]
    pub conv: usize,
    /// Alpha of the conv adapters (defaults to their rank).
    pub conv_alpha: Option<f64>,
    /// Dropout on the adapter input, in [0, 1).
    #[serde(default)]
    pub dropout: f64,
    /// LoKr: size of the first Kronecker factor (absent: the most balanced split).
    pub lokr_factor: Option<usize>,
    /// LoKr: keep the second factor as a full matrix instead of a rank-`linear` product.
    #[serde(default)]
    pub lokr_full_rank: bool,
    /// Regular expressions searched in module paths: only matching layers are wrapped (all
    /// when empty).
    #[serde(default)]
    pub include: Vec<String>,
    /// Regular expressions searched in module paths: matching layers are left alone.
    #[serde(default)]
    pub exclude: Vec<String>,
    /// A LoRA file to start from (kohya, PEFT / diffusers, ai-toolkit or OneTrainer layout):
    /// its adapters, with their ranks and alphas, replace fresh ones on their layers.
    pub pretrained_lora_path: Option<PathBuf>,
}

/// `model`: which model, where, and how its frozen weights reach the device.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelYaml {
    /// Architecture: `flux1` (FLUX.1 dev / schnell), `flux2` (FLUX.2 dev / klein), `sdxl`
    /// (Stable Diffusion XL) or `wan` (Wan 2.1 text-to-video).
    pub arch: String,
    /// A diffusers folder, or the transformer's single file (BFL layout, FP8 included) with the
    /// other components given below, relative to the config file; the word `tiny` builds a
    /// small random model instead (for trying the tool), and `random:flux1-dev` /
    /// `random:flux1-schnell` a full-size one with random weights (for measuring speed and
    /// memory).
    pub path: PathBuf,
    /// The transformer, when not the one of `path`: a folder or a single file.
    #[serde(default)]
    pub transformer: Option<PathBuf>,
    /// Wan 2.2 A14B's low-noise expert, trained with one LoRA together with the transformer of
    /// `path` (the high-noise expert), each on its own timesteps (`train.timestep_boundary`):
    /// the pipeline folder (read at its `transformer_2/`, as diffusers' pipeline names it), that
    /// folder itself or a single file; with `path: tiny` or `random:<shape>`, the same word: a
    /// second model of that shape with weights of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer_2: Option<PathBuf>,
    /// SDXL's UNet, when not the one of `path`: a diffusers folder or an all-in-one file.
    #[serde(default)]
    pub unet: Option<PathBuf>,
    /// The VAE, when not the one of `path`: a folder or a single file (`ae.safetensors`).
    #[serde(default)]
    pub vae: Option<PathBuf>,
    /// CLIP-L, when not the one of `path`: a folder or a single file (`clip_l.safetensors`).
    #[serde(default)]
    pub text_encoder: Option<PathBuf>,
    /// T5-XXL, when not the one of `path`: a folder or a single file (`t5xxl_fp16.safetensors`).
    #[serde(default)]
    pub text_encoder_2: Option<PathBuf>,
    /// Folder holding the tokenizers as a diffusers folder does (`tokenizer/` for CLIP,
    /// `tokenizer_2/` for T5), relative to the config file; default: `path` for a diffusers
    /// folder, the config file's folder for `tiny` and `random:` models.
    #[serde(default)]
    pub tokenizers: Option<PathBuf>,
    /// Compute dtype of the base: `bf16` or `f32`.
    #[serde(default = "defaults::dtype")]
    pub dtype: String,
    /// Format of the frozen weights on the bus: `none` (the dtype), `e5m2` or `e4m3`.
    #[serde(default = "defaults::quantize")]
    pub quantize: String,
    /// Compute dtype of the VAE that encodes the images before training: `f32` (as kohya's
    /// `--no_half_vae` and diffusers' `force_upcast`) or `bf16` (half its memory, as
    /// musubi-tuner's `--vae_dtype bfloat16`); the latents are kept in `dtype` either way.
    #[serde(default = "defaults::vae_dtype")]
    pub vae_dtype: String,
    /// Streaming of frozen weights from host memory.
    #[serde(default = "defaults::section")]
    pub offload: OffloadYaml,
}

/// `model.offload`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadYaml {
    /// Device memory the run may use, in GB (decimal): resident weights, the ring, activations,
    /// adapters, gradients, optimizer state; 0 streams every frozen weight; absent: no
    /// streaming, all resident.
    pub vram_budget_gb: Option<f64>,
    /// Device buffers in the prefetch ring (at least 2).
    #[serde(default = "defaults::ring_slots")]
    pub ring_slots: usize,
    /// Whether the loader decodes each prefetched FP8 weight ahead of its use, off the
    /// compute stream.
    #[serde(default)]
    pub decode_ahead: bool,
}

/// `train`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TrainSectionYaml {
    /// Optimizer steps.
    #[serde(default = "defaults::steps")]
    pub steps: u64,
    /// Samples per micro-batch.
    #[serde(default = "defaults::one")]
    pub batch_size: usize,
    /// Micro-batches per optimizer step (on each device).
    #[serde(default = "defaults::one")]
    pub gradient_accumulation_steps: usize,
    /// GPUs of this host that train data-parallel, one replica each (the first `devices`).
    #[serde(default = "defaults::one", skip_serializing_if = "defaults::is_one")]
    pub devices: usize,
    /// Peak learning rate.
    #[serde(default = "defaults::lr")]
    pub lr: f64,
    /// `adamw` (f32 moments) or `adamw8bit` (block-wise 8-bit moments).
    #[serde(default = "defaults::optimizer")]
    pub optimizer: String,
    /// `device` or `host`: where the optimizer state (moments, master copies) lives and is
    /// updated.
    #[serde(default = "defaults::optimizer_state")]
    pub optimizer_state: String,
    /// `device` or `host`: where the adapters' gradients are summed: in the autodiff graph on
    /// the device, or in host memory, each copied there as the backward produces it (needs
    /// `optimizer_state: host`); absent: where the optimizer state is.
    #[serde(default)]
    pub gradients: Option<String>,
    /// AdamW weight decay (decoupled).
    #[serde(default = "defaults::weight_decay")]
    pub weight_decay: f64,
    /// `constant`, `linear` or `cosine` (after warm-up).
    #[serde(default = "defaults::lr_scheduler")]
    pub lr_scheduler: String,
    /// Steps of linear warm-up from 0.
    #[serde(default)]
    pub lr_warmup_steps: u64,
    /// Gradient clipping by global norm (0: off).
    #[serde(default = "defaults::max_grad_norm")]
    pub max_grad_norm: f64,
    /// Recompute each block in backward instead of storing its activations.
    #[serde(default = "defaults::yes")]
    pub gradient_checkpointing: bool,
    /// With `gradient_checkpointing`, keep each block's inputs in host memory until its
    /// recomputation (musubi-tuner's `--gradient_checkpointing_cpu_offload`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gradient_checkpointing_cpu_offload: bool,
    /// Train LoRA on the text encoders too (SDXL's CLIP-L and bigG: every layer's attention
    /// and MLP Linears, whatever `network.include` says); their encodings are then computed
    /// in every step instead of cached.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub train_text_encoder: bool,
    /// σ sampling: `uniform`, `sigmoid` (= `logit_normal`), `shift` or `flux2_shift` (=
    /// `flux_shift`); default: the family's ([`Arch::default_timestep_type`]).
    #[serde(default)]
    pub timestep_type: Option<String>,
    /// Shift value for `timestep_type: shift` (FLUX.1-dev uses 3.0).
    #[serde(default = "defaults::shift")]
    pub timestep_shift: f64,
    /// Lowest timestep trained, 0–999 (of 1000; σ = t / 1000 for flow matching); absent: 0.
    /// With `max_timestep`, what trains one expert of a two-expert model (Wan 2.2 A14B's
    /// high-noise expert: 875–1000, its low-noise expert: 0–875).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_timestep: Option<u32>,
    /// Highest timestep trained, 1–1000; absent: 1000.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_timestep: Option<u32>,
    /// With `model.transformer_2`: the timestep (of 1000) from which the transformer of
    /// `model.path` (the high-noise expert) denoises, and below which `transformer_2` does;
    /// absent: 875 (Wan 2.2 A14B text-to-video's `boundary_ratio`; 900 for image-to-video).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestep_boundary: Option<u32>,
    /// Keep `timestep_type`'s distribution within [`min_timestep`, `max_timestep`] by drawing
    /// again until a timestep falls inside (musubi-tuner's `--preserve_distribution_shape`);
    /// false: the draw in [0, 1] is scaled into the range.
    ///
    /// [`min_timestep`]: TrainSectionYaml::min_timestep
    /// [`max_timestep`]: TrainSectionYaml::max_timestep
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub preserve_distribution_shape: bool,
    /// Guidance value fed to guidance-distilled models (FLUX.1-dev).
    #[serde(default = "defaults::guidance")]
    pub guidance_scale: f64,
    /// What a DDPM model (SDXL) is trained to predict: `epsilon` (the noise, the default) or
    /// `v_prediction` (the velocity, for v-parameterized fine-tunes).
    #[serde(default)]
    pub prediction_type: Option<String>,
    /// Min-SNR-γ loss weighting of a DDPM model (5 is the usual value); absent: off.
    #[serde(default)]
    pub min_snr_gamma: Option<f64>,
    /// Noise offset of a DDPM model: a per-channel constant drawn from N(0, offset²) added to
    /// each sample's noise (0.0357 in kohya's SDXL examples); 0: off.
    #[serde(default)]
    pub noise_offset: f64,
    /// Consecutive non-finite losses after which training stops (with a checkpoint).
    #[serde(default = "defaults::max_nan_steps")]
    pub max_nan_steps: usize,
    /// Seed of every random choice (data order, noise, σ, dropout).
    #[serde(default = "defaults::seed")]
    pub seed: u64,
}

/// One entry of `datasets`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetYaml {
    /// Folder of images, videos and frame folders with same-stem caption files (relative to
    /// the config file).
    pub folder_path: PathBuf,
    /// Extension of caption files (with or without the dot).
    #[serde(default = "defaults::caption_ext")]
    pub caption_ext: String,
    /// Bucket resolutions (the side of the square of equal area), multiples of 16; a single
    /// number or a list.
    #[serde(default = "defaults::resolution", deserialize_with = "resolutions")]
    pub resolution: Vec<usize>,
    /// Times each image is seen per epoch.
    #[serde(default = "defaults::one")]
    pub num_repeats: usize,
    /// Probability of training a sample with an empty caption.
    #[serde(default)]
    pub caption_dropout_rate: f64,
    /// Keep latents and text embeddings in a cache folder beside the images.
    #[serde(default = "defaults::yes")]
    pub cache_latents_to_disk: bool,
    /// Frame counts of the clips (each 4k + 1); a single number or a list. `[1]`: images, and
    /// the first frame of videos and frame folders.
    #[serde(
        default = "defaults::frames",
        deserialize_with = "frame_counts",
        skip_serializing_if = "defaults::is_one_frame"
    )]
    pub frames: Vec<usize>,
    /// Frames per second that videos are resampled to before clips are cut; absent: their own
    /// rate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fps: Option<f64>,
    /// Where clips start in a longer video or frame folder: `head` or `uniform`.
    #[serde(
        default = "defaults::frame_extraction",
        skip_serializing_if = "defaults::is_head"
    )]
    pub frame_extraction: String,
    /// Clips per frame count with `frame_extraction: uniform` (1 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_sample: Option<usize>,
}

/// `save`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SaveYaml {
    /// Save every this many steps (and at the end).
    #[serde(default = "defaults::save_every")]
    pub save_every: u64,
    /// How many step checkpoints to keep (older ones are deleted).
    #[serde(default = "defaults::keep")]
    pub max_step_saves_to_keep: usize,
    /// File format of the LoRA: `kohya` (ComfyUI, kohya, Forge), `peft` or `diffusers`
    /// (diffusers / PEFT), `ai-toolkit` (ComfyUI, ai-toolkit).
    #[serde(default = "defaults::format")]
    pub format: String,
    /// dtype of the saved LoRA weights: `bf16`, `f16` or `f32`.
    #[serde(default = "defaults::save_dtype")]
    pub dtype: String,
}

/// `logging`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LoggingYaml {
    /// Log a line (and a loss CSV row) every this many steps.
    #[serde(default = "defaults::one_u64")]
    pub log_every: u64,
    /// Show a progress bar on the terminal.
    #[serde(default = "defaults::yes")]
    pub progress_bar: bool,
}

/// `kernels`: the fast paths of the ops (burn-kernels' `KernelOptions`). They change the
/// numerics slightly, so they are part of the resume fingerprint and of the LoRA metadata.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KernelsYaml {
    /// Matrix products through cuBLAS: `auto`, `off`, `large` or `all`.
    #[serde(default = "defaults::blas")]
    pub blas: String,
    /// Attention: `fused` or `separate`.
    #[serde(default = "defaults::fused")]
    pub attention: String,
    /// GELU, layer norm, and RMS norm with the rotary embedding: `fused` or `separate`.
    #[serde(default = "defaults::fused")]
    pub elementwise: String,
    /// How the side streams keep CubeCL's order: `device` or `host`.
    #[serde(default = "defaults::order")]
    pub order: String,
}

impl KernelsYaml {
    fn is_default(&self) -> bool {
        *self == defaults::section::<Self>()
    }
}

/// Accepts `512` as well as `[512, 768]`.
fn resolutions<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<usize>, D::Error> {
    one_or_many(deserializer, "a resolution")
}

/// Accepts `33` as well as `[1, 33]`.
fn frame_counts<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<usize>, D::Error> {
    one_or_many(deserializer, "a frame count")
}

/// A number or a list of numbers, as a list; else an error that names `what` one is.
fn one_or_many<'de, D: Deserializer<'de>>(
    deserializer: D,
    what: &str,
) -> Result<Vec<usize>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(usize),
        Many(Vec<usize>),
    }
    match OneOrMany::deserialize(deserializer) {
        Ok(OneOrMany::One(one)) => Ok(vec![one]),
        Ok(OneOrMany::Many(many)) => Ok(many),
        Err(_) => Err(serde::de::Error::custom(format!(
            "expected {what} (a positive integer) or a list of them"
        ))),
    }
}

mod defaults {
    use std::path::PathBuf;

    use serde::Deserialize;

    /// A section with every field at its default, as when the section is absent.
    pub fn section<T: for<'de> Deserialize<'de>>() -> T {
        T::deserialize(serde::de::value::MapDeserializer::<
            std::iter::Empty<(String, String)>,
            serde::de::value::Error,
        >::new(std::iter::empty()))
        .expect("every field of this section has a default")
    }
    pub fn output_dir() -> PathBuf {
        "output".into()
    }
    pub fn network_type() -> String {
        "lora".into()
    }
    pub fn dtype() -> String {
        "bf16".into()
    }
    pub fn quantize() -> String {
        "none".into()
    }
    pub fn vae_dtype() -> String {
        "f32".into()
    }
    pub fn ring_slots() -> usize {
        8
    }
    pub fn steps() -> u64 {
        1000
    }
    pub fn one() -> usize {
        1
    }
    /// Whether `n` is 1, the default left out of a serialized section.
    pub fn is_one(n: &usize) -> bool {
        *n == 1
    }
    pub fn one_u64() -> u64 {
        1
    }
    pub fn lr() -> f64 {
        1e-4
    }
    pub fn optimizer() -> String {
        "adamw8bit".into()
    }
    pub fn optimizer_state() -> String {
        "device".into()
    }
    pub fn weight_decay() -> f64 {
        1e-2
    }
    pub fn lr_scheduler() -> String {
        "constant".into()
    }
    pub fn max_grad_norm() -> f64 {
        1.0
    }
    pub fn yes() -> bool {
        true
    }
    pub fn shift() -> f64 {
        3.0
    }
    pub fn guidance() -> f64 {
        1.0
    }
    pub fn max_nan_steps() -> usize {
        5
    }
    pub fn seed() -> u64 {
        42
    }
    pub fn caption_ext() -> String {
        "txt".into()
    }
    pub fn frames() -> Vec<usize> {
        vec![1]
    }
    pub fn is_one_frame(frames: &[usize]) -> bool {
        frames == [1]
    }
    pub fn frame_extraction() -> String {
        "head".into()
    }
    pub fn is_head(word: &str) -> bool {
        word == "head"
    }
    pub fn resolution() -> Vec<usize> {
        vec![512]
    }
    pub fn save_every() -> u64 {
        250
    }
    pub fn keep() -> usize {
        4
    }
    pub fn format() -> String {
        "kohya".into()
    }
    pub fn save_dtype() -> String {
        "bf16".into()
    }
    pub fn blas() -> String {
        "auto".into()
    }
    pub fn fused() -> String {
        "fused".into()
    }
    pub fn order() -> String {
        "device".into()
    }
}

impl TrainYaml {
    /// Reads `path` (YAML), then applies overrides from `env`.
    ///
    /// A variable `BURNLORA_<SECTION>__<KEY>` (levels separated by `__`, any case) sets
    /// `<section>.<key>`; `BURNLORA_NAME` and `BURNLORA_OUTPUT_DIR` set the two top-level
    /// scalars. Values are parsed as booleans, integers or floats when they look like one.
    /// Other `BURNLORA_*` variables (such as `BURNLORA_LOG`) are not configuration keys and
    /// are ignored; entries of `datasets` cannot be overridden.
    pub fn load_with_env(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        if !path.is_file() {
            return Err(ConfigError::one(
                path,
                "",
                "the configuration file does not exist",
            ));
        }
        let overrides = env
            .into_iter()
            .filter(|(key, _)| {
                let upper = key.to_ascii_uppercase();
                upper.strip_prefix(ENV_PREFIX).is_some_and(|rest| {
                    rest.contains("__") || rest == "NAME" || rest == "OUTPUT_DIR"
                })
            })
            .collect();
        let built = config::Config::builder()
            .add_source(config::File::from(path).format(config::FileFormat::Yaml))
            .add_source(
                config::Environment::with_prefix(ENV_PREFIX.trim_end_matches('_'))
                    .prefix_separator("_")
                    .separator("__")
                    .try_parsing(true)
                    .source(Some(overrides)),
            )
            .build()
            .map_err(|e| from_config_error(path, e))?;
        built
            .try_deserialize()
            .map_err(|e| from_config_error(path, e))
    }
}

/// Turns an error of the `config` crate into a [`ConfigError`] naming the field.
fn from_config_error(path: &Path, error: config::ConfigError) -> ConfigError {
    let (key, inner) = match &error {
        config::ConfigError::Type { key, .. } => (key.clone(), error.to_string()),
        config::ConfigError::At {
            error: inner, key, ..
        } => (key.clone(), inner.to_string()),
        config::ConfigError::NotFound(key) => {
            return ConfigError::one(path, normalize_key(key), "missing; this key is required");
        }
        _ => (None, error.to_string()),
    };
    let key = normalize_key(&key.unwrap_or_default());
    // serde reports unknown and missing fields on the enclosing map: name the field itself.
    let named = ["unknown field `", "missing field `"]
        .iter()
        .find_map(|start| inner.strip_prefix(start))
        .and_then(|rest| rest.split_once('`'))
        .map(|(name, _)| join(&key, name));
    let message = strip_location(&inner);
    ConfigError::one(path, named.unwrap_or(key), message)
}

/// Writes a key of the `config` crate as a dotted path: `datasets[0]resolution` (as it joins
/// list indices) becomes `datasets[0].resolution`.
fn normalize_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    let mut after_index = false;
    for c in key.chars() {
        if after_index && c != '.' && c != '[' {
            out.push('.');
        }
        after_index = c == ']';
        out.push(c);
    }
    out.replace(".[", "[")
}

/// Drops the ` for key ...` / ` in ...` suffixes that the `config` crate appends: the field
/// and file are reported separately.
fn strip_location(message: &str) -> String {
    let cut = [" for key `", " in "]
        .iter()
        .filter_map(|s| message.find(s))
        .min()
        .unwrap_or(message.len());
    message[..cut].to_string()
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}.{name}")
    }
}

/// The adapter, validated.
#[derive(Clone, Debug)]
pub struct NetworkPlan {
    /// LoRA or LoKr.
    pub kind: AdapterKind,
    /// Which layers get which adapter (patterns, ranks, alphas, dropout).
    pub lora: LoraPlan,
    /// The LoRA file training starts from (absolute path).
    pub pretrained: Option<PathBuf>,
}

/// Where the base model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A small model with random weights, built in memory.
    Tiny,
    /// A full-size model with random weights, built on the device, of a shape the family names
    /// (`random:<shape>`, see [`Arch::random_shapes`]).
    Random(String),
    /// Files on disk.
    Files(ModelFiles),
}

/// Where each component of a model is read from (absolute paths), by the family's component
/// names ([`Arch::components`]): a diffusers pipeline folder, the component's own folder, or
/// a single file, as each loader accepts them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFiles(BTreeMap<String, PathBuf>);

impl ModelFiles {
    /// Every one of `components` from one diffusers pipeline folder.
    pub fn pipeline(folder: &Path, components: &[&str]) -> Self {
        Self(
            components
                .iter()
                .map(|c| (c.to_string(), folder.to_path_buf()))
                .collect(),
        )
    }

    /// `component` read from `path` instead.
    pub fn with(mut self, component: &str, path: PathBuf) -> Self {
        self.0.insert(component.to_string(), path);
        self
    }

    /// Where `component` is read from; the configuration checked that the family's components
    /// are all there.
    pub fn get(&self, component: &str) -> &Path {
        self.0
            .get(component)
            .unwrap_or_else(|| panic!("no `{component}` among the model's files"))
    }
}

/// The base model, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPlan {
    /// Architecture.
    pub arch: Arch,
    /// Weights.
    pub source: ModelSource,
    /// Folder of the tokenizers (`tokenizer/`, `tokenizer_2/`), absolute.
    pub tokenizers: PathBuf,
    /// Compute dtype of the base (`BF16` or `F32`).
    pub dtype: DType,
    /// FP8 format of the frozen weights on the bus; `None` sends them in `dtype`.
    pub wire: Option<Fp8Format>,
    /// Compute dtype of the VAE (`F32` or `BF16`).
    pub vae_dtype: FloatDType,
    /// Device memory the run may use in bytes (weights, ring, and everything else the
    /// training keeps on the device); `Some(0)`: every frozen weight streams; `None`: every
    /// weight resident.
    pub vram_budget_bytes: Option<u64>,
    /// Device buffers in the prefetch ring (≥ 2).
    pub ring_slots: usize,
    /// Whether the loader decodes prefetched FP8 weights ahead of their use
    /// (`model.offload.decode_ahead`).
    pub decode_ahead: bool,
    /// The low-noise expert of a two-expert model (`model.transformer_2`): its transformer as a
    /// model source of the kind of `source` (for files, `source`'s files with another
    /// `transformer`; `tiny` and `random:` build one with weights of its own).
    pub transformer_2: Option<ModelSource>,
}

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// AdamW with f32 moments.
    AdamW,
    /// AdamW with block-wise 8-bit moments.
    AdamW8bit,
}

/// Where the optimizer state lives and is updated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerState {
    /// Beside the adapters, on their device.
    Device,
    /// In host memory, updated on the CPU; the device holds the adapters (and, with the
    /// gradients summed on the device, their gradients).
    Host,
}

/// Where the adapters' gradients are summed until the optimizer step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradientPlacement {
    /// In the autodiff graph's gradients, on the device, until the backward ends.
    Device,
    /// In host memory, each copied there as the backward produces it.
    Host,
}

/// Shape of the learning-rate curve after warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerKind {
    /// The peak rate throughout.
    Constant,
    /// Linear decay from the peak to 0 at the last step.
    Linear,
    /// Half-cosine decay from the peak to 0 at the last step.
    Cosine,
}

/// What a DDPM model is trained to predict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Prediction {
    /// The noise ε.
    #[default]
    Epsilon,
    /// The velocity `v = sqrt(ᾱ)·ε − sqrt(1 − ᾱ)·x₀`.
    Velocity,
}

/// The DDPM objective, validated.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct DdpmSettings {
    /// The target.
    pub prediction: Prediction,
    /// Min-SNR-γ weighting; `None`: every timestep weighs 1.
    pub min_snr_gamma: Option<f64>,
    /// Standard deviation of the per-channel noise offset (0: none).
    pub noise_offset: f64,
}

/// How σ (the flow-matching time) is drawn for each sample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TimestepSampling {
    /// Uniform in [0, 1).
    Uniform,
    /// Logit-normal: `σ = sigmoid(n)`, `n ~ N(0, 1)` (ai-toolkit's `sigmoid`, SD3's
    /// `logit_normal`).
    LogitNormal,
    /// Uniform `u` shifted towards noise: `σ = s·u / (1 + (s − 1)·u)` with shift `s`.
    Shift(f64),
    /// Logit-normal, shifted by `s = exp(μ)` with μ linear in the image's token count: 0.5 at
    /// 256 tokens, 1.15 at 4096 (a 1024² image of FLUX.1 or FLUX.2, where `s` ≈ 3.16), as
    /// musubi-tuner's `flux_shift` / `flux2_shift` and BFL's sampling schedules.
    ResolutionShift,
}

/// The part of [0, 1] that σ is drawn from (`train.min_timestep` … `max_timestep` over 1000).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimestepRange {
    /// Lowest σ.
    pub min: f64,
    /// Highest σ.
    pub max: f64,
    /// Draw again until σ falls inside (true), or scale the draw into the range (false).
    pub preserve_shape: bool,
}

impl TimestepRange {
    /// All of [0, 1].
    pub const FULL: Self = Self {
        min: 0.0,
        max: 1.0,
        preserve_shape: false,
    };

    /// Draws at most this many times to keep the distribution's shape, as musubi-tuner does,
    /// then scales the last draw into the range.
    const DRAWS: usize = 1000;

    /// Draws one σ from `sampling` for an image of `tokens` tokens, within the range.
    pub fn sample(self, sampling: TimestepSampling, tokens: usize, rng: &mut Rng) -> f64 {
        let mut sigma = sampling.sample_at(tokens, rng);
        if self.preserve_shape {
            for _ in 0..Self::DRAWS {
                if (self.min..=self.max).contains(&sigma) {
                    return sigma;
                }
                sigma = sampling.sample_at(tokens, rng);
            }
        }
        self.min + sigma * (self.max - self.min)
    }
}

impl TimestepSampling {
    /// Draws one σ in [0, 1] from `rng` for an image of `tokens` tokens (which only
    /// [`TimestepSampling::ResolutionShift`] reads).
    pub fn sample_at(self, tokens: usize, rng: &mut Rng) -> f64 {
        let shifted = |s: f64, u: f64| s * u / (1.0 + (s - 1.0) * u);
        let logit_normal = |rng: &mut Rng| 1.0 / (1.0 + (-rng.normal()).exp());
        match self {
            Self::Uniform => rng.uniform(),
            Self::LogitNormal => logit_normal(rng),
            Self::Shift(s) => shifted(s, rng.uniform()),
            Self::ResolutionShift => {
                let mu = 0.5 + (1.15 - 0.5) * (tokens as f64 - 256.0) / (4096.0 - 256.0);
                shifted(mu.exp(), logit_normal(rng))
            }
        }
    }
}

/// The optimisation, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainSettings {
    /// Optimizer steps.
    pub steps: u64,
    /// Samples per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step on each device.
    pub gradient_accumulation_steps: usize,
    /// Devices training data-parallel: each optimizer step takes `devices ×
    /// gradient_accumulation_steps` micro-batches, and its gradient is their mean.
    pub devices: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// The optimizer.
    pub optimizer: OptimizerKind,
    /// Where its state lives.
    pub optimizer_state: OptimizerState,
    /// Where the gradients are summed.
    pub gradients: GradientPlacement,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Learning-rate curve after warm-up.
    pub lr_scheduler: SchedulerKind,
    /// Steps of linear warm-up.
    pub lr_warmup_steps: u64,
    /// Global-norm clipping threshold; `None`: no clipping.
    pub max_grad_norm: Option<f64>,
    /// Block-level gradient checkpointing, and where the blocks' inputs wait.
    pub gradient_checkpointing: Checkpointing,
    /// Whether the text encoders train (with adapters) beside the denoiser.
    pub train_text_encoder: bool,
    /// σ sampling.
    pub timestep: TimestepSampling,
    /// Where σ is drawn.
    pub timestep_range: TimestepRange,
    /// The σ from which a two-expert model's first expert denoises (`train.timestep_boundary`
    /// / 1000); read only with `model.transformer_2`.
    pub timestep_boundary: f64,
    /// Guidance value for guidance-distilled models.
    pub guidance_scale: f64,
    /// The DDPM objective's settings (families trained by flow matching ignore them).
    pub ddpm: DdpmSettings,
    /// Consecutive non-finite losses that stop the run.
    pub max_nan_steps: usize,
    /// Seed of every random choice.
    pub seed: u64,
}

/// One dataset folder, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct DatasetPlan {
    /// The folder (absolute).
    pub folder: PathBuf,
    /// Caption file extension, without the dot.
    pub caption_ext: String,
    /// Bucket resolutions, multiples of 16, in the order given.
    pub resolutions: Vec<usize>,
    /// Times each image is seen per epoch.
    pub repeats: usize,
    /// Probability of an empty caption.
    pub caption_dropout: f64,
    /// Cache latents and embeddings beside the images.
    pub cache_to_disk: bool,
    /// Frame counts of the clips (each 4k + 1), in the order given.
    pub frames: Vec<usize>,
    /// Frames per second that videos are resampled to; `None`: their own rate.
    pub fps: Option<f64>,
    /// Where clips start in a longer video or frame folder.
    pub extraction: FrameExtraction,
}

/// Checkpointing, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct SavePlan {
    /// Steps between checkpoints.
    pub every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// LoRA file naming.
    pub format: Format,
    /// dtype of saved LoRA weights (`BF16`, `F16` or `F32`).
    pub dtype: DType,
}

/// Logging, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoggingPlan {
    /// Steps between log lines and loss CSV rows.
    pub every: u64,
    /// Show a progress bar.
    pub progress_bar: bool,
}

/// A validated configuration: typed values, absolute paths.
#[derive(Clone, Debug)]
pub struct TrainPlan {
    /// The configuration file it came from.
    pub file: PathBuf,
    /// Name of the run.
    pub name: String,
    /// Folder holding run folders (absolute).
    pub output_dir: PathBuf,
    /// The adapter.
    pub network: NetworkPlan,
    /// The base model.
    pub model: ModelPlan,
    /// The optimisation.
    pub train: TrainSettings,
    /// The dataset folders.
    pub datasets: Vec<DatasetPlan>,
    /// Checkpointing.
    pub save: SavePlan,
    /// Logging.
    pub logging: LoggingPlan,
    /// The fast paths of the ops, installed for the run.
    pub kernels: KernelOptions,
    /// The configuration as read (after environment overrides), for file metadata.
    pub source: TrainYaml,
}

/// Collects the problems of one configuration.
struct Checker {
    problems: Vec<FieldProblem>,
}

impl Checker {
    fn fail(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.problems.push(FieldProblem {
            field: field.into(),
            message: message.into(),
        });
    }

    /// `value` when `ok`, else a problem and `None`.
    fn require<T>(&mut self, ok: bool, value: T, field: &str, allowed: &str) -> Option<T>
    where
        T: fmt::Debug,
    {
        if !ok {
            self.fail(field, format!("{value:?} is not allowed; {allowed}"));
            return None;
        }
        Some(value)
    }

    /// The choice that `word` names (case-insensitive), or a problem listing the choices.
    fn choose<T: Copy>(&mut self, field: &str, word: &str, choices: &[(&str, T)]) -> Option<T> {
        let found = choices
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(word.trim()));
        if found.is_none() {
            let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
            self.fail(
                field,
                format!(
                    "`{word}` is not allowed; expected one of: {}",
                    names.join(", ")
                ),
            );
        }
        found.map(|(_, v)| *v)
    }

    fn positive(&mut self, field: &str, value: f64) -> Option<f64> {
        self.require(
            value.is_finite() && value > 0.0,
            value,
            field,
            "expected a finite number > 0",
        )
    }

    fn at_least<T: PartialOrd + fmt::Debug + fmt::Display + Copy>(
        &mut self,
        field: &str,
        value: T,
        min: T,
    ) -> Option<T> {
        let allowed = format!("expected at least {min}");
        self.require(value >= min, value, field, &allowed)
    }

    fn unit_interval(&mut self, field: &str, value: f64, open_top: bool) -> Option<f64> {
        let ok = value.is_finite() && value >= 0.0 && (value < 1.0 || !open_top && value == 1.0);
        let allowed = if open_top {
            "expected a number in [0, 1)"
        } else {
            "expected a number in [0, 1]"
        };
        self.require(ok, value, field, allowed)
    }
}

const DTYPES: &[(&str, DType)] = &[
    ("bf16", DType::BF16),
    ("bfloat16", DType::BF16),
    ("f16", DType::F16),
    ("fp16", DType::F16),
    ("float16", DType::F16),
    ("f32", DType::F32),
    ("fp32", DType::F32),
    ("float32", DType::F32),
];

impl TrainPlan {
    /// Reads and validates `path`, without overrides.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_with_env(path, [])
    }

    /// Reads and checks `path` with overrides from `env` (see [`TrainYaml::load_with_env`]);
    /// the `burnlora` binary passes the process environment.
    pub fn load_with_env(
        path: &Path,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        Self::from_yaml(path, TrainYaml::load_with_env(path, env)?)
    }

    /// Validates `yaml`, read from `file` (relative paths are resolved against its folder).
    /// Every problem is reported, each with its field.
    pub fn from_yaml(file: &Path, yaml: TrainYaml) -> Result<Self, ConfigError> {
        let base = std::path::absolute(file)
            .ok()
            .and_then(|f| f.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        let resolve = |p: &Path| {
            if p.is_absolute() {
                p.to_path_buf()
            } else {
                base.join(p)
            }
        };
        let mut c = Checker {
            problems: Vec::new(),
        };

        let name_ok = !yaml.name.is_empty()
            && yaml
                .name
                .chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "._-".contains(ch))
            && !yaml.name.starts_with('.');
        c.require(
            name_ok,
            &yaml.name,
            "name",
            "expected letters, digits, `.`, `_` or `-` (it names files), not starting with `.`",
        );

        let network = check_network(&mut c, &yaml.network, &resolve);
        let model = check_model(&mut c, &yaml.model, &resolve);
        // The architecture as written, also when another model field is wrong, so that the
        // train section is checked against it.
        let arch = model.as_ref().map(|m| m.arch).or_else(|| {
            Arch::ALL
                .iter()
                .find(|(name, _)| *name == yaml.model.arch)
                .map(|(_, arch)| *arch)
        });
        let train = check_train(&mut c, &yaml.train, arch.unwrap_or(Arch::Flux1));
        if yaml.datasets.is_empty() {
            c.fail("datasets", "expected at least one dataset folder");
        }
        let datasets: Vec<Option<DatasetPlan>> = yaml
            .datasets
            .iter()
            .enumerate()
            .map(|(i, d)| check_dataset(&mut c, i, d, &resolve))
            .collect();
        let save = check_save(&mut c, &yaml.save);
        if yaml.train.train_text_encoder && yaml.save.format == Format::AiToolkit.name() {
            c.fail(
                "save.format",
                "ai-toolkit files have no names for text-encoder layers; with \
                 train.train_text_encoder, choose kohya or peft"
                    .to_string(),
            );
        }
        check_experts(&mut c, &yaml, train.as_ref());
        let network = network.map(|mut network| {
            if yaml.train.train_text_encoder && !yaml.network.include.is_empty() {
                let pattern = format!("^({})\\.", TEXT_ENCODERS.join("|"));
                network.lora = network.lora.include(&pattern).expect("a valid pattern");
            }
            network
        });
        let every = c.at_least("logging.log_every", yaml.logging.log_every, 1);
        let kernels = check_kernels(&mut c, &yaml.kernels);

        match (network, model, train, save, every, kernels) {
            (Some(network), Some(model), Some(train), Some(save), Some(every), Some(kernels))
                if c.problems.is_empty() =>
            {
                Ok(Self {
                    file: file.to_path_buf(),
                    name: yaml.name.clone(),
                    output_dir: resolve(&yaml.output_dir),
                    network,
                    model,
                    train,
                    datasets: datasets.into_iter().flatten().collect(),
                    save,
                    logging: LoggingPlan {
                        every,
                        progress_bar: yaml.logging.progress_bar,
                    },
                    kernels,
                    source: yaml,
                })
            }
            _ => Err(ConfigError {
                file: file.to_path_buf(),
                problems: c.problems,
            }),
        }
    }

    /// The run folder: `<output_dir>/<name>`.
    pub fn run_dir(&self) -> PathBuf {
        self.output_dir.join(&self.name)
    }

    /// The configuration as JSON (for LoRA file metadata and the training state).
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.source).expect("the configuration serializes to JSON")
    }

    /// A fingerprint (16 hex digits) of every setting that shapes the training trajectory:
    /// everything except `train.steps`, `train.optimizer_state`, `train.gradients`, `save` and
    /// `logging`, which
    /// may change between a run and its resumption.
    pub fn resume_fingerprint(&self) -> String {
        let mut shaping = self.source.clone();
        shaping.train.steps = 0;
        // The saved state is the same wherever it lived.
        shaping.train.optimizer_state = defaults::optimizer_state();
        shaping.train.gradients = None;
        shaping.save = defaults::section();
        shaping.logging = defaults::section();
        let json = serde_json::to_string(&shaping).expect("the configuration serializes to JSON");
        format!("{:016x}", fnv1a64(json.as_bytes()))
    }
}

/// FNV-1a, 64 bits: a small, stable hash (not for security).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn check_kernels(c: &mut Checker, k: &KernelsYaml) -> Option<KernelOptions> {
    let fused = [("fused", true), ("separate", false)];
    let blas = c.choose(
        "kernels.blas",
        &k.blas,
        &[
            ("auto", BlasRoute::Auto),
            ("off", BlasRoute::Off),
            ("large", BlasRoute::Large),
            ("all", BlasRoute::All),
        ],
    );
    let attention = c.choose(
        "kernels.attention",
        &k.attention,
        &[
            ("fused", AttentionRoute::Fused),
            ("kernels", AttentionRoute::Kernels),
            ("separate", AttentionRoute::Separate),
        ],
    );
    let elementwise = c.choose("kernels.elementwise", &k.elementwise, &fused);
    let order = c.choose(
        "kernels.order",
        &k.order,
        &[("device", StreamOrder::Device), ("host", StreamOrder::Host)],
    );
    Some(KernelOptions {
        blas: blas?,
        attention: attention?,
        fused_elementwise: elementwise?,
        order: order?,
    })
}

fn check_network(
    c: &mut Checker,
    n: &NetworkYaml,
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Option<NetworkPlan> {
    let kind = c.choose(
        "network.type",
        &n.kind,
        &[("lora", AdapterKind::Lora), ("lokr", AdapterKind::Lokr)],
    );
    let rank = c.at_least("network.linear", n.linear, 1);
    let alpha = match n.linear_alpha {
        Some(a) => c.positive("network.linear_alpha", a).map(Some),
        None => Some(None),
    };
    let conv_alpha = match n.conv_alpha {
        Some(a) => c.positive("network.conv_alpha", a).map(Some),
        None => Some(None),
    };
    let dropout = c.unit_interval("network.dropout", n.dropout, true);
    let factor = match n.lokr_factor {
        Some(f) => c.at_least("network.lokr_factor", f, 1).map(Some),
        None => Some(None),
    };
    let mut patterns_ok = true;
    for (list, patterns) in [("include", &n.include), ("exclude", &n.exclude)] {
        for (i, pattern) in patterns.iter().enumerate() {
            if let Err(e) = regex::Regex::new(pattern) {
                c.fail(
                    format!("network.{list}[{i}]"),
                    format!("`{pattern}` is not a valid regular expression: {e}"),
                );
                patterns_ok = false;
            }
        }
    }
    let (kind, rank, alpha, conv_alpha, dropout, factor) =
        (kind?, rank?, alpha?, conv_alpha?, dropout?, factor?);
    if !patterns_ok {
        return None;
    }
    let adapter = |rank: usize, alpha: Option<f64>| -> AdapterConfig {
        match kind {
            AdapterKind::Lora => LoraConfig::new(rank)
                .with_alpha(alpha)
                .with_dropout(dropout)
                .into(),
            AdapterKind::Lokr => LokrConfig::new(rank)
                .with_alpha(alpha)
                .with_factor(factor)
                .with_decompose_w2(!n.lokr_full_rank)
                .with_dropout(dropout)
                .into(),
        }
    };
    let mut plan = LoraPlan::new(adapter(rank, alpha)).expect("validated above");
    if n.conv > 0 {
        plan = plan
            .with_conv(adapter(n.conv, conv_alpha))
            .expect("validated above");
    } else {
        plan = plan.without_convs();
    }
    for p in &n.include {
        plan = plan.include(p).expect("validated above");
    }
    for p in &n.exclude {
        plan = plan.exclude(p).expect("validated above");
    }
    let pretrained = n.pretrained_lora_path.as_deref().map(resolve);
    if let Some(path) = &pretrained
        && !path.is_file()
    {
        c.fail(
            "network.pretrained_lora_path",
            format!("{} is not a file", path.display()),
        );
    }
    Some(NetworkPlan {
        kind,
        lora: plan,
        pretrained,
    })
}

fn check_model(
    c: &mut Checker,
    m: &ModelYaml,
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Option<ModelPlan> {
    let arch = c.choose("model.arch", &m.arch, Arch::ALL)?;
    let given = [
        ("transformer", &m.transformer),
        ("unet", &m.unet),
        ("vae", &m.vae),
        ("text_encoder", &m.text_encoder),
        ("text_encoder_2", &m.text_encoder_2),
    ];
    let mut overrides = Vec::new();
    for (component, path) in given {
        match path {
            Some(_) if !arch.components().contains(&component) => c.fail(
                format!("model.{component}"),
                format!(
                    "{} has no such component; its components are {}",
                    arch.name(),
                    arch.components().join(", ")
                ),
            ),
            Some(path) => overrides.push((component, path.clone())),
            None => {}
        }
    }
    let built_in = |c: &mut Checker| {
        for (component, _) in &overrides {
            c.fail(
                format!("model.{component}"),
                "only with a model folder or file in model.path".to_string(),
            );
        }
    };
    let source = match m.path.to_str() {
        Some("tiny") => {
            built_in(c);
            Some(ModelSource::Tiny)
        }
        Some(other) if other.starts_with("random:") => {
            built_in(c);
            let shape = &other["random:".len()..];
            if arch.random_shapes().contains(&shape) {
                Some(ModelSource::Random(shape.to_string()))
            } else {
                let shapes: Vec<String> = arch
                    .random_shapes()
                    .iter()
                    .map(|s| format!("`random:{s}`"))
                    .collect();
                c.fail(
                    "model.path",
                    format!(
                        "`{other}`: the random {} models are {}",
                        arch.name(),
                        shapes.join(", ")
                    ),
                );
                None
            }
        }
        _ => model_files(c, arch, &resolve(&m.path), &overrides, resolve).map(ModelSource::Files),
    };
    let transformer_2 = match (&m.transformer_2, &source) {
        (None, _) => Some(None),
        (Some(_), _) if arch != Arch::Wan => {
            c.fail(
                "model.transformer_2",
                format!(
                    "{} has one denoiser; a second expert belongs to Wan 2.2 A14B (arch wan)",
                    arch.name()
                ),
            );
            None
        }
        (Some(given), Some(source)) => second_expert(c, source, given, resolve).map(Some),
        (Some(_), None) => None,
    };
    let model_path = resolve(&m.path);
    let folder = match &m.tokenizers {
        Some(folder) => resolve(folder),
        None if model_path.is_dir() => model_path,
        None => resolve(Path::new(".")),
    };
    let found = arch
        .tokenizer_folders()
        .iter()
        .all(|sub| folder.join(sub).is_dir());
    if !found && source.is_some() {
        let wanted: Vec<String> = arch
            .tokenizer_folders()
            .iter()
            .map(|f| format!("{f}/"))
            .collect();
        c.fail(
            "model.tokenizers",
            format!(
                "{} lacks one of the folders {} (the tokenizer files of {})",
                folder.display(),
                wanted.join(", "),
                arch.name()
            ),
        );
    }
    let tokenizers = found.then_some(folder);
    let dtype = c.choose(
        "model.dtype",
        &m.dtype,
        &[
            ("bf16", DType::BF16),
            ("bfloat16", DType::BF16),
            ("f32", DType::F32),
            ("fp32", DType::F32),
            ("float32", DType::F32),
        ],
    );
    let vae_dtype = c.choose(
        "model.vae_dtype",
        &m.vae_dtype,
        &[
            ("f32", FloatDType::F32),
            ("fp32", FloatDType::F32),
            ("float32", FloatDType::F32),
            ("bf16", FloatDType::BF16),
            ("bfloat16", FloatDType::BF16),
        ],
    );
    let wire = c.choose(
        "model.quantize",
        &m.quantize,
        &[
            ("none", None),
            ("e5m2", Some(Fp8Format::E5M2)),
            ("e4m3", Some(Fp8Format::E4M3)),
        ],
    );
    let budget = match m.offload.vram_budget_gb {
        Some(gb) => c
            .require(
                gb.is_finite() && gb >= 0.0,
                gb,
                "model.offload.vram_budget_gb",
                "expected a finite number ≥ 0 (0 streams every frozen weight)",
            )
            .map(|gb| Some((gb * 1e9).round() as u64)),
        None => Some(None),
    };
    let slots = c.at_least("model.offload.ring_slots", m.offload.ring_slots, 2);
    Some(ModelPlan {
        arch,
        source: source?,
        tokenizers: tokenizers?,
        dtype: dtype?,
        wire: wire?,
        vae_dtype: vae_dtype?,
        vram_budget_bytes: budget?,
        ring_slots: slots?,
        decode_ahead: m.offload.decode_ahead,
        transformer_2: transformer_2?,
    })
}

/// `model.transformer_2` (`given`) as a model source of the kind of `source`.
fn second_expert(
    c: &mut Checker,
    source: &ModelSource,
    given: &Path,
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Option<ModelSource> {
    let field = "model.transformer_2";
    match source {
        ModelSource::Tiny if given == Path::new("tiny") => Some(ModelSource::Tiny),
        ModelSource::Random(shape) if given == Path::new(&format!("random:{shape}")) => {
            Some(source.clone())
        }
        ModelSource::Files(files) => {
            let path = resolve(given);
            let in_pipeline = path.join("transformer_2");
            let path = match in_pipeline.join("config.json").is_file() {
                true => in_pipeline,
                false => path,
            };
            if !path.exists() {
                c.fail(field, format!("{} does not exist", path.display()));
                return None;
            }
            Some(ModelSource::Files(files.clone().with("transformer", path)))
        }
        ModelSource::Tiny | ModelSource::Random(_) => {
            let expected = match source {
                ModelSource::Random(shape) => format!("random:{shape}"),
                _ => "tiny".to_string(),
            };
            c.fail(
                field,
                format!(
                    "`{}`: with model.path `{expected}`, the second expert is `{expected}` too",
                    given.display()
                ),
            );
            None
        }
    }
}

/// The component files of `arch`'s model whose `model.path` is `path` (a folder, or the
/// transformer's file), with the overrides resolved and checked.
fn model_files(
    c: &mut Checker,
    arch: Arch,
    path: &Path,
    overrides: &[(&str, PathBuf)],
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Option<ModelFiles> {
    let folder = path.is_dir();
    if !folder && !path.is_file() {
        c.fail(
            "model.path",
            format!(
                "{} does not exist; expected a diffusers folder ({}/), the {}'s file, `tiny` or `random:{}`",
                path.display(),
                arch.components().join("/, "),
                arch.components()[0],
                arch.random_shapes()[0]
            ),
        );
        return None;
    }
    let mut files = BTreeMap::new();
    let mut complete = true;
    for (i, &component) in arch.components().iter().enumerate() {
        let field = format!("model.{component}");
        let given = overrides.iter().find(|(c, _)| *c == component);
        let found = match given {
            Some((_, p)) => resolve(p),
            // The first component (the denoiser) is the single file itself, and so is every
            // other one of an all-in-one checkpoint.
            None if folder || i == 0 || arch.single_file_holds_all() => path.to_path_buf(),
            None => {
                c.fail(
                    &field,
                    format!(
                        "required when model.path is a single file ({}): a folder or a single file",
                        path.display()
                    ),
                );
                complete = false;
                continue;
            }
        };
        if !found.exists() {
            c.fail(&field, format!("{} does not exist", found.display()));
            complete = false;
            continue;
        }
        files.insert(component.to_string(), found);
    }
    complete.then_some(ModelFiles(files))
}

fn check_train(c: &mut Checker, t: &TrainSectionYaml, arch: Arch) -> Option<TrainSettings> {
    let steps = c.at_least("train.steps", t.steps, 1);
    let batch = c.at_least("train.batch_size", t.batch_size, 1);
    let accumulation = c.at_least(
        "train.gradient_accumulation_steps",
        t.gradient_accumulation_steps,
        1,
    );
    let devices = c.at_least("train.devices", t.devices, 1);
    let lr = c.positive("train.lr", t.lr);
    let optimizer = c.choose(
        "train.optimizer",
        &t.optimizer,
        &[
            ("adamw", OptimizerKind::AdamW),
            ("adamw8bit", OptimizerKind::AdamW8bit),
        ],
    );
    let optimizer_state = c.choose(
        "train.optimizer_state",
        &t.optimizer_state,
        &[
            ("device", OptimizerState::Device),
            ("host", OptimizerState::Host),
        ],
    );
    let gradients = match &t.gradients {
        Some(word) => c.choose(
            "train.gradients",
            word,
            &[
                ("device", GradientPlacement::Device),
                ("host", GradientPlacement::Host),
            ],
        ),
        None => optimizer_state.map(|state| match state {
            OptimizerState::Device => GradientPlacement::Device,
            OptimizerState::Host => GradientPlacement::Host,
        }),
    };
    let gradients = match (gradients, optimizer_state) {
        (Some(GradientPlacement::Host), Some(OptimizerState::Device)) => {
            c.fail(
                "train.gradients",
                "`host` needs the optimizer in host memory too: set `train.optimizer_state: host`"
                    .to_string(),
            );
            None
        }
        (Some(GradientPlacement::Host), _) if t.devices > 1 => {
            c.fail(
                "train.gradients",
                "`host` sums the gradients of one device: with `train.devices` above 1 set \
                 `device`"
                    .to_string(),
            );
            None
        }
        (gradients, _) => gradients,
    };
    let decay = c.require(
        t.weight_decay.is_finite() && t.weight_decay >= 0.0,
        t.weight_decay,
        "train.weight_decay",
        "expected a finite number ≥ 0",
    );
    let scheduler = c.choose(
        "train.lr_scheduler",
        &t.lr_scheduler,
        &[
            ("constant", SchedulerKind::Constant),
            ("linear", SchedulerKind::Linear),
            ("cosine", SchedulerKind::Cosine),
        ],
    );
    let warmup = c.require(
        t.lr_warmup_steps <= t.steps,
        t.lr_warmup_steps,
        "train.lr_warmup_steps",
        &format!("expected at most train.steps ({})", t.steps),
    );
    let clip = c
        .require(
            t.max_grad_norm.is_finite() && t.max_grad_norm >= 0.0,
            t.max_grad_norm,
            "train.max_grad_norm",
            "expected a finite number ≥ 0 (0 turns clipping off)",
        )
        .map(|n| (n > 0.0).then_some(n));
    let shift = c.positive("train.timestep_shift", t.timestep_shift);
    let timestep_type = t
        .timestep_type
        .clone()
        .unwrap_or_else(|| arch.default_timestep_type().to_string());
    let timestep = c.choose(
        "train.timestep_type",
        &timestep_type,
        &[
            ("uniform", TimestepSampling::Uniform),
            ("sigmoid", TimestepSampling::LogitNormal),
            ("logit_normal", TimestepSampling::LogitNormal),
            ("logit-normal", TimestepSampling::LogitNormal),
            ("shift", TimestepSampling::Shift(0.0)),
            ("flux_shift", TimestepSampling::ResolutionShift),
            ("flux2_shift", TimestepSampling::ResolutionShift),
        ],
    );
    let guidance = c.require(
        t.guidance_scale.is_finite() && t.guidance_scale >= 0.0,
        t.guidance_scale,
        "train.guidance_scale",
        "expected a finite number ≥ 0",
    );
    let max_nan = c.at_least("train.max_nan_steps", t.max_nan_steps, 1);
    let ddpm = check_ddpm(c, t, arch);
    let timestep = match timestep? {
        TimestepSampling::Shift(_) => TimestepSampling::Shift(shift?),
        other => other,
    };
    let timestep_range = check_timestep_range(c, t);
    let boundary = c.require(
        (1..1000).contains(&t.timestep_boundary.unwrap_or(875)),
        t.timestep_boundary.unwrap_or(875),
        "train.timestep_boundary",
        "expected 1 to 999",
    );
    let checkpointing = match (
        t.gradient_checkpointing,
        t.gradient_checkpointing_cpu_offload,
    ) {
        (true, false) => Some(Checkpointing::Blocks),
        (true, true) => Some(Checkpointing::BlocksOnHost),
        (false, false) => Some(Checkpointing::Off),
        (false, true) => {
            c.fail(
                "train.gradient_checkpointing_cpu_offload",
                "keeps the inputs of recomputed blocks: it needs `train.gradient_checkpointing: \
                 true`"
                    .to_string(),
            );
            None
        }
    };
    let text_encoder = c.require(
        !t.train_text_encoder || arch.trains_text_encoders(),
        t.train_text_encoder,
        "train.train_text_encoder",
        &format!(
            "{} keeps its text encoders frozen (sdxl trains them)",
            arch.name()
        ),
    );
    Some(TrainSettings {
        steps: steps?,
        batch_size: batch?,
        gradient_accumulation_steps: accumulation?,
        devices: devices?,
        lr: lr?,
        optimizer: optimizer?,
        optimizer_state: optimizer_state?,
        gradients: gradients?,
        weight_decay: decay?,
        lr_scheduler: scheduler?,
        lr_warmup_steps: warmup?,
        max_grad_norm: clip?,
        gradient_checkpointing: checkpointing?,
        train_text_encoder: text_encoder?,
        timestep,
        timestep_range: timestep_range?,
        timestep_boundary: f64::from(boundary?) / 1000.0,
        guidance_scale: guidance?,
        ddpm: ddpm?,
        max_nan_steps: max_nan?,
        seed: t.seed,
    })
}

/// What `model.transformer_2` asks of the train section: a boundary within the timesteps
/// trained, so that each expert trains, and a σ sampling that does not depend on the image
/// size (the trainer chooses the expert before the family reads the batch);
/// `train.timestep_boundary` is an error without a second expert.
fn check_experts(c: &mut Checker, yaml: &TrainYaml, train: Option<&TrainSettings>) {
    let field = "train.timestep_boundary";
    if yaml.model.transformer_2.is_none() {
        if yaml.train.timestep_boundary.is_some() {
            c.fail(
                field,
                "only with a second expert in model.transformer_2".to_string(),
            );
        }
        return;
    }
    let Some(train) = train else { return };
    if train.devices > 1 {
        c.fail(
            "train.devices",
            "with model.transformer_2 the experts train by turns on one device: set 1".to_string(),
        );
    }
    let (range, boundary) = (train.timestep_range, train.timestep_boundary);
    if !(range.min < boundary && boundary < range.max) {
        c.fail(
            field,
            format!(
                "{}: outside the timesteps trained ({} to {}), one expert would never train",
                (boundary * 1000.0).round(),
                (range.min * 1000.0).round(),
                (range.max * 1000.0).round()
            ),
        );
    }
    if train.timestep == TimestepSampling::ResolutionShift {
        c.fail(
            "train.timestep_type",
            "flux2_shift depends on the image size, which the choice of expert cannot know; \
             with model.transformer_2 choose uniform, sigmoid or shift"
                .to_string(),
        );
    }
}

/// `train.min_timestep` … `max_timestep` as a part of σ's [0, 1].
fn check_timestep_range(c: &mut Checker, t: &TrainSectionYaml) -> Option<TimestepRange> {
    // Timesteps count to 1000 in every family, as in the trainers' options.
    let steps = 1000;
    let min = t.min_timestep.unwrap_or(0);
    let max = t.max_timestep.unwrap_or(steps);
    let min = c.require(
        min < steps,
        min,
        "train.min_timestep",
        &format!("expected 0 to {}", steps - 1),
    );
    let max = c.require(
        (1..=steps).contains(&max),
        max,
        "train.max_timestep",
        &format!("expected 1 to {steps}"),
    );
    let (min, max) = (min?, max?);
    let max = c.require(
        min < max,
        max,
        "train.max_timestep",
        &format!("expected more than train.min_timestep ({min})"),
    )?;
    Some(TimestepRange {
        min: f64::from(min) / f64::from(steps),
        max: f64::from(max) / f64::from(steps),
        preserve_shape: t.preserve_distribution_shape,
    })
}

/// The DDPM settings; an error for each one given to a family trained by flow matching.
fn check_ddpm(c: &mut Checker, t: &TrainSectionYaml, arch: Arch) -> Option<DdpmSettings> {
    if arch.objective() != Objective::Ddpm {
        let given = [
            ("train.prediction_type", t.prediction_type.is_some()),
            ("train.min_snr_gamma", t.min_snr_gamma.is_some()),
            ("train.noise_offset", t.noise_offset != 0.0),
        ];
        for (field, _) in given.iter().filter(|(_, given)| *given) {
            c.fail(
                *field,
                format!(
                    "{} is trained by flow matching; this applies to DDPM models (sdxl)",
                    arch.name()
                ),
            );
        }
        return Some(DdpmSettings::default());
    }
    let prediction = match &t.prediction_type {
        Some(word) => c.choose(
            "train.prediction_type",
            word,
            &[
                ("epsilon", Prediction::Epsilon),
                ("v_prediction", Prediction::Velocity),
                ("v-prediction", Prediction::Velocity),
            ],
        ),
        None => Some(Prediction::Epsilon),
    };
    let gamma = match t.min_snr_gamma {
        Some(gamma) => c.positive("train.min_snr_gamma", gamma).map(Some),
        None => Some(None),
    };
    let offset = c.require(
        t.noise_offset.is_finite() && t.noise_offset >= 0.0,
        t.noise_offset,
        "train.noise_offset",
        "expected a finite number ≥ 0 (0 turns it off)",
    );
    Some(DdpmSettings {
        prediction: prediction?,
        min_snr_gamma: gamma?,
        noise_offset: offset?,
    })
}

fn check_dataset(
    c: &mut Checker,
    index: usize,
    d: &DatasetYaml,
    resolve: &dyn Fn(&Path) -> PathBuf,
) -> Option<DatasetPlan> {
    let field = |name: &str| format!("datasets[{index}].{name}");
    let folder = resolve(&d.folder_path);
    let folder_ok = folder.is_dir();
    if !folder_ok {
        c.fail(
            field("folder_path"),
            format!("{} is not a folder", folder.display()),
        );
    }
    let ext = d.caption_ext.trim_start_matches('.').to_string();
    let ext_ok = !ext.is_empty() && !ext.contains(['/', '\\']);
    if !ext_ok {
        c.fail(
            field("caption_ext"),
            format!("`{}` is not a file extension", d.caption_ext),
        );
    }
    let mut resolutions_ok = !d.resolution.is_empty();
    if d.resolution.is_empty() {
        c.fail(field("resolution"), "expected at least one resolution");
    }
    for &r in &d.resolution {
        if r == 0 || r % 16 != 0 {
            c.fail(
                field("resolution"),
                format!(
                    "{r} is not allowed; expected positive multiples of 16 (512, 768, 1024, …)"
                ),
            );
            resolutions_ok = false;
        }
    }
    let repeats = c.at_least(&field("num_repeats"), d.num_repeats, 1);
    let dropout = c.unit_interval(
        &field("caption_dropout_rate"),
        d.caption_dropout_rate,
        false,
    );
    let mut frames_ok = !d.frames.is_empty();
    if d.frames.is_empty() {
        c.fail(field("frames"), "expected at least one frame count");
    }
    for (j, &n) in d.frames.iter().enumerate() {
        if n % 4 != 1 {
            c.fail(
                field(&format!("frames[{j}]")),
                format!("{n} is not allowed; expected 4k + 1 frames (1, 5, 9, …, 33, …, 81)"),
            );
            frames_ok = false;
        }
    }
    let fps = match d.fps {
        Some(fps) => c.positive(&field("fps"), fps).map(Some),
        None => Some(None),
    };
    let uniform = c.choose(
        &field("frame_extraction"),
        &d.frame_extraction,
        &[("head", false), ("uniform", true)],
    );
    let extraction = match (uniform, d.frame_sample) {
        (Some(true), samples) => c
            .at_least(&field("frame_sample"), samples.unwrap_or(1), 1)
            .map(|samples| FrameExtraction::Uniform { samples }),
        (Some(false), Some(samples)) if samples != 1 => {
            c.fail(
                field("frame_sample"),
                format!("{samples} is not allowed; it needs `frame_extraction: uniform`"),
            );
            None
        }
        (Some(false), _) => Some(FrameExtraction::Head),
        (None, _) => None,
    };
    if !(folder_ok && ext_ok && resolutions_ok && frames_ok) {
        return None;
    }
    Some(DatasetPlan {
        folder,
        caption_ext: ext,
        resolutions: d.resolution.clone(),
        repeats: repeats?,
        caption_dropout: dropout?,
        cache_to_disk: d.cache_latents_to_disk,
        frames: d.frames.clone(),
        fps: fps?,
        extraction: extraction?,
    })
}

fn check_save(c: &mut Checker, s: &SaveYaml) -> Option<SavePlan> {
    let every = c.at_least("save.save_every", s.save_every, 1);
    let keep = c.at_least("save.max_step_saves_to_keep", s.max_step_saves_to_keep, 1);
    let format = c.choose(
        "save.format",
        &s.format,
        &[
            ("kohya", Format::Kohya),
            ("peft", Format::Peft),
            ("diffusers", Format::Peft),
            ("ai-toolkit", Format::AiToolkit),
        ],
    );
    let dtype = c.choose("save.dtype", &s.dtype, DTYPES);
    Some(SavePlan {
        every: every?,
        keep: keep?,
        format: format?,
        dtype: dtype?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, yaml: &str) -> PathBuf {
        for folder in ["images", "tokenizer", "tokenizer_2"] {
            std::fs::create_dir_all(dir.join(folder)).unwrap();
        }
        let path = dir.join("train.yaml");
        std::fs::write(&path, yaml).unwrap();
        path
    }

    const MINIMAL: &str = "name: run\nnetwork: {linear: 16}\nmodel: {arch: flux1, path: tiny}\n\
                           datasets:\n  - folder_path: images\n";

    #[test]
    fn minimal_file_takes_documented_defaults_and_resolves_paths() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), MINIMAL);
        let plan =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap();
        assert_eq!(plan.train.steps, 1000);
        assert_eq!(plan.train.optimizer, OptimizerKind::AdamW8bit);
        assert_eq!(plan.train.timestep, TimestepSampling::LogitNormal);
        assert_eq!(plan.train.max_grad_norm, Some(1.0));
        assert_eq!(plan.save.format, Format::Kohya);
        assert_eq!(plan.save.dtype, DType::BF16);
        assert_eq!(plan.model.source, ModelSource::Tiny);
        assert_eq!(plan.model.wire, None);
        assert_eq!(plan.model.vae_dtype, FloatDType::F32);
        assert!(plan.datasets[0].folder.is_absolute());
        assert!(plan.datasets[0].folder.ends_with("images"));
        assert_eq!(plan.datasets[0].resolutions, vec![512]);
        assert!(plan.run_dir().ends_with("output/run"));
        let lora = plan.network.lora.config_for("blocks.0.attn.qkv", false);
        assert_eq!(lora, Some(LoraConfig::new(16).into()));
        // Without `network.conv`, convolutions are not wrapped.
        assert_eq!(plan.network.lora.config_for("blocks.0.conv1", true), None);
    }

    #[test]
    fn fingerprint_ignores_steps_but_not_the_learning_rate() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), MINIMAL);
        let plan = |env: &[(&str, &str)]| {
            let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, env).unwrap()).unwrap()
        };
        let base = plan(&[]).resume_fingerprint();
        assert_eq!(
            base,
            plan(&[("BURNLORA_TRAIN__STEPS", "5000")]).resume_fingerprint()
        );
        assert_ne!(
            base,
            plan(&[("BURNLORA_TRAIN__LR", "0.001")]).resume_fingerprint()
        );
        // Kernel choices change the numerics: the default ones leave the fingerprint as it was
        // before the section existed, any other choice changes it.
        assert_eq!(
            base,
            plan(&[("BURNLORA_KERNELS__BLAS", "auto")]).resume_fingerprint()
        );
        let separate = plan(&[("BURNLORA_KERNELS__ATTENTION", "separate")]);
        assert_ne!(base, separate.resume_fingerprint());
        assert_eq!(separate.kernels.attention, AttentionRoute::Separate);
        assert!(separate.to_json().contains("\"attention\":\"separate\""));
    }

    #[test]
    fn clip_settings_default_to_images_and_name_the_frame_count_at_fault() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(dir.path(), MINIMAL);
        let plan = TrainPlan::load(&path).unwrap();
        assert_eq!(plan.datasets[0].frames, [1]);
        assert_eq!(plan.datasets[0].fps, None);
        assert_eq!(plan.datasets[0].extraction, FrameExtraction::Head);
        // Absent clip settings stay out of the JSON, so older fingerprints hold.
        assert!(!plan.to_json().contains("frame"), "{}", plan.to_json());

        let clips = MINIMAL.replace(
            "folder_path: images\n",
            "folder_path: images\n    frames: [1, 33]\n    fps: 16\n    \
             frame_extraction: uniform\n    frame_sample: 4\n",
        );
        let plan = TrainPlan::load(&write(dir.path(), &clips)).unwrap();
        assert_eq!(plan.datasets[0].frames, [1, 33]);
        assert_eq!(plan.datasets[0].fps, Some(16.0));
        assert_eq!(
            plan.datasets[0].extraction,
            FrameExtraction::Uniform { samples: 4 }
        );

        let bad = MINIMAL.replace(
            "folder_path: images\n",
            "folder_path: images\n    frames: [1, 32]\n    fps: 0\n    frame_sample: 2\n",
        );
        let error = TrainPlan::load(&write(dir.path(), &bad)).unwrap_err();
        let fields: Vec<&str> = error.problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "datasets[0].frames[1]",
                "datasets[0].fps",
                "datasets[0].frame_sample"
            ],
            "{error}"
        );
        assert!(error.problems[0].message.contains("4k + 1"), "{error}");
    }

    #[test]
    fn kernel_choices_are_checked_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = write(
            dir.path(),
            &format!("{MINIMAL}kernels: {{blas: fast, order: host}}\n"),
        );
        let error =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap_err();
        assert_eq!(error.problems.len(), 1, "{error}");
        assert_eq!(error.problems[0].field, "kernels.blas");
        assert!(
            error.problems[0].message.contains("off, large, all"),
            "{error}"
        );
    }

    #[test]
    fn the_vae_dtype_is_chosen_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let with = |vae_dtype: &str| {
            let yaml = MINIMAL.replace(
                "path: tiny}",
                &format!("path: tiny, vae_dtype: {vae_dtype}}}"),
            );
            let path = write(dir.path(), &yaml);
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap())
        };
        assert_eq!(with("bf16").unwrap().model.vae_dtype, FloatDType::BF16);
        assert_eq!(with("float32").unwrap().model.vae_dtype, FloatDType::F32);
        let error = with("f16").unwrap_err();
        assert_eq!(error.problems.len(), 1, "{error}");
        assert_eq!(error.problems[0].field, "model.vae_dtype");
        assert!(error.problems[0].message.contains("bf16"), "{error}");
    }

    #[test]
    fn timestep_range_scales_or_keeps_the_shape_and_names_bad_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let plan = TrainPlan::load(&write(dir.path(), MINIMAL)).unwrap();
        assert_eq!(plan.train.timestep_range, TimestepRange::FULL);
        // Absent bounds stay out of the JSON, so older fingerprints hold.
        assert!(!plan.to_json().contains("_timestep"), "{}", plan.to_json());

        let high = format!("{MINIMAL}train: {{min_timestep: 875}}\n");
        let plan = TrainPlan::load(&write(dir.path(), &high)).unwrap();
        let range = plan.train.timestep_range;
        assert_eq!(
            (range.min, range.max, range.preserve_shape),
            (0.875, 1.0, false)
        );

        // σ = sigmoid(n) restricted to [0, 0.5]: scaled, its mean is half the whole
        // distribution's (0.25); kept in shape, it is E[σ | σ ≤ 0.5] = 0.5 − E|σ − 0.5|, which
        // numerical integration puts at 0.3251 for the standard logistic-normal.
        let low = TimestepRange {
            min: 0.0,
            max: 0.5,
            preserve_shape: false,
        };
        let mean = |range: TimestepRange| {
            let mut rng = Rng::seeded(7);
            let draws: Vec<f64> = (0..40_000)
                .map(|_| range.sample(TimestepSampling::LogitNormal, 16, &mut rng))
                .collect();
            assert!(draws.iter().all(|s| (range.min..=range.max).contains(s)));
            draws.iter().sum::<f64>() / draws.len() as f64
        };
        assert!((mean(low) - 0.25).abs() < 0.003, "{}", mean(low));
        let kept = mean(TimestepRange {
            preserve_shape: true,
            ..low
        });
        assert!((kept - 0.3251).abs() < 0.003, "{kept}");

        let bad = format!("{MINIMAL}train: {{min_timestep: 1000, max_timestep: 1001}}\n");
        let error = TrainPlan::load(&write(dir.path(), &bad)).unwrap_err();
        let fields: Vec<&str> = error.problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            ["train.min_timestep", "train.max_timestep"],
            "{error}"
        );
        let empty = format!("{MINIMAL}train: {{min_timestep: 900, max_timestep: 900}}\n");
        let error = TrainPlan::load(&write(dir.path(), &empty)).unwrap_err();
        assert_eq!(error.problems[0].field, "train.max_timestep", "{error}");
        assert!(error.problems[0].message.contains("more than"), "{error}");
    }

    #[test]
    fn a_second_expert_is_of_model_paths_kind_and_its_boundary_within_the_timesteps() {
        let dir = tempfile::tempdir().unwrap();
        let wan = |model: &str, train: &str| {
            let yaml = format!(
                "name: run\nnetwork: {{linear: 16}}\nmodel: {{arch: wan, {model}}}\n\
                 train: {{{train}}}\ndatasets:\n  - folder_path: images\n"
            );
            TrainPlan::load(&write(dir.path(), &yaml))
        };
        let fields = |error: ConfigError| -> Vec<String> {
            error.problems.into_iter().map(|p| p.field).collect()
        };
        let plan = wan("path: tiny, transformer_2: tiny", "").unwrap();
        assert_eq!(plan.model.transformer_2, Some(ModelSource::Tiny));
        assert_eq!(plan.train.timestep_boundary, 0.875);
        // Absent, the new keys stay out of the JSON, so older fingerprints hold.
        let one = wan("path: tiny", "").unwrap();
        assert!(
            !one.to_json().contains("transformer_2"),
            "{}",
            one.to_json()
        );
        assert!(!one.to_json().contains("boundary"), "{}", one.to_json());
        let random = "path: 'random:wan2.1-14b', transformer_2: 'random:wan2.1-14b'";
        assert_eq!(
            wan(random, "timestep_boundary: 900")
                .unwrap()
                .train
                .timestep_boundary,
            0.9
        );

        // A pipeline folder's second expert is its transformer_2/.
        let pipeline = dir.path().join("a14b");
        for sub in ["transformer_2", "tokenizer"] {
            std::fs::create_dir_all(pipeline.join(sub)).unwrap();
        }
        std::fs::write(pipeline.join("transformer_2/config.json"), "{}").unwrap();
        let folder = pipeline.display();
        let plan = wan(&format!("path: {folder}, transformer_2: {folder}"), "").unwrap();
        let Some(ModelSource::Files(files)) = plan.model.transformer_2 else {
            panic!("files expected");
        };
        assert_eq!(files.get("transformer"), pipeline.join("transformer_2"));
        assert_eq!(files.get("vae"), pipeline);

        let cases = [
            (
                "path: tiny, transformer_2: 'random:wan2.1-14b'",
                "",
                "model.transformer_2",
            ),
            (
                "path: tiny, transformer_2: missing.safetensors",
                "",
                "model.transformer_2",
            ),
            (
                "path: tiny",
                "timestep_boundary: 875",
                "train.timestep_boundary",
            ),
            (
                "path: tiny, transformer_2: tiny",
                "min_timestep: 900",
                "train.timestep_boundary",
            ),
            (
                "path: tiny, transformer_2: tiny",
                "timestep_boundary: 1000",
                "train.timestep_boundary",
            ),
            (
                "path: tiny, transformer_2: tiny",
                "timestep_type: flux2_shift",
                "train.timestep_type",
            ),
        ];
        for (model, train, field) in cases {
            let error = wan(model, train).unwrap_err();
            assert_eq!(fields(error), [field], "{model} / {train}");
        }
        let flux = MINIMAL.replace("path: tiny", "path: tiny, transformer_2: tiny");
        let error = TrainPlan::load(&write(dir.path(), &flux)).unwrap_err();
        assert_eq!(error.problems[0].field, "model.transformer_2", "{error}");
        assert!(
            error.problems[0].message.contains("one denoiser"),
            "{error}"
        );
    }

    #[test]
    fn block_inputs_go_to_the_host_only_with_checkpointing() {
        let dir = tempfile::tempdir().unwrap();
        let load = |train: &str| TrainPlan::load(&write(dir.path(), &format!("{MINIMAL}{train}")));
        let on_host = load("train: {gradient_checkpointing_cpu_offload: true}\n").unwrap();
        assert_eq!(
            on_host.train.gradient_checkpointing,
            Checkpointing::BlocksOnHost
        );
        assert_eq!(
            load("").unwrap().train.gradient_checkpointing,
            Checkpointing::Blocks
        );
        let error = load(
            "train: {gradient_checkpointing: false, gradient_checkpointing_cpu_offload: true}\n",
        )
        .unwrap_err();
        assert_eq!(
            error.problems[0].field, "train.gradient_checkpointing_cpu_offload",
            "{error}"
        );
    }

    #[test]
    fn config_keys_become_dotted_paths() {
        assert_eq!(
            normalize_key("datasets[0]resolution"),
            "datasets[0].resolution"
        );
        assert_eq!(
            normalize_key("datasets.[1].folder_path"),
            "datasets[1].folder_path"
        );
        assert_eq!(normalize_key("train.steps"), "train.steps");
        assert_eq!(normalize_key("datasets[0]"), "datasets[0]");
    }

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// σ of `flux2_shift` is BFL's `generalized_time_snr_shift(t, μ, 1)` =
    /// `e^μ / (e^μ + 1/t − 1)` of a logit-normal `t`, with μ at musubi-tuner's points.
    #[test]
    fn resolution_shift_is_bfl_time_shift_with_mu_linear_in_tokens() {
        for (tokens, mu) in [
            (256, 0.5f64),
            (4096, 1.15),
            (1024, 0.5 + 0.65 * 768.0 / 3840.0),
        ] {
            let (mut a, mut b) = (Rng::seeded(3), Rng::seeded(3));
            let sigma = TimestepSampling::ResolutionShift.sample_at(tokens, &mut a);
            let t = 1.0 / (1.0 + (-b.normal()).exp());
            let expected = mu.exp() / (mu.exp() + (1.0 / t - 1.0));
            assert!(
                (sigma - expected).abs() < 1e-12,
                "{tokens}: {sigma} vs {expected}"
            );
        }
    }

    #[test]
    fn ddpm_settings_apply_to_sdxl_and_are_refused_for_flow_models() {
        let dir = tempfile::tempdir().unwrap();
        let ddpm = "train: {prediction_type: v_prediction, min_snr_gamma: 5, noise_offset: 0.05}\n";
        let sdxl = MINIMAL.replace("arch: flux1", "arch: sdxl") + ddpm;
        let path = write(dir.path(), &sdxl);
        let plan =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap();
        assert_eq!(
            plan.train.ddpm,
            DdpmSettings {
                prediction: Prediction::Velocity,
                min_snr_gamma: Some(5.0),
                noise_offset: 0.05,
            }
        );
        assert_eq!(plan.train.timestep, TimestepSampling::Uniform);

        let path = write(dir.path(), &format!("{MINIMAL}{ddpm}"));
        let error =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap_err();
        let fields: Vec<&str> = error.problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "train.prediction_type",
                "train.min_snr_gamma",
                "train.noise_offset"
            ],
            "{error}"
        );
        assert!(
            error.problems[0].message.contains("flow matching"),
            "{error}"
        );

        let bad = MINIMAL.replace("arch: flux1", "arch: sdxl")
            + "train: {prediction_type: sample, min_snr_gamma: 0, noise_offset: -1}\n";
        let path = write(dir.path(), &bad);
        let error =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap_err();
        assert_eq!(error.problems.len(), 3, "{error}");
    }

    /// SDXL's all-in-one checkpoint holds every component; FLUX.1's transformer file does not.
    #[test]
    fn an_all_in_one_sdxl_file_names_every_component() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("sd_xl_base_1.0.safetensors"), b"").unwrap();
        std::fs::create_dir_all(dir.path().join("tokenizer")).unwrap();
        std::fs::create_dir_all(dir.path().join("tokenizer_2")).unwrap();
        let yaml = MINIMAL.replace(
            "{arch: flux1, path: tiny}",
            "{arch: sdxl, path: sd_xl_base_1.0.safetensors}",
        );
        let path = write(dir.path(), &yaml);
        let plan =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap();
        let ModelSource::Files(files) = &plan.model.source else {
            panic!("{:?}", plan.model.source);
        };
        for component in Arch::Sdxl.components() {
            assert!(files.get(component).ends_with("sd_xl_base_1.0.safetensors"));
        }

        let path = write(dir.path(), &yaml.replace("sdxl", "flux1"));
        let error =
            TrainPlan::from_yaml(&path, TrainYaml::load_with_env(&path, []).unwrap()).unwrap_err();
        assert_eq!(error.problems[0].field, "model.vae", "{error}");
    }

    #[test]
    fn each_family_has_its_default_sigma_sampling() {
        let dir = tempfile::tempdir().unwrap();
        for (arch, expected) in [
            ("flux1", TimestepSampling::LogitNormal),
            ("flux2", TimestepSampling::ResolutionShift),
            ("sdxl", TimestepSampling::Uniform),
        ] {
            let yaml = MINIMAL.replace("arch: flux1", &format!("arch: {arch}"));
            let plan = TrainPlan::load(&write(dir.path(), &yaml)).unwrap();
            assert_eq!(plan.train.timestep, expected, "{arch}");
        }
    }

    /// SDXL's text encoders train on request, saved by the formats that name them, and their
    /// layers are adapted whatever `network.include` selects in the UNet.
    #[test]
    fn text_encoders_train_in_sdxl_only_and_in_formats_that_name_them() {
        let dir = tempfile::tempdir().unwrap();
        let load = |yaml: String| TrainPlan::load(&write(dir.path(), &yaml));
        let sdxl = MINIMAL.replace("arch: flux1", "arch: sdxl");
        let included = sdxl.replace("{linear: 16}", "{linear: 16, include: [attentions]}");
        let plan = load(format!("{included}train: {{train_text_encoder: true}}\n")).unwrap();
        assert!(plan.train.train_text_encoder);
        let lora = &plan.network.lora;
        assert!(
            lora.config_for("text_encoder_2.encoder.layers.0.mlp.fc1", false)
                .is_some()
        );
        assert!(
            lora.config_for("unet.down_blocks.1.attentions.0.proj_in", false)
                .is_some()
        );
        assert!(
            lora.config_for("unet.down_blocks.1.resnets.0.time_emb_proj", false)
                .is_none()
        );

        let error = load(format!("{MINIMAL}train: {{train_text_encoder: true}}\n")).unwrap_err();
        assert_eq!(
            error.problems[0].field, "train.train_text_encoder",
            "{error}"
        );
        let error = load(format!(
            "{sdxl}train: {{train_text_encoder: true}}\nsave: {{format: ai-toolkit}}\n"
        ))
        .unwrap_err();
        assert_eq!(error.problems[0].field, "save.format", "{error}");
    }
}
