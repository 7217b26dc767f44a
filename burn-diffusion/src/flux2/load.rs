//! Loading FLUX.2 weights from a BFL single file (bf16 or FP8, also under ComfyUI's
//! `model.diffusion_model.`) or a diffusers folder (sharded or not), one tensor at a time,
//! through the loader FLUX.1 uses.

use std::path::Path;

use burn::tensor::FloatDType;
use burn_kernels::Kernels;

use super::keys::{linear_keys, vector_keys};
use super::{Flux2, Flux2Config};
use crate::error::LoadError;
use crate::flux::{Layout, TransformerFiles};
use crate::weights::PlaceWeight;

/// A BFL key only FLUX.2 files have.
const MARKER: &str = "double_stream_modulation_img.lin.weight";

/// An opened FLUX.2 checkpoint: its files, layout and configuration.
pub struct Flux2Checkpoint {
    files: TransformerFiles,
    config: Flux2Config,
}

impl Flux2Checkpoint {
    /// Opens a BFL-layout `.safetensors` file (`flux2-dev.safetensors`, ComfyUI's FP8 files;
    /// keys possibly under `model.diffusion_model.`) or a diffusers folder (a pipeline folder
    /// with `transformer/`, or that folder itself). The configuration comes from
    /// `config.json`, or is inferred from a BFL file's keys ([`Flux2Config::from_bfl_keys`]).
    pub fn open(path: &Path) -> Result<Self, LoadError> {
        let files = TransformerFiles::open(path, MARKER, "FLUX.2")?;
        let config = match files.layout {
            Layout::Diffusers => Flux2Config::from_diffusers_json(&files.config_json())?,
            Layout::Bfl => {
                Flux2Config::from_bfl_keys(path, files.bfl_keys(), |key| files.shape(key))?
            }
        };
        Ok(Self { files, config })
    }

    /// The key layout.
    pub fn layout(&self) -> Layout {
        self.files.layout
    }

    /// The model's configuration.
    pub fn config(&self) -> &Flux2Config {
        &self.config
    }

    /// Builds the model with its weights in `dtype` on `device`; every missing, unexpected or
    /// mis-shaped key is reported at once ([`LoadError::Keys`]).
    pub fn load<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
    ) -> Result<Flux2<B>, LoadError> {
        self.load_placed(device, dtype, None)
    }

    /// As [`Flux2Checkpoint::load`], but every weight matrix (Burn's layout, in `dtype`) is
    /// handed to `place`, by parameter path, instead of being uploaded to `device` (into host
    /// memory for streaming, with burn-offload's `WeightStream::streamed_tensor`).
    pub fn load_with<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: &mut PlaceWeight<'_, B>,
    ) -> Result<Flux2<B>, LoadError> {
        self.load_placed(device, dtype, Some(place))
    }

    fn load_placed<B: Kernels>(
        &self,
        device: &B::Device,
        dtype: FloatDType,
        place: Option<&mut PlaceWeight<'_, B>>,
    ) -> Result<Flux2<B>, LoadError> {
        self.files.load(
            self.config.init::<B>(device),
            &linear_keys(&self.config),
            &vector_keys(&self.config),
            device,
            dtype,
            place,
        )
    }
}

impl<B: Kernels> Flux2<B> {
    /// Opens and loads a checkpoint (see [`Flux2Checkpoint::open`] and
    /// [`Flux2Checkpoint::load`]).
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        Flux2Checkpoint::open(path)?.load(device, dtype)
    }
}
