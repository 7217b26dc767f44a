//! The T5 v1.1 encoder (T5-XXL for FLUX.1's text sequence), loaded from transformers' layout
//! or a single file.

mod config;
mod model;

pub use config::T5Config;
pub use model::{T5Block, T5Encoder, T5FeedForward, T5LayerNorm, T5SelfAttention};
