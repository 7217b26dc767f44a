//! `burnlora`: the command-line tool of burn-lora-stack.

mod convert;
mod forward;
mod inspect;
#[cfg(feature = "cuda")]
mod kernels;
mod quantize;
mod train_command;

use clap::{Parser, Subcommand};

/// Train LoRA adapters for large diffusion models, and prepare their checkpoints.
#[derive(Parser)]
#[command(name = "burnlora", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Quantize a safetensors checkpoint to scaled FP8 (E5M2 or E4M3).
    Quantize(quantize::QuantizeArgs),
    /// List the tensors (key, dtype, shape, bytes) and metadata of a safetensors checkpoint.
    Inspect(inspect::InspectArgs),
    /// Run one forward pass of a FLUX.1 transformer on inputs from a file.
    Forward(forward::ForwardArgs),
    /// Convert a LoRA file between the kohya, PEFT / diffusers and ai-toolkit layouts.
    ConvertLora(convert::ConvertArgs),
    /// Train a LoRA from a YAML configuration (resuming the run's newest checkpoint if any).
    Train(train_command::TrainArgs),
}

fn main() -> anyhow::Result<()> {
    let logging = burn_lora_train::report::init_logging()?;
    #[cfg(feature = "cuda")]
    kernels::persist();
    match Cli::parse().command {
        Command::Quantize(args) => quantize::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Forward(args) => forward::run(args),
        Command::ConvertLora(args) => convert::run(args),
        Command::Train(args) => train_command::run(args, &logging),
    }
}
