//! Diffusion transformers in [Burn](https://burn.dev), loaded from the checkpoints people
//! already have and numerically equal to diffusers. FLUX.1 (dev and schnell) is here: the model
//! in plain `nn::Linear` layers (so that LoRA adapters and weight offloading apply without model
//! changes), loading from BFL single files and diffusers folders (bf16, f32, or FP8 with
//! scales), one tensor at a time, and block-level gradient checkpointing for training. SDXL's
//! UNet ([`sdxl`]) loads from diffusers folders the same way, and so do Wan's video
//! transformer and its causal 3-D VAE ([`wan`]). The text encoders are FLUX.1's CLIP and T5 ([`clip`], [`t5`]), Wan's
//! umT5 ([`t5`]) and FLUX.2's decoders, Mistral Small 3 and Qwen3 ([`text_decoder`]), with their
//! prompt tokenizers ([`tokenize`]).
//!
//! # Example
//! A tiny FLUX-shaped model with random weights; a real one comes from
//! [`flux::Flux::load`].
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::{Distribution, Tensor, TensorData};
//! use burn_diffusion::flux::{FluxConfig, FluxInput};
//!
//! let device = Default::default();
//! // in, out channels, pooled and text widths, width 32, 2 heads, 1 + 1 blocks.
//! let config = FluxConfig::new(16, 16, 8, 12, 32, 2, 1, 1, vec![4, 6, 6], true);
//! let model = config.init::<Flex>(&device);
//! let (batch, img_len, txt_len) = (1, 6, 3);
//! let normal = Distribution::Normal(0.0, 1.0);
//! let input = FluxInput {
//!     img: Tensor::random([batch, img_len, 16], normal, &device),
//!     txt: Tensor::random([batch, txt_len, 12], normal, &device),
//!     y: Tensor::random([batch, 8], normal, &device),
//!     timesteps: Tensor::from_floats([0.7], &device),
//!     guidance: Some(Tensor::from_floats([3.5], &device)),
//!     img_ids: TensorData::new(vec![0f32; img_len * 3], [img_len, 3]),
//!     txt_ids: TensorData::new(vec![0f32; txt_len * 3], [txt_len, 3]),
//! };
//! let velocity = model.forward(input);
//! assert_eq!(velocity.dims(), [batch, img_len, 16]);
//! ```
#![warn(missing_docs)]

pub mod blocks;
mod checkpointing;
pub mod clip;
mod error;
pub mod flux;
pub mod flux2;
pub mod pipeline;
pub mod sdxl;
pub mod t5;
pub mod text_decoder;
pub mod tokenize;
pub mod vae;
pub mod wan;
mod weights;

pub use checkpointing::{Activations, BlockRunner, BlockTape, Checkpointing, Direct};
pub use error::{KeyReport, LoadError, ShapeMismatch};
pub use weights::{PlaceWeight, materialize, random_placed};
