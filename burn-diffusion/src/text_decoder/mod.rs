//! The decoder-only language models whose hidden states condition FLUX.2: Mistral Small 3 (dev)
//! and Qwen3 (klein), one implementation loaded from transformers' folders or ComfyUI's single
//! files.

mod config;
mod model;

pub use config::TextDecoderConfig;
pub use model::{DecoderAttention, DecoderLayer, DecoderMlp, DecoderRmsNorm, TextDecoder};
