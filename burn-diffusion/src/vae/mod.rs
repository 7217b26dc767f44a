//! AutoencoderKL, the VAE of FLUX.1 (16 latent channels, scaled and shifted) and SDXL
//! (4 channels, scaled): images to latents for training, latents to images for previews.
//! Loads diffusers folders and the original single files.

mod config;
mod keys;
mod load;
mod model;

pub use config::VaeConfig;
pub use keys::VaeLayout;
pub use load::VaeCheckpoint;
pub use model::{
    AutoencoderKl, Decoder, DownEncoderBlock2D, Downsample2D, Encoder, LatentDistribution,
    ResnetBlock2D, SpatialAttention, UNetMidBlock2D, UpDecoderBlock2D, Upsample2D, norm_in_f32,
};
