//! Loading a VAE from a diffusers folder or a single file, one tensor at a time.

use burn_kernels::Kernels;
use std::path::Path;

use burn::tensor::FloatDType;
use burn_quant::Checkpoint;

use super::keys::{KeyScheme, VaeLayout, parameter_name};
use super::{AutoencoderKl, VaeConfig};
use crate::error::LoadError;
use crate::weights::{NamedTensors, component_folder};

/// An opened VAE checkpoint: its tensors, key layout and configuration.
pub struct VaeCheckpoint {
    tensors: NamedTensors,
    layout: VaeLayout,
    config: VaeConfig,
}

impl VaeCheckpoint {
    /// Opens a diffusers folder (a pipeline folder with `vae/`, or the `vae` folder itself:
    /// `config.json` and its safetensors), or a single `.safetensors` file in either layout
    /// (FLUX.1's `ae.safetensors`, FLUX.2's `flux2-vae.safetensors` from BFL or ComfyUI,
    /// SDXL's `sdxl_vae.safetensors`, or an all-in-one checkpoint whose VAE keys start with
    /// `first_stage_model.` or `vae.`).
    ///
    /// A single file's configuration is inferred from its tensors ([`VaeConfig::from_keys`]).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let (folder, config) = if path.is_dir() {
            let folder = component_folder(path, "vae").ok_or_else(|| LoadError::UnknownLayout {
                path: path.to_path_buf(),
            })?;
            let config = VaeConfig::from_diffusers_json(&folder.join("config.json"))?;
            (folder, Some(config))
        } else {
            (path.to_path_buf(), None)
        };
        let files = Checkpoint::open(&folder)?;
        let names: Vec<&str> = files.tensors().map(|t| t.name).collect();
        let scheme = KeyScheme::detect(&names).ok_or_else(|| LoadError::Config {
            file: folder.clone(),
            message: "no VAE tensors (`encoder.down_blocks.*` or `encoder.down.*`)".into(),
        })?;
        let layout = scheme.layout;
        let tensors = NamedTensors::new(files, &folder, |key| scheme.canonical(key))?;
        let config = match config {
            Some(config) => config,
            None => VaeConfig::from_keys(&folder, tensors.names(), |name| tensors.shape(name))?,
        };
        Ok(Self {
            tensors,
            layout,
            config,
        })
    }

    /// The key layout of the files.
    pub fn layout(&self) -> VaeLayout {
        self.layout
    }

    /// The model's configuration.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// Builds the model with its weights (and FLUX.2's batch-norm statistics) in `dtype` on
    /// `device`; every missing, unexpected or mis-shaped tensor is reported at once in
    /// [`LoadError::Keys`].
    pub fn load<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<AutoencoderKl<B>, LoadError> {
        let model = self.config.init::<B>(device);
        self.tensors
            .load(model, parameter_name, device, dtype, None)
    }
}

impl<B: Kernels> AutoencoderKl<B> {
    /// Opens and loads a checkpoint (see [`VaeCheckpoint::open`] and [`VaeCheckpoint::load`]).
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        VaeCheckpoint::open(path)?.load(device, dtype)
    }
}
