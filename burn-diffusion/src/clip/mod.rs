//! The CLIP text encoder (CLIP-L for FLUX.1's pooled vector; with projection for SDXL's second
//! encoder), loaded from transformers' layout or from SDXL's original single file.

mod config;
mod keys;
mod model;

pub use config::{ClipActivation, ClipTextConfig};
pub use keys::SgmTextEncoder;
pub use model::{
    ClipAttention, ClipEncoder, ClipEncoderLayer, ClipMlp, ClipTextEmbeddings, ClipTextModel,
    ClipTextOutput,
};
