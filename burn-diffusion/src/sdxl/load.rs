//! Loading the SDXL UNet from a diffusers folder, or from any files whose keys a renaming maps
//! to diffusers' names, one tensor at a time.

use std::collections::HashMap;
use std::path::Path;

use burn::tensor::FloatDType;
use burn_kernels::Kernels;
use burn_quant::Checkpoint;

use super::{SGM_UNET_PREFIX, UNet2DCondition, UNetConfig, unet_modules};
use crate::error::LoadError;
use crate::weights::{NamedTensors, PlaceWeight, component_folder, diffusers_weights};

/// An opened SDXL UNet checkpoint: its tensors under diffusers' names, and its configuration.
pub struct UNetCheckpoint {
    tensors: NamedTensors,
    config: UNetConfig,
}

impl UNetCheckpoint {
    /// Opens a diffusers folder: a pipeline folder with `unet/`, or the `unet` folder itself
    /// (`config.json` and `diffusion_pytorch_model.safetensors`, a shard index, or one other
    /// `.safetensors` file such as the `.fp16` variant); or a single file of SDXL base 1.0's
    /// shape: the original (SGM) one (`sd_xl_base_1.0.safetensors` and fine-tunes of it: the
    /// UNet's tensors under `model.diffusion_model.`, the file's other components ignored), or
    /// a UNet's own file under diffusers' keys. Tensors may be bf16, f16, f32 or FP8 with
    /// scales.
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        if path.is_file() {
            return if holds_sgm_unet(path)? {
                Self::open_sgm(path, UNetConfig::sdxl())
            } else {
                Self::with_names(path, UNetConfig::sdxl(), |key| Some(key.to_string()))
            };
        }
        let folder = component_folder(path, "unet").ok_or_else(|| LoadError::Config {
            file: path.to_path_buf(),
            message: "no unet/config.json here: expected a diffusers SDXL folder or its unet \
                      folder"
                .into(),
        })?;
        let config = UNetConfig::from_json(&folder.join("config.json"))?;
        let weights = diffusers_weights(folder);
        Self::with_names(&weights, config, |key| Some(key.to_string()))
    }

    /// Opens the tensors at `path` (a `.safetensors` file, a shard index, or a folder holding
    /// one of either) for a model of shape `config`, each tensor named by `name`: its diffusers
    /// key (the model's parameter path), or `None` for a tensor that is not the UNet's (another
    /// component of an all-in-one file), which is ignored. This is how a checkpoint in another
    /// layout is read: `name` renames its keys.
    pub fn with_names(
        path: &Path,
        config: UNetConfig,
        name: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, LoadError> {
        config.validate().map_err(|message| LoadError::Config {
            file: path.to_path_buf(),
            message,
        })?;
        let files = Checkpoint::open(path)?;
        let tensors = NamedTensors::new(files, path, name)?;
        Ok(Self { tensors, config })
    }

    /// Opens the original (SGM) single file at `path` for a UNet of shape `config`: each
    /// tensor under `model.diffusion_model.` is renamed by the table of [`unet_modules`]; the
    /// file's other tensors are ignored.
    pub fn open_sgm(path: &Path, config: UNetConfig) -> Result<Self, LoadError> {
        let names: HashMap<String, String> = unet_modules(&config.layout())
            .iter()
            .flat_map(|module| module.param_keys().collect::<Vec<_>>())
            .map(|(sgm, diffusers)| (format!("{SGM_UNET_PREFIX}{sgm}"), diffusers))
            .collect();
        let sgm_key = |key: &str| {
            let renamed = names.get(key).cloned();
            // A UNet key the table lacks is kept under its own name, so that it is reported.
            match renamed {
                Some(name) => Some(name),
                None => key.starts_with(SGM_UNET_PREFIX).then(|| key.to_string()),
            }
        };
        Self::with_names(path, config, sgm_key)
    }

    /// The model's configuration.
    pub fn config(&self) -> &UNetConfig {
        &self.config
    }

    /// The diffusers names of the tensors present.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.names()
    }

    /// The shape of the tensor of diffusers name `name`, if present.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.shape(name)
    }

    /// Builds the model with its weights in `dtype` on `device`; every missing, unexpected or
    /// mis-shaped tensor is reported at once in [`LoadError::Keys`].
    pub fn load<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<UNet2DCondition<B>, LoadError> {
        self.load_placed(device, dtype, None)
    }

    /// As [`UNetCheckpoint::load`], but every projection's weight matrix (Burn's `[d_input,
    /// d_output]` layout, in `dtype`) is handed to `place` by parameter path instead of being
    /// uploaded to `device` (burn-offload's `WeightStream::streamed_tensor`, for a model kept in
    /// host memory). Convolutions, norms and biases go to `device`. An error `place` returns is
    /// reported as [`LoadError::Place`] naming the parameter.
    pub fn load_with<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: &mut PlaceWeight<'_, B>,
    ) -> Result<UNet2DCondition<B>, LoadError> {
        self.load_placed(device, dtype, Some(place))
    }

    fn load_placed<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<UNet2DCondition<B>, LoadError> {
        let model = self.config.init::<B>(device);
        self.tensors
            .load(model, str::to_string, device, dtype, place)
    }
}

impl<B: Kernels> UNet2DCondition<B> {
    /// Opens and loads a diffusers folder (see [`UNetCheckpoint::open`] and
    /// [`UNetCheckpoint::load`]).
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        UNetCheckpoint::open(path)?.load(device, dtype)
    }
}

/// Whether the single file at `path` holds a UNet in the original (SGM) layout (tensors under
/// `model.diffusion_model.`).
pub fn holds_sgm_unet(path: &Path) -> Result<bool, LoadError> {
    Ok(Checkpoint::open(path)?
        .tensors()
        .any(|t| t.name.starts_with(SGM_UNET_PREFIX)))
}
