//! Opening a Wan transformer's files: a diffusers folder, or a single file in Wan's original
//! layout or under diffusers' names.

use std::path::Path;

use burn::tensor::FloatDType;
use burn_kernels::Kernels;
use burn_quant::Checkpoint;

use super::{WanConfig, WanTransformer3D, diffusers_name};
use crate::error::LoadError;
use crate::weights::{NamedTensors, PlaceWeight, component_folder, diffusers_weights};

/// An opened Wan transformer checkpoint: its tensors under diffusers' names, and its
/// configuration.
pub struct WanCheckpoint {
    tensors: NamedTensors,
    config: WanConfig,
}

impl WanCheckpoint {
    /// Opens diffusers' layout: a pipeline folder with `transformer/`, or the `transformer`
    /// folder itself (`config.json` and `diffusion_pytorch_model.safetensors` or a shard
    /// index); or a single file in Wan's original layout (Wan-Video's
    /// `diffusion_pytorch_model*.safetensors`, ComfyUI's repackaged files) or under diffusers'
    /// names, whose configuration is inferred ([`WanConfig::from_keys`]). Tensors may be bf16,
    /// f16, f32 or FP8 with scales.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        if path.is_file() {
            return Self::open_file(path, None);
        }
        let folder = component_folder(path, "transformer").ok_or_else(|| LoadError::Config {
            file: path.to_path_buf(),
            message: "no transformer/config.json here: expected a diffusers Wan folder or its \
                      transformer folder"
                .into(),
        })?;
        let config = WanConfig::from_json(&folder.join("config.json"))?;
        let weights = diffusers_weights(folder);
        let tensors = NamedTensors::new(Checkpoint::open(&weights)?, &weights, |key| {
            Some(key.to_string())
        })?;
        Ok(Self { tensors, config })
    }

    /// Opens a single file in Wan's original layout or under diffusers' names (see
    /// [`diffusers_name`]) as a model of shape `config`, or of the shape its tensors give when
    /// `None`.
    pub fn open_file(file: &Path, config: Option<WanConfig>) -> Result<Self, LoadError> {
        let tensors = NamedTensors::new(Checkpoint::open(file)?, file, |key| {
            Some(diffusers_name(key))
        })?;
        let config = match config {
            Some(config) => config,
            None => WanConfig::from_keys(file, tensors.names(), |name| tensors.shape(name))?,
        };
        Ok(Self { tensors, config })
    }

    /// The model's configuration.
    pub fn config(&self) -> &WanConfig {
        &self.config
    }

    /// Builds the model with its weights in `dtype` on `device`; every missing, unexpected or
    /// mis-shaped tensor is reported at once in [`LoadError::Keys`].
    pub fn load<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<WanTransformer3D<B>, LoadError> {
        self.load_placed(device, dtype, None)
    }

    /// As [`WanCheckpoint::load`], but every `Linear` weight (Burn's layout, in `dtype`) is
    /// handed to `place`, by parameter path, instead of being uploaded to `device`.
    pub fn load_with<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: &mut PlaceWeight<'_, B>,
    ) -> Result<WanTransformer3D<B>, LoadError> {
        self.load_placed(device, dtype, Some(place))
    }

    fn load_placed<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<WanTransformer3D<B>, LoadError> {
        self.tensors.load(
            self.config.init::<B>(device),
            str::to_string,
            device,
            dtype,
            place,
        )
    }
}
