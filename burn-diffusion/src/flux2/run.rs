//! One FLUX.2 forward pass from files (what `burnlora forward` runs for this family).

use std::path::Path;

use burn::tensor::{DType, FloatDType, Tensor, TensorData};
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
    let (img, img_shape) = inputs.read("hidden_states", &[None, None, Some(config.in_channels)])?;
    let [batch, img_len] = [img_shape[0], img_shape[1]];
    let (txt, txt_shape) = inputs.read(
        "encoder_hidden_states",
        &[Some(batch), None, Some(config.context_in_dim)],
    )?;
    let txt_len = txt_shape[1];
    let (timesteps, _) = inputs.read("timestep", &[Some(batch)])?;
    let guidance = inputs.guidance(config.guidance_embed, batch)?;
    let axes = config.axes_dim.len();
    let (img_ids, _) = inputs.read("img_ids", &[Some(img_len), Some(axes)])?;
    let (txt_ids, _) = inputs.read("txt_ids", &[Some(txt_len), Some(axes)])?;

    let options = (device, DType::from(dtype));
    let tensor3 =
        |v: Vec<f32>, s: [usize; 3]| Tensor::<B, 3>::from_data(TensorData::new(v, s), options);
    let tensor1 = |v: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(v, [batch]), options);
    let input = Flux2Input {
        img: tensor3(img, [batch, img_len, config.in_channels]),
        txt: tensor3(txt, [batch, txt_len, config.context_in_dim]),
        timesteps: tensor1(timesteps),
        guidance: guidance.map(tensor1),
        img_ids: TensorData::new(img_ids, [img_len, axes]),
        txt_ids: TensorData::new(txt_ids, [txt_len, axes]),
    };
    let result = flux.forward(input);
    let shape = result.dims().to_vec();
    write_output(output, result.into_data())?;
    Ok(shape)
}
