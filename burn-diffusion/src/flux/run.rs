//! One forward pass from files: a checkpoint, inputs under diffusers' argument names, and the
//! output written as safetensors (what `burnlora forward` runs).

use burn_kernels::Kernels;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_quant::Checkpoint;
use safetensors::tensor::TensorView;

use super::load::read_f32;
use super::{Flux, FluxConfig, FluxInput};
use crate::error::LoadError;

/// Input keys and what they hold, in diffusers' names.
const KEYS: [&str; 7] = [
    "hidden_states",
    "encoder_hidden_states",
    "pooled_projections",
    "timestep",
    "guidance",
    "img_ids",
    "txt_ids",
];

/// Loads `model` (a diffusers folder or a BFL file) in `dtype`, runs it on `inputs` and writes
/// the result under the key `output` to `output` (atomically, in the model's dtype). Returns
/// the output's shape.
///
/// `inputs` holds `hidden_states` `[B, N, C]`, `encoder_hidden_states` `[B, T, D]`,
/// `pooled_projections` `[B, P]`, `timestep` `[B]` (σ in `[0, 1]`), `guidance` `[B]` (only
/// for a model with a guidance embedding), `img_ids` `[N, 3]` and `txt_ids` `[T, 3]`.
pub fn forward_file<B: Kernels>(
    model: &Path,
    inputs: &Path,
    output: &Path,
    dtype: FloatDType,
    device: &B::Device,
) -> Result<Vec<usize>, LoadError> {
    let flux = Flux::<B>::load(model, device, dtype)?;
    let input = read_inputs::<B>(inputs, flux.config(), device, dtype)?;
    let result = flux.forward(input);
    let shape = result.dims().to_vec();
    write_output(output, result.into_data())?;
    Ok(shape)
}

/// Reads and checks the inputs of one forward pass.
fn read_inputs<B: Kernels>(
    file: &Path,
    config: &FluxConfig,
    device: &B::Device,
    dtype: FloatDType,
) -> Result<FluxInput<B>, LoadError> {
    let inputs = InputFile::open(file, &KEYS, "the FLUX transformer")?;
    let widths = [
        config.in_channels,
        config.context_in_dim,
        config.axes_dim.len(),
    ];
    let tokens = inputs.tokens::<B>(widths, config.guidance_embed, device, dtype)?;
    let (y, _) = inputs.read(
        "pooled_projections",
        &[Some(tokens.batch), Some(config.vec_in_dim)],
    )?;
    let y = TensorData::new(y, [tokens.batch, config.vec_in_dim]);
    Ok(FluxInput {
        img: tokens.img,
        txt: tokens.txt,
        y: Tensor::from_data(y, (device, DType::from(dtype))),
        timesteps: tokens.timesteps,
        guidance: tokens.guidance,
        img_ids: tokens.img_ids,
        txt_ids: tokens.txt_ids,
    })
}

/// The inputs FLUX.1 and FLUX.2 share, read from an [`InputFile`].
pub(crate) struct Tokens<B: Backend> {
    /// Samples in the batch.
    pub batch: usize,
    /// `hidden_states`.
    pub img: Tensor<B, 3>,
    /// `encoder_hidden_states`.
    pub txt: Tensor<B, 3>,
    /// `timestep`.
    pub timesteps: Tensor<B, 1>,
    /// `guidance`, for a model that embeds it.
    pub guidance: Option<Tensor<B, 1>>,
    /// `img_ids`.
    pub img_ids: TensorData,
    /// `txt_ids`.
    pub txt_ids: TensorData,
}

/// A safetensors file of one forward pass's inputs, under a model's argument names.
pub(crate) struct InputFile {
    file: PathBuf,
    files: Checkpoint,
}

impl InputFile {
    /// Opens `file`, whose every key must be one of `allowed` (the inputs of `model`).
    pub fn open(file: &Path, allowed: &[&str], model: &str) -> Result<Self, LoadError> {
        let inputs = Self {
            file: file.to_path_buf(),
            files: Checkpoint::open(file)?,
        };
        if let Some(extra) = inputs.files.tensors().find(|t| !allowed.contains(&t.name)) {
            return Err(inputs.error(
                extra.name,
                format!("not an input of {model} (expected {allowed:?})"),
            ));
        }
        Ok(inputs)
    }

    fn error(&self, key: &str, message: String) -> LoadError {
        LoadError::Input {
            file: self.file.clone(),
            key: key.to_string(),
            message,
        }
    }

