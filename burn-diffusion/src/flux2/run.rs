//! One FLUX.2 forward pass from files (what `burnlora forward` runs for this family).

use std::path::Path;

use burn::tensor::FloatDType;
use burn_kernels::Kernels;

use super::{Flux2, Flux2Input};
use crate::error::LoadError;
use crate::flux::{InputFile, write_output};

/// Input keys, in diffusers' names.
const KEYS: [&str; 6] = [
    "hidden_states",
    "encoder_hidden_states",
    "timestep",
    "guidance",
    "img_ids",
    "txt_ids",
];

/// Loads `model` (a diffusers folder or a BFL file) in `dtype`, runs it on `inputs` and writes
/// the result under the key `output` to `output` (atomically, in the model's dtype). Returns
/// the output's shape.
///
/// `inputs` holds `hidden_states` `[B, N, C]`, `encoder_hidden_states` `[B, T, D]`, `timestep`
/// `[B]` (σ in `[0, 1]`), `guidance` `[B]` (only for a model with a guidance embedding),
/// `img_ids` `[N, 4]` and `txt_ids` `[T, 4]`.
pub fn forward_file<B: Kernels>(
    model: &Path,
    inputs: &Path,
    output: &Path,
    dtype: FloatDType,
    device: &B::Device,
) -> Result<Vec<usize>, LoadError> {
    let flux = Flux2::<B>::load(model, device, dtype)?;
    let config = flux.config();
    let inputs = InputFile::open(inputs, &KEYS, "the FLUX.2 transformer")?;
    let widths = [
        config.in_channels,
        config.context_in_dim,
        config.axes_dim.len(),
    ];
    let tokens = inputs.tokens::<B>(widths, config.guidance_embed, device, dtype)?;
    let input = Flux2Input {
        img: tokens.img,
        txt: tokens.txt,
        timesteps: tokens.timesteps,
        guidance: tokens.guidance,
        img_ids: tokens.img_ids,
        txt_ids: tokens.txt_ids,
    };
    let result = flux.forward(input);
    let shape = result.dims().to_vec();
    write_output(output, result.into_data())?;
    Ok(shape)
}
