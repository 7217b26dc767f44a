//! From a folder of images and captions to FLUX.1's, FLUX.2's and SDXL's training inputs: images
//! fitted to a bucket, captions through FLUX.1's two text encoders, FLUX.2's decoder or SDXL's
//! two CLIPs, FLUX latents packed into tokens with their ids.

mod flux2_inputs;
mod flux2_text;
mod flux_inputs;
mod flux_text;
mod images;
mod sdxl_text;
mod wan_text;

pub use flux_inputs::{image_ids, pack_latents, text_ids, unpack_latents};
pub use flux_text::{encode_clip_pooled, encode_t5};
pub use flux2_inputs::{flux2_image_ids, flux2_text_ids, pack_flux2_latents, unpack_flux2_latents};
pub use flux2_text::{FLUX2_DEV_LAYERS, FLUX2_KLEIN_LAYERS, encode_flux2_text};
pub use images::{BucketFit, fit_image, load_image};
pub use sdxl_text::{encode_sdxl_prompt, sdxl_conditioning};
pub use wan_text::encode_wan_prompt;
