//! `burnlora inspect`.

use std::path::PathBuf;

use anyhow::Context;
use burn_quant::Checkpoint;

/// Arguments of `burnlora inspect`.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// A .safetensors file, a .safetensors.index.json, or a folder with one of them.
    file: PathBuf,
}

/// Prints one line per tensor (key, dtype, shape, bytes), the totals and the metadata.
pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let ckpt = Checkpoint::open(&args.file)
        .with_context(|| format!("inspecting {}", args.file.display()))?;
    let width = ckpt.tensors().map(|t| t.name.len()).max().unwrap_or(0);
    let mut total = 0u64;
    for t in ckpt.tensors() {
        total += t.data.len() as u64;
        println!(
            "{:width$}  {:8}  {:20}  {:>12}",
            t.name,
            format!("{:?}", t.dtype),
            format!("{:?}", t.shape),
            t.data.len()
        );
    }
    println!("{} tensors, {} bytes", ckpt.len(), total);
    let mut metadata: Vec<_> = ckpt.metadata().into_iter().collect();
    metadata.sort();
    for (key, value) in metadata {
        println!("metadata {key} = {value}");
    }
    Ok(())
}
