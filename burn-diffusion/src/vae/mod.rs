//! AutoencoderKL, the VAE of FLUX.1 (16 latent channels, scaled and shifted), FLUX.2 (32
//! channels, 2×2 patches normalized by batch-norm statistics) and SDXL (4 channels, scaled):
//! images to latents for training, latents to images for previews. Loads diffusers folders and
//! the original single files.

mod config;
mod keys;
mod load;
mod model;

pub(crate) use config::check_group_norm;
pub use config::{LatentBatchNormConfig, VaeConfig};
pub use keys::VaeLayout;
pub use load::VaeCheckpoint;
pub use model::{
    AutoencoderKl, Decoder, DownEncoderBlock2D, Downsample2D, Encoder, LatentBatchNorm,
    LatentDistribution, ResnetBlock2D, SpatialAttention, UNetMidBlock2D, UpDecoderBlock2D,
    Upsample2D, norm_in_f32,
};
pub(crate) use model::{conv, group_norm, nearest_2x, pad_bottom_right};
