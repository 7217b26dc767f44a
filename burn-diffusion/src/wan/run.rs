//! One forward pass of the transformer from files (what `burnlora forward` runs for Wan): a
//! checkpoint, inputs under the names of diffusers' `WanTransformer3DModel.forward` arguments,
//! the output written as safetensors.

use std::path::Path;

use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_kernels::Kernels;

use super::{WanInput, WanTransformer3D};
use crate::error::LoadError;
use crate::flux::{InputFile, write_output};

/// Input keys, in diffusers' names.
const KEYS: [&str; 3] = ["hidden_states", "timestep", "encoder_hidden_states"];

/// Loads `model` (a diffusers folder or a single file, [`WanTransformer3D::load`]) in `dtype`,
/// runs it on `inputs` and writes the result under the key `output` to `output` (atomically,
/// in the model's dtype). Returns the output's shape.
///
/// `inputs` holds `hidden_states` `[B, C, F, H, W]`, `timestep` `[B]` (0 to 1000) and
/// `encoder_hidden_states` `[B, T, text_dim]`.
pub fn forward_file<B: Kernels>(
    model: &Path,
    inputs: &Path,
    output: &Path,
    dtype: FloatDType,
    device: &B::Device,
) -> Result<Vec<usize>, LoadError> {
    let transformer = WanTransformer3D::<B>::load(model, device, dtype)?;
    let config = transformer.config().clone();
    let file = InputFile::open(inputs, &KEYS, "the Wan transformer")?;
    let (latent, shape) = file.read(
        "hidden_states",
        &[None, Some(config.in_channels), None, None, None],
    )?;
    if shape[2..]
        .iter()
        .zip(config.patch_size)
        .any(|(side, patch)| side % patch != 0)
    {
        return Err(LoadError::Config {
            file: inputs.to_path_buf(),
            message: format!(
                "hidden_states {shape:?}: frames, height and width must be multiples of the \
                 patch size {:?}",
                config.patch_size
            ),
        });
    }
    let batch = shape[0];
    let (timestep, _) = file.read("timestep", &[Some(batch)])?;
    let (text, text_shape) = file.read(
        "encoder_hidden_states",
        &[Some(batch), None, Some(config.text_dim)],
    )?;
    let options = (device, DType::from(dtype));
    let result = transformer.forward(WanInput {
        hidden_states: Tensor::from_data(TensorData::new(latent, shape), options),
        timestep: Tensor::from_data(TensorData::new(timestep, [batch]), (device, DType::F32)),
        encoder_hidden_states: Tensor::from_data(TensorData::new(text, text_shape), options),
    });
    let shape = result.dims().to_vec();
    write_output(output, result.into_data())?;
    Ok(shape)
}
