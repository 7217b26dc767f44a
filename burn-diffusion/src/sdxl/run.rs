//! One forward pass of the UNet from files (what `burnlora forward` runs for SDXL): a
//! checkpoint, inputs under the names of diffusers' `UNet2DConditionModel.forward` arguments
//! (`added_cond_kwargs` flattened to `text_embeds` and `time_ids`), the output written as
//! safetensors.

use std::path::Path;

use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_kernels::Kernels;

use super::{UNet2DCondition, UNetCheckpoint, UNetInput};
use crate::error::LoadError;
use crate::flux::{InputFile, write_output};

/// Input keys, in diffusers' names.
const KEYS: [&str; 5] = [
    "sample",
    "timestep",
    "encoder_hidden_states",
    "text_embeds",
    "time_ids",
];

/// Loads `model` (a diffusers folder or the original single file, [`UNetCheckpoint::open`]) in
/// `dtype`, runs it on `inputs` and writes the result under the key `output` to `output`
/// (atomically, in the model's dtype). Returns the output's shape.
///
/// `inputs` holds `sample` `[B, C, H, W]`, `timestep` `[B]` (DDPM's, 0 to 999),
/// `encoder_hidden_states` `[B, T, D]`, `text_embeds` `[B, P]` and `time_ids` `[B, 6]`.
pub fn forward_file<B: Kernels>(
    model: &Path,
    inputs: &Path,
    output: &Path,
    dtype: FloatDType,
    device: &B::Device,
) -> Result<Vec<usize>, LoadError> {
    let unet = UNetCheckpoint::open(model)?.load::<B>(device, dtype)?;
    let input = read_inputs(&unet, inputs, device, dtype)?;
    let result = unet.forward(input);
    let shape = result.dims().to_vec();
    write_output(output, result.into_data())?;
    Ok(shape)
}

/// Reads the inputs and checks their shapes against `unet`'s configuration.
fn read_inputs<B: Kernels>(
    unet: &UNet2DCondition<B>,
    file: &Path,
    device: &B::Device,
    dtype: FloatDType,
) -> Result<UNetInput<B>, LoadError> {
    let config = unet.config();
    let inputs = InputFile::open(file, &KEYS, "the SDXL UNet")?;
    let (sample, shape) = inputs.read("sample", &[None, Some(config.in_channels), None, None])?;
    let batch = shape[0];
    let (states, states_shape) = inputs.read(
        "encoder_hidden_states",
        &[Some(batch), None, Some(config.cross_attention_dim)],
    )?;
    let pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim;
    let (timestep, _) = inputs.read("timestep", &[Some(batch)])?;
    let (text_embeds, _) = inputs.read("text_embeds", &[Some(batch), Some(pooled)])?;
    let (time_ids, _) = inputs.read("time_ids", &[Some(batch), Some(6)])?;
    let options = (device, DType::from(dtype));
    let f32s = (device, DType::F32);
    Ok(UNetInput {
        sample: Tensor::from_data(TensorData::new(sample, shape), options),
        timestep: Tensor::from_data(TensorData::new(timestep, [batch]), f32s),
        encoder_hidden_states: Tensor::from_data(TensorData::new(states, states_shape), options),
        text_embeds: Tensor::from_data(TensorData::new(text_embeds, [batch, pooled]), options),
        time_ids: Tensor::from_data(TensorData::new(time_ids, [batch, 6]), f32s),
    })
}
