//! The trainer behind `burnlora train`: a YAML configuration, a dataset of captioned images,
//! caches of latents and text embeddings, the training loop, checkpoints with exact resume,
//! and the logs, loss curve and progress bar around it.
//!
//! - [`experts`]: two experts that train one LoRA by turns (Wan 2.2 A14B).
//! - [`family`]: the model-family seam: what a family (FLUX.1 today) provides the trainer.
//! - [`cache`]: the family's image and caption encodings, computed once and cached beside the
//!   images.
//! - [`config`]: the YAML file, environment overrides, and the validated [`config::TrainPlan`].
//! - [`dataset`]: images, video clips (through FFmpeg's programs) and captions, aspect-ratio
//!   buckets, the seeded epoch order.
//! - [`optim`]: AdamW with f32 or block-wise 8-bit moments, clipping, the learning-rate schedule.
//! - [`checkpoint`]: the run folder, atomic checkpoints, the newest valid one for resume.
//! - [`report`]: logs, progress bar, loss CSV and plot, the Ctrl-C flag.
//! - [`rng`]: the seeded random generator whose state is saved with each checkpoint.
//! - [`train`]: the loop that puts them together, on `Autodiff<Offload<B>>` so that the frozen
//!   weights can stream from host memory.
#![warn(missing_docs)]

pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod dataset;
mod error;
pub mod experts;
pub mod family;
mod models;
pub use family::lora_names;
pub mod optim;
mod replicas;
pub mod report;
pub mod rng;
pub mod train;
mod video;
