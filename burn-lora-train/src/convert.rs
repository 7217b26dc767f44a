//! `burnlora convert-lora`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn_diffusion::flux2::Flux2Checkpoint;
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
    /// The model the LoRA is for: `flux1` (FLUX.1-dev and schnell), `flux2` (FLUX.2-dev),
    /// `flux2-klein-4b`, `flux2-klein-9b`, `sdxl` (SDXL base 1.0 and fine-tunes of its shape),
    /// `tiny` / `tiny-flux2` / `tiny-sdxl` (the built-in tiny models), or a FLUX.1 or FLUX.2
    /// transformer checkpoint (file or folder) to read the shape from.
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
    let (arch, source) = match args.model.as_str() {
        "flux1" => (Arch::Flux1, ModelSource::Random("flux1-dev".into())),
        "flux2" => (Arch::Flux2, ModelSource::Random("flux2-dev".into())),
        shape @ ("flux2-klein-4b" | "flux2-klein-9b") => {
            (Arch::Flux2, ModelSource::Random(shape.into()))
        }
        "tiny" => (Arch::Flux1, ModelSource::Tiny),
        "tiny-flux2" => (Arch::Flux2, ModelSource::Tiny),
        "sdxl" => (Arch::Sdxl, ModelSource::Random("sdxl".into())),
        "tiny-sdxl" => (Arch::Sdxl, ModelSource::Tiny),
        shape @ ("wan2.1-14b" | "wan2.1-1.3b" | "wan2.2-5b") => {
            (Arch::Wan, ModelSource::Random(shape.into()))
        }
        "tiny-wan" => (Arch::Wan, ModelSource::Tiny),
        path => {
            let arch = if Flux2Checkpoint::open(Path::new(path)).is_ok() {
                Arch::Flux2
            } else {
                Arch::Flux1
            };
            let files = ModelFiles::pipeline(Path::new(path), arch.components());
            (arch, ModelSource::Files(files))
        }
    };
    let names =
        lora_names(arch, &source).with_context(|| format!("reading the model `{}`", args.model))?;
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
