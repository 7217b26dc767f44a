//! `burnlora`: the command-line tool of burn-lora-stack.

mod convert;
mod forward;
mod inspect;
mod quantize;

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
    /// Convert a LoRA file between the kohya and PEFT / diffusers layouts.
    ConvertLora(convert::ConvertArgs),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BURNLORA_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Quantize(args) => quantize::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Forward(args) => forward::run(args),
        Command::ConvertLora(args) => convert::run(args),
    }
}
