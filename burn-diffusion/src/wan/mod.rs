//! Wan 2.1 / 2.2's video transformer (diffusers' `WanTransformer3DModel`) and causal video VAE
//! (diffusers' `AutoencoderKLWan`): configuration, models and loading.

mod config;
mod keys;
mod load;
mod model;
mod run;
mod vae;

pub use config::{WanConfig, WanVaeConfig};
pub use keys::{
    diffusers_name, holds_wan, linear_modules, lora_names, original_name, vae_diffusers_name,
};
pub use load::WanCheckpoint;
pub use model::{
    WanAttention, WanBlock, WanConditionEmbedder, WanFeedForward, WanInput, WanPatchEmbedding,
    WanTransformer3D,
};
pub use run::forward_file;
pub use vae::{
    AvgDown3d, DupUp3d, FrameCache, ResampleMode, Resize, WanAttentionBlock, WanCausalConv3d,
    WanConv2d, WanDecoder3d, WanDownLayer, WanEncoder3d, WanMidBlock, WanResample,
    WanResidualBlock, WanResidualDownBlock, WanResidualUpBlock, WanRmsNorm, WanUpBlock, WanUpLayer,
    WanVae,
};