    /// Reads `key` as f32 after checking its shape against `expected` (`None`: any size).
    pub fn read(
        &self,
        key: &str,
        expected: &[Option<usize>],
    ) -> Result<(Vec<f32>, Vec<usize>), LoadError> {
        let entry = self
            .files
            .get(key)
            .ok_or_else(|| self.error(key, "missing".into()))?;
        let fits = entry.shape.len() == expected.len()
            && entry
                .shape
                .iter()
                .zip(expected)
                .all(|(s, e)| e.is_none_or(|e| e == *s));
        if !fits {
            let want: Vec<String> = expected
                .iter()
                .map(|e| e.map_or("_".to_string(), |e| e.to_string()))
                .collect();
            return Err(self.error(
                key,
                format!("shape {:?}, expected [{}]", entry.shape, want.join(", ")),
            ));
        }
        Ok((read_f32(&self.files, &entry)?, entry.shape.to_vec()))
    }

    /// The image and text tokens, timesteps, guidance and position ids, checked against the
    /// model's `[in_channels, context_in_dim, rotary axes]` and whether it embeds guidance,
    /// in `dtype` on `device` (the ids on the host).
    pub fn tokens<B: Backend>(
        &self,
        [in_channels, context, axes]: [usize; 3],
        guidance_embed: bool,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<Tokens<B>, LoadError> {
        let (img, img_shape) = self.read("hidden_states", &[None, None, Some(in_channels)])?;
        let [batch, img_len] = [img_shape[0], img_shape[1]];
        let (txt, txt_shape) =
            self.read("encoder_hidden_states", &[Some(batch), None, Some(context)])?;
        let txt_len = txt_shape[1];
        let (timesteps, _) = self.read("timestep", &[Some(batch)])?;
        let guidance = self.guidance(guidance_embed, batch)?;
        let (img_ids, _) = self.read("img_ids", &[Some(img_len), Some(axes)])?;
        let (txt_ids, _) = self.read("txt_ids", &[Some(txt_len), Some(axes)])?;
        let options = (device, DType::from(dtype));
        let tensor1 = |v: Vec<f32>| Tensor::<B, 1>::from_data(TensorData::new(v, [batch]), options);
        Ok(Tokens {
            batch,
            img: Tensor::from_data(TensorData::new(img, [batch, img_len, in_channels]), options),
            txt: Tensor::from_data(TensorData::new(txt, [batch, txt_len, context]), options),
            timesteps: tensor1(timesteps),
            guidance: guidance.map(tensor1),
            img_ids: TensorData::new(img_ids, [img_len, axes]),
            txt_ids: TensorData::new(txt_ids, [txt_len, axes]),
        })
    }

    /// The `guidance` input `[batch]`: required when the model embeds guidance, refused when
    /// it does not.
    fn guidance(&self, embedded: bool, batch: usize) -> Result<Option<Vec<f32>>, LoadError> {
        match (embedded, self.files.get("guidance").is_some()) {
            (true, _) => Ok(Some(self.read("guidance", &[Some(batch)])?.0)),
            (false, false) => Ok(None),
            (false, true) => {
                Err(self.error("guidance", "this model has no guidance embedding".into()))
            }
        }
    }
}

/// Writes `data` as the tensor `output`, through a temporary file in the same folder.
pub(crate) fn write_output(file: &Path, data: TensorData) -> Result<(), LoadError> {
    let write_error = |source| LoadError::Write {
        file: file.to_path_buf(),
        source,
    };
    let dtype = match data.dtype {
        DType::F64 => safetensors::Dtype::F64,
        DType::F16 => safetensors::Dtype::F16,
        DType::BF16 => safetensors::Dtype::BF16,
        _ => safetensors::Dtype::F32,
    };
    let data = if dtype == safetensors::Dtype::F32 {
        data.convert::<f32>()
    } else {
        data
    };
    let view = TensorView::new(dtype, data.shape.to_vec(), data.as_bytes())
        .map_err(|e| write_error(std::io::Error::other(e)))?;
    let bytes = safetensors::serialize([("output", view)], None)
        .map_err(|e| write_error(std::io::Error::other(e)))?;
    let folder = match file.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let mut temp = tempfile::NamedTempFile::new_in(folder).map_err(write_error)?;
    temp.write_all(&bytes).map_err(write_error)?;
    temp.persist(file).map_err(|e| write_error(e.error))?;
    Ok(())
}
