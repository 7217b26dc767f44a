//! Loading FLUX.2 weights from a BFL single file (bf16 or FP8, also under ComfyUI's
//! `model.diffusion_model.`) or a diffusers folder (sharded or not), one tensor at a time,
//! through the loader FLUX.1 uses.

use std::path::Path;

use burn::tensor::FloatDType;
use burn::tensor::backend::Backend;
use burn_kernels::Kernels;

use super::keys::{linear_keys, vector_keys};
use super::{Flux2, Flux2Config};
use crate::error::LoadError;
use crate::flux::{LinearKeys, TransformerCheckpoint, TransformerConfig, VectorKeys};

/// An opened FLUX.2 checkpoint (`flux2-dev.safetensors`, ComfyUI's FP8 files, a diffusers
/// folder).
pub type Flux2Checkpoint = TransformerCheckpoint<Flux2Config>;

impl TransformerConfig for Flux2Config {
    type Model<B: Backend> = Flux2<B>;
    const MODEL: &'static str = "FLUX.2";
    const MARKER: &'static str = "double_stream_modulation_img.lin.weight";

    fn from_diffusers_json(file: &Path) -> Result<Self, LoadError> {
        Flux2Config::from_diffusers_json(file)
    }

    fn from_bfl_keys<'a>(
        file: &Path,
        keys: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        Flux2Config::from_bfl_keys(file, keys, shape_of)
    }

    fn build<B: Kernels>(&self, device: &B::Device) -> Flux2<B> {
        self.init(device)
    }

    fn key_tables(&self) -> (Vec<LinearKeys>, Vec<VectorKeys>) {
        (linear_keys(self), vector_keys(self))
    }
}

impl<B: Kernels> Flux2<B> {
    /// Opens and loads a checkpoint (see [`TransformerCheckpoint::open`] and
    /// [`TransformerCheckpoint::load`]).
    pub fn load(path: &Path, device: &B::Device, dtype: FloatDType) -> Result<Self, LoadError> {
        Flux2Checkpoint::open(path)?.load(device, dtype)
    }
}
