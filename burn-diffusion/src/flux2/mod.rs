//! FLUX.2 (dev, klein): the transformer, its checkpoint layouts, loading, and a file-to-file
//! forward pass for parity checks.

mod config;
mod keys;
mod load;
mod model;
mod run;

pub use config::Flux2Config;
pub use keys::{linear_keys, lora_names};
pub use load::Flux2Checkpoint;
pub use model::{Flux2, Flux2DoubleBlock, Flux2Input, Flux2SingleBlock};
pub use run::forward_file;
