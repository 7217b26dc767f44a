//! `burnlora quantize`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use burn_quant::{Fp8Format, Granularity, QuantizeOptions, quantize_checkpoint};
use regex::Regex;

/// Arguments of `burnlora quantize`.
#[derive(clap::Args)]
pub struct QuantizeArgs {
    /// FP8 format: e5m2 (range) or e4m3 (precision).
    #[arg(long, default_value = "e4m3", value_parser = parse::<Fp8Format>)]
    format: Fp8Format,
    /// Scale granularity: none, tensor, row or block64. `tensor` is the layout ComfyUI reads
    /// as scaled FP8; `block64` keeps the most precision.
    #[arg(long, default_value = "block64", value_parser = parse::<Granularity>)]
    scale: Granularity,
    /// Quantize only tensors whose key matches this regular expression.
    #[arg(long)]
    include: Option<Regex>,
    /// Copy tensors whose key matches this regular expression unchanged.
    #[arg(long)]
    exclude: Option<Regex>,
    /// Input: a .safetensors file, a .safetensors.index.json, or a folder with one of them.
    input: PathBuf,
    /// Output .safetensors file (written atomically).
    output: PathBuf,
}

fn parse<T: std::str::FromStr<Err = burn_quant::QuantError>>(s: &str) -> Result<T, String> {
    s.parse().map_err(|e: burn_quant::QuantError| e.to_string())
}

/// Quantizes the checkpoint and prints what was done.
pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let options = QuantizeOptions {
        format: args.format,
        granularity: args.scale,
        include: args.include,
        exclude: args.exclude,
    };
    let start = Instant::now();
    let report = quantize_checkpoint(&args.input, &args.output, &options).with_context(|| {
        format!(
            "quantizing {} to {}",
            args.input.display(),
            args.output.display()
        )
    })?;
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "{}: {} tensors quantized to {} ({} scales), {} copied; {:.1} MB -> {:.1} MB in {:.2} s ({:.2} GB/s)",
        args.output.display(),
        report.quantized,
        options.format,
        options.granularity,
        report.copied,
        report.bytes_in as f64 / 1e6,
        report.bytes_out as f64 / 1e6,
        seconds,
        report.bytes_in as f64 / 1e9 / seconds.max(1e-9),
    );
    Ok(())
}
