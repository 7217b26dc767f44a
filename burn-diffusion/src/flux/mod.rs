//! FLUX.1 (dev and schnell): the transformer, its checkpoint layouts, loading, and a
//! file-to-file forward pass for parity checks.

mod config;
mod keys;
mod load;
mod model;
mod run;

pub use config::FluxConfig;
pub use keys::{LinearKeys, linear_keys, lora_names};
pub(crate) use load::read_f32;
pub use load::{FluxCheckpoint, Layout};
pub use model::{
    DoubleStreamBlock, Flux, FluxInput, LastLayer, Mlp, MlpEmbedder, ModulationLinear, QkNorm,
    RmsNorm, SelfAttention, SingleStreamBlock,
};
pub use run::forward_file;
