//! `burnlora forward`: one forward pass of the FLUX.1, FLUX.2 or Wan transformer or of the
//! SDXL UNet from files, to compare with diffusers.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use burn::tensor::FloatDType;
use burn_diffusion::LoadError;
use burn_diffusion::flux::forward_file;
use burn_diffusion::flux2::Flux2Checkpoint;
use burn_diffusion::sdxl::{UNetCheckpoint, holds_sgm_unet};
use burn_diffusion::wan::holds_wan;

/// Arguments of `burnlora forward`.
#[derive(clap::Args)]
pub struct ForwardArgs {
    /// The denoiser, recognised from its files: the FLUX.1 or FLUX.2 transformer (a diffusers
    /// folder with `transformer/config.json`, or a BFL-layout `.safetensors` file: bf16, f32 or
    /// scaled FP8), the SDXL UNet (a diffusers folder with `unet/config.json`, or the original
    /// all-in-one file, `model.diffusion_model.*`) or the Wan transformer (a diffusers folder,
    /// or a single file in Wan's original layout).
    #[arg(long)]
    model: PathBuf,
    /// Inputs under diffusers' argument names: `hidden_states` [B, N, C],
    /// `encoder_hidden_states` [B, T, D], `pooled_projections` [B, P], `timestep` [B] (σ in
    /// [0, 1]), `guidance` [B] (models with guidance), `img_ids` [N, 3], `txt_ids` [T, 3]; for
    /// FLUX.2 the same without `pooled_projections`, with ids [N, 4] and [T, 4]; for SDXL
    /// `sample` [B, 4, H, W], `timestep` [B] (0 to 999), `encoder_hidden_states` [B, 77, 2048],
    /// `text_embeds` [B, 1280], `time_ids` [B, 6] (diffusers' `added_cond_kwargs` flattened);
    /// for Wan `hidden_states` [B, C, F, H, W], `timestep` [B] (0 to 1000),
    /// `encoder_hidden_states` [B, T, 4096].
    #[arg(long)]
    inputs: PathBuf,
    /// Output `.safetensors` file (written atomically); the result is stored under `output`.
    #[arg(long)]
    output: PathBuf,
    /// Dtype of the weights and the computation.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
}

/// The dtypes `burnlora forward` runs in.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

/// Runs the forward pass and prints the output's shape and the time taken.
pub fn run(args: ForwardArgs) -> anyhow::Result<()> {
    let dtype = match args.dtype {
        Dtype::F32 => FloatDType::F32,
        Dtype::Bf16 => FloatDType::BF16,
    };
    let start = Instant::now();
    let shape = forward_on_device(&args, dtype).with_context(|| {
        format!(
            "forward pass of {} on {}",
            args.model.display(),
            args.inputs.display()
        )
    })?;
    println!(
        "{}: output {shape:?} ({:?}) in {:.2} s",
        args.output.display(),
        args.dtype,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(feature = "cuda")]
type Device = burn::backend::Cuda;
#[cfg(not(feature = "cuda"))]
type Device = burn::backend::Flex;

/// The SDXL UNet's pass when the model is one, Wan's when the model is a Wan transformer, the
/// FLUX.2 transformer's when the model is a FLUX.2 checkpoint, else FLUX.1's.
fn forward_on_device(args: &ForwardArgs, dtype: FloatDType) -> Result<Vec<usize>, LoadError> {
    let forward = if is_sdxl(&args.model) {
        burn_diffusion::sdxl::forward_file::<Device>
    } else if holds_wan(&args.model) {
        burn_diffusion::wan::forward_file::<Device>
    } else if Flux2Checkpoint::open(&args.model).is_ok() {
        burn_diffusion::flux2::forward_file::<Device>
    } else {
        forward_file::<Device>
    };
    forward(
        &args.model,
        &args.inputs,
        &args.output,
        dtype,
        &Default::default(),
    )
}

/// Whether `model` is an SDXL UNet: a diffusers folder with `unet/config.json` (or that
/// folder), or a single file holding `model.diffusion_model.` tensors.
fn is_sdxl(model: &Path) -> bool {
    if model.is_dir() {
        return model.join("unet/config.json").is_file()
            || (model.join("config.json").is_file() && UNetCheckpoint::open(model).is_ok());
    }
    holds_sgm_unet(model).unwrap_or(false)
}
