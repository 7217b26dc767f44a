//! Math shared by the diffusion transformers: attention, rotary positions, adaptive modulation,
//! normalization, activations and timestep embeddings.
//!
//! Functions here take and return plain tensors; each model keeps its own parameter layout and
//! checkpoint keys.

mod attention;
mod mlp;
mod modulation;
mod norm;
mod rope;
mod timestep;

pub use attention::{ScoreBias, attention, sdpa};
pub use mlp::gelu_tanh;
pub use modulation::Modulation;
pub use norm::{layer_norm, rms_norm};
pub use rope::Rope;
pub use timestep::timestep_embedding;
