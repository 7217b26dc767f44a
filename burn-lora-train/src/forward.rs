//! `burnlora forward`: one forward pass of the FLUX.1 or FLUX.2 transformer from files, to
//! compare with diffusers.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use burn::tensor::FloatDType;
use burn_diffusion::LoadError;
use burn_diffusion::flux::forward_file;
use burn_diffusion::flux2::Flux2Checkpoint;

/// Arguments of `burnlora forward`.
#[derive(clap::Args)]
pub struct ForwardArgs {
    /// The transformer (FLUX.1 or FLUX.2, recognised from its files): a diffusers folder (with
    /// `transformer/config.json`) or a BFL-layout `.safetensors` file (bf16, f32 or scaled FP8).
    #[arg(long)]
    model: PathBuf,
    /// Inputs under diffusers' argument names: `hidden_states` [B, N, C],
    /// `encoder_hidden_states` [B, T, D], `pooled_projections` [B, P], `timestep` [B] (σ in
    /// [0, 1]), `guidance` [B] (models with guidance), `img_ids` [N, 3], `txt_ids` [T, 3]; for
    /// FLUX.2 the same without `pooled_projections`, with ids [N, 4] and [T, 4].
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

/// The FLUX.2 transformer's pass when the model is a FLUX.2 checkpoint, else FLUX.1's.
fn forward_on_device(args: &ForwardArgs, dtype: FloatDType) -> Result<Vec<usize>, LoadError> {
    let forward = if Flux2Checkpoint::open(&args.model).is_ok() {
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
