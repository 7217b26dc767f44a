//! `burnlora convert-lora`.

use std::path::PathBuf;

use anyhow::Context;
use burn_lora::{Format, convert};

/// Arguments of `burnlora convert-lora`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// Target format: `kohya` (ComfyUI, kohya / LyCORIS) or `peft` (diffusers / PEFT).
    #[arg(long, value_enum)]
    to: Target,
    /// The LoRA file to read (any supported format).
    input: PathBuf,
    /// The file to write (atomically).
    output: PathBuf,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Target {
    Kohya,
    Peft,
}

/// Converts the file and prints what was carried over.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let to = match args.to {
        Target::Kohya => Format::Kohya,
        Target::Peft => Format::Peft,
    };
    let report = convert(&args.input, &args.output, to).with_context(|| {
        format!(
            "converting {} to {}",
            args.input.display(),
            args.output.display()
        )
    })?;
    println!(
        "{}: {} adapters, {} parameters",
        args.output.display(),
        report.adapters,
        report.params
    );
    if !report.dropped.is_empty() {
        println!(
            "not carried over (unrecognized keys): {}",
            report.dropped.join(", ")
        );
    }
    Ok(())
}
