//! From a folder of images and captions to FLUX.1's training inputs: images fitted to a
//! bucket, captions through both text encoders, latents packed into tokens with their ids.

mod flux_inputs;
mod flux_text;
mod images;

pub use flux_inputs::{image_ids, pack_latents, text_ids, unpack_latents};
pub use flux_text::{encode_clip_pooled, encode_t5};
pub use images::load_image;
