//! [`TrainError`]: why a training run failed.

use std::path::PathBuf;

use burn_diffusion::LoadError;
use burn_lora::LoraError;
use burn_offload::OffloadError;

use crate::checkpoint::CheckpointError;
use crate::dataset::DatasetError;
use crate::optim::OptimError;
use crate::report::ReportError;

/// Why a training run failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The run folder or a checkpoint.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The images or captions.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// The saved optimizer state does not fit the model.
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// Logs, loss CSV or plot.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// The adapters (plan or LoRA file).
    #[error(transparent)]
    Lora(#[from] LoraError),
    /// Tokenizers or model files.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// Streaming the frozen weights.
    #[error(transparent)]
    Offload(#[from] OffloadError),
    /// A `random:` model's weights could not be placed in host memory.
    #[error("building the random {model}")]
    Random {
        /// Which model.
        model: &'static str,
        /// Why its weights could not be placed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The VRAM budget cannot hold what the run needs on the device beside its frozen weights
    /// (measured over a step) with the ring of a plan that streams every weight. The run stops
    /// before anything of that step is saved.
    #[error(
        "{file}: `model.offload.vram_budget_gb` is {}, but this run needs at least {}: {} beside the frozen weights (activations, adapters, gradients, optimizer state, workspace: measured over step {step}) and {} for the ring with every frozen weight streamed; raise the budget to at least that, or set it to 0 to stream every frozen weight without a bound{advice}",
        gb(*.budget),
        gb_up(*.needed),
        gb(*.headroom),
        gb(*.ring)
    )]
    Budget {
        /// The configuration file.
        file: PathBuf,
        /// The step whose need the budget cannot hold (not saved).
        step: u64,
        /// The budget, in bytes.
        budget: u64,
        /// What the run needs beside the weights, in bytes.
        headroom: u64,
        /// The ring with every frozen weight streamed, in bytes.
        ring: u64,
        /// The smallest budget that holds both, in bytes.
        needed: u64,
        /// The settings that would need less beside the weights, as a clause starting with
        /// `; ` (empty when every one is in force).
        advice: String,
    },
    /// `model.transformer_2` is not a model of the same parameters as the transformer of
    /// `model.path`.
    #[error(
        "{file}: `model.transformer_2` is not a second expert of model.path's shape: {message}"
    )]
    SecondExpert {
        /// The configuration file.
        file: PathBuf,
        /// The first parameter that differs.
        message: String,
    },
    /// `--resume` was asked for but the run folder has no valid checkpoint.
    #[error("{dir}: no checkpoint to resume from")]
    NothingToResume {
        /// The run folder.
        dir: PathBuf,
    },
    /// The newest checkpoint was made with settings that shape training differently.
    #[error(
        "{dir}: the checkpoint was made with another configuration (fingerprint {found}, this one is {expected}); use another run name"
    )]
    ConfigChanged {
        /// The run folder.
        dir: PathBuf,
        /// Fingerprint of this configuration.
        expected: String,
        /// Fingerprint saved with the checkpoint.
        found: String,
    },
    /// An encoder turned an image or a caption into non-finite values: every step that drew
    /// it would be skipped. Nothing is cached.
    #[error(
        "{encoder} produced non-finite values for {input}; check the model files and their dtype"
    )]
    NonFiniteEncoding {
        /// The encoder, as the family names it ("the VAE", "CLIP", "T5").
        encoder: &'static str,
        /// The image file, or the caption.
        input: String,
    },
    /// `train.devices` asks for more devices than there are.
    #[error("`train.devices` is {configured}, but {found} device(s) of this kind are available")]
    Devices {
        /// Devices configured.
        configured: usize,
        /// Devices given or found.
        found: usize,
    },
    /// The collective operations between the replicas of a data-parallel run failed.
    #[error("combining the replicas' gradients: {0}")]
    Collective(String),
    /// Another replica of a data-parallel run stopped with an error, so this one stopped too.
    #[error("another replica of the run stopped with an error")]
    ReplicaFailed,
    /// Too many consecutive steps had a non-finite loss or gradient (a checkpoint of the last
    /// step was written).
    #[error("{0} consecutive steps with a non-finite loss or gradient")]
    NonFinite(usize),
}

/// Bytes as decimal GB, two decimals.
pub(crate) fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

/// Bytes as decimal GB, rounded up to two decimals (a size that must not be undercut).
fn gb_up(bytes: u64) -> String {
    format!("{:.2} GB", (bytes as f64 / 1e7).ceil() / 100.0)
}
