//! `burnlora train`.

use std::path::PathBuf;

use anyhow::Context;
use burn_lora_train::config::TrainPlan;
use burn_lora_train::report::{self, Logging, StopFlag};
use burn_lora_train::train::{Resume, devices, train};

/// Arguments of `burnlora train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    /// The training configuration (YAML; see CONFIG.md).
    config: PathBuf,
    /// Continue from the newest checkpoint of the run folder, and fail when there is none
    /// (without the flag a run resumes from one when it exists, and starts afresh otherwise).
    #[arg(long)]
    resume: bool,
}

/// Trains the adapters of the configuration, logging to `train.log` in the run folder.
pub fn run(args: TrainArgs, logging: &Logging) -> anyhow::Result<()> {
    let plan = TrainPlan::load_with_env(&args.config, std::env::vars())?;
    std::fs::create_dir_all(plan.run_dir())
        .with_context(|| format!("creating {}", plan.run_dir().display()))?;
    logging.add_file(&plan.run_dir().join(report::LOG_FILE))?;
    let stop = StopFlag::install()?;
    let resume = if args.resume {
        Resume::Required
    } else {
        Resume::Auto
    };
    let devices = devices::<Inner>(plan.train.devices)?;
    let summary = train::<Inner>(&plan, resume, &stop, &devices)?;
    match summary.lora {
        Some(lora) => println!("step {}: {}", summary.step, lora.display()),
        None => println!("nothing to do: the run is at step {}", summary.step),
    }
    Ok(())
}

/// The backend the adapters train on.
#[cfg(feature = "cuda")]
type Inner = burn::backend::Cuda;

/// The backend the adapters train on.
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Inner = burn::backend::Wgpu;

/// The backend the adapters train on.
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
type Inner = burn::backend::Flex;
