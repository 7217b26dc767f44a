//! FLUX.1 (dev and schnell): the transformer, its checkpoint layouts, loading, and a
//! file-to-file forward pass for parity checks.

mod config;
mod keys;
mod load;
mod model;
mod run;

pub use config::FluxConfig;
pub(crate) use config::{BflBlocks, check_heads, read_diffusers_json};
pub use keys::{LinearKeys, VectorKeys, linear_keys, lora_names};
pub(crate) use keys::{double_block_keys, final_layer_keys, layout_names, norm_keys, whole};
pub(crate) use load::read_f32;
pub use load::{FluxCheckpoint, Layout, TransformerCheckpoint, TransformerConfig};
pub use model::{
    DoubleStreamBlock, Flux, FluxInput, LastLayer, Mlp, MlpActivation, MlpEmbedder,
    ModulationLinear, QkNorm, RmsNorm, SelfAttention, SingleStreamBlock,
};
pub(crate) use model::{
    Parallel, Stream, TIME_DIM, double_stream, linear, rope, time_guidance, two,
};
pub use run::forward_file;
pub(crate) use run::{InputFile, write_output};
