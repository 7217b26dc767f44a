//! The CLIP text encoder (CLIP-L for FLUX.1's pooled vector; with projection for SDXL's second
//! encoder), loaded from transformers' layout.

mod config;
mod model;

pub use config::{ClipActivation, ClipTextConfig};
pub use model::{
    ClipAttention, ClipEncoder, ClipEncoderLayer, ClipMlp, ClipTextEmbeddings, ClipTextModel,
    ClipTextOutput,
};
