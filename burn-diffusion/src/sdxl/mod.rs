//! SDXL: the UNet (diffusers' `UNet2DConditionModel` as SDXL base 1.0 configures it), its
//! configuration, and loading from diffusers folders.

mod config;
mod load;
mod model;

pub use config::UNetConfig;
pub use load::UNetCheckpoint;
pub use model::{
    Attention, BasicTransformerBlock, CrossAttnDownBlock2D, CrossAttnUpBlock2D, Downsample2D,
    FeedForward, Geglu, ResnetBlock2D, TimestepEmbedding, Transformer2DModel, UNet2DCondition,
    UNetInput, UNetMidBlock2DCrossAttn, Upsample2D,
};
