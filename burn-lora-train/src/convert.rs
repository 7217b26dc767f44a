//! `burnlora convert-lora`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn_lora::Format;
use burn_lora_train::config::{Arch, ModelFiles, ModelSource};
use burn_lora_train::lora_names;

/// Arguments of `burnlora convert-lora`.
#[derive(clap::Args)]
pub struct ConvertArgs {
    /// Target format: `kohya` (ComfyUI, kohya's tools, Forge), `peft` (diffusers / PEFT) or
    /// `ai-toolkit` (ComfyUI, ai-toolkit).
    #[arg(long, value_enum)]
    to: Target,
    /// The model the LoRA is for: `flux1` (FLUX.1-dev and schnell), `tiny` (the built-in tiny
    /// model), or a FLUX.1 transformer checkpoint (file or folder) to read the shape from.
    #[arg(long, default_value = "flux1")]
    model: String,
    /// The LoRA file to read: kohya, PEFT / diffusers, ai-toolkit or OneTrainer layout.
    input: PathBuf,
    /// The file to write (atomically).
    output: PathBuf,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Target {
    Kohya,
    Peft,
    AiToolkit,
}

/// Converts the file and prints what was carried over.
pub fn run(args: ConvertArgs) -> anyhow::Result<()> {
    let to = match args.to {
        Target::Kohya => Format::Kohya,
        Target::Peft => Format::Peft,
        Target::AiToolkit => Format::AiToolkit,
    };
    let source = match args.model.as_str() {
        "flux1" => ModelSource::Random("flux1-dev".into()),
        "tiny" => ModelSource::Tiny,
        path => ModelSource::Files(ModelFiles::pipeline(
            Path::new(path),
            Arch::Flux1.components(),
        )),
    };
    let names = lora_names(Arch::Flux1, &source)
        .with_context(|| format!("reading the model `{}`", args.model))?;
    let report = names
        .convert(&args.input, &args.output, to)
        .with_context(|| {
            format!(
                "converting {} to {}",
                args.input.display(),
                args.output.display()
            )
        })?;
    println!(
        "{}: {} adapters, {} parameters, {} layout",
        args.output.display(),
        report.adapters,
        report.params,
        to.name()
    );
    if !report.dropped.is_empty() {
        println!(
            "not carried over (unrecognized keys): {}",
            report.dropped.join(", ")
        );
    }
    Ok(())
}
