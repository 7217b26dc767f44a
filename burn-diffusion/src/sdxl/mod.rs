//! SDXL: the names of its UNet's tensors in the original (SGM) single file and in diffusers,
//! and the LoRA names that follow from them.

mod keys;

pub use keys::{ModuleKind, SGM_UNET_PREFIX, UNetLayout, UNetModule, lora_names, unet_modules};
