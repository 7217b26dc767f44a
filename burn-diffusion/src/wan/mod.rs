//! Wan 2.1 / 2.2's video transformer (diffusers' `WanTransformer3DModel`): configuration,
//! model and loading.

mod config;
mod keys;
mod load;
mod model;
mod run;

pub use config::WanConfig;
pub use keys::{diffusers_name, holds_wan, linear_modules, lora_names, original_name};
pub use load::WanCheckpoint;
pub use model::{
    WanAttention, WanBlock, WanConditionEmbedder, WanFeedForward, WanInput, WanPatchEmbedding,
    WanTransformer3D,
};
pub use run::forward_file;
