//! SDXL: the UNet (diffusers' `UNet2DConditionModel` as SDXL base 1.0 configures it), its
//! configuration, loading from diffusers folders and from the original (SGM) single file, and
//! the names of its layers in both layouts and in LoRA files.
//!
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::{Distribution, Tensor};
//! use burn_diffusion::sdxl::{UNetConfig, UNetInput};
//!
//! let device = Default::default();
//! // SDXL's shape at widths 8, 16, 16; a real model comes from `UNet2DCondition::load`.
//! let config = UNetConfig {
//!     block_out_channels: vec![8, 16, 16],
//!     attention_head_dim: vec![1, 2, 2],
//!     cross_attention_dim: 12,
//!     addition_time_embed_dim: 4,
//!     projection_class_embeddings_input_dim: 10 + 6 * 4,
//!     norm_num_groups: 4,
//!     ..UNetConfig::sdxl()
//! };
//! let unet = config.init::<Flex>(&device);
//! let normal = Distribution::Normal(0.0, 1.0);
//! let input = UNetInput {
//!     sample: Tensor::random([1, 4, 8, 8], normal, &device),
//!     timestep: Tensor::from_floats([999.0], &device),
//!     encoder_hidden_states: Tensor::random([1, 7, 12], normal, &device),
//!     text_embeds: Tensor::random([1, 10], normal, &device),
//!     time_ids: Tensor::from_floats([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]], &device),
//! };
//! assert_eq!(unet.forward(input).dims(), [1, 4, 8, 8]);
//! ```

mod config;
mod keys;
mod load;
mod model;
mod run;

pub use config::UNetConfig;
pub use keys::{
    ModuleKind, SGM_UNET_PREFIX, TEXT_ENCODERS, UNetLayout, UNetModule, lora_names,
    text_encoder_names, unet_modules,
};
pub use load::{UNetCheckpoint, holds_sgm_unet};
pub use model::{
    Attention, BasicTransformerBlock, CrossAttnDownBlock2D, CrossAttnUpBlock2D, Downsample2D,
    FeedForward, Geglu, ResnetBlock2D, TimestepEmbedding, Transformer2DModel, UNet2DCondition,
    UNetInput, UNetMidBlock2DCrossAttn, Upsample2D,
};
pub use run::forward_file;
