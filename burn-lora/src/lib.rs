//! LoRA, LoCon and LoKr adapters for Burn layers, trained while the base stays frozen, with
//! the safetensors formats other tools load (kohya / LyCORIS, PEFT / diffusers).
//!
//! A model opts in by using [`LoraLinear`] where it used `nn::Linear` and [`LoraConv2d`] where
//! it used `nn::Conv2d` (`LinearConfig::new(a, b).init(device).into()`). Such a layer behaves
//! exactly like the plain one until an adapter is attached, and its base parameters keep their
//! paths (`blocks.0.qkv.weight`, inside `Struct:Linear`), so checkpoints and loaders written
//! for the plain model keep working. The base is frozen; only adapter weights train.
//!
//! A [`LoraPlan`] attaches adapters to a whole model by module path, through Burn's module
//! mapping, and reports what it wrapped. Afterwards, [`export`] copies the adapters to an
//! [`AdapterSet`], [`save`] / [`load`] write and read files, [`load_adapters`] puts a set back
//! into a model, [`merge`] bakes the adapters into the base weights, and [`NameMap`] renames
//! (and fuses q/k/v into `qkv`) for the tool a file is meant for.
//!
//! ```
//! use burn::backend::Flex;
//! use burn::module::Module;
//! use burn::nn::LinearConfig;
//! use burn::tensor::{Distribution, Tensor};
//! use burn_lora::{LoraConfig, LoraLinear, LoraPlan, SaveOptions};
//!
//! #[derive(Module, Debug)]
//! struct Block<B: burn::tensor::backend::Backend> {
//!     qkv: LoraLinear<B>,
//!     proj: LoraLinear<B>,
//! }
//!
//! let device = Default::default();
//! let block = Block::<Flex> {
//!     qkv: LinearConfig::new(8, 24).init(&device).into(),
//!     proj: LinearConfig::new(8, 8).init(&device).into(),
//! };
//! let x = Tensor::<Flex, 2>::random([2, 8], Distribution::Default, &device);
//! let before = block.qkv.forward(x.clone());
//!
//! // Rank 4, alpha 2 on the attention input only: scale 0.5.
//! let plan = LoraPlan::new(LoraConfig::new(4).with_alpha(Some(2.0)))?.include("qkv")?;
//! let (block, report) = plan.apply(block);
//! assert_eq!(report.count(), 1);
//! assert_eq!(report.params(), 4 * 8 + 24 * 4);
//! assert_eq!(block.qkv.adapter().unwrap().scale(), 0.5);
//!
//! // A fresh adapter does not change the output (its up matrix is zero).
//! block.qkv.forward(x).into_data().assert_eq(&before.into_data(), true);
//!
//! // ... train, then write a kohya file (`lora_unet_qkv.lora_down.weight`, ...).
//! let set = burn_lora::export(&block, Default::default());
//! let dir = tempfile::tempdir().unwrap();
//! burn_lora::save(&set, &dir.path().join("lora.safetensors"), &SaveOptions::kohya())?;
//! # Ok::<(), burn_lora::LoraError>(())
//! ```
#![warn(missing_docs)]

mod adapter;
mod config;
mod error;
mod format;
mod keymap;
mod layer;
mod model;
mod plan;
mod session;
mod set;

pub use adapter::{Adapter, AdapterKind, Geometry, LokrWeights, LoraWeights};
pub use config::{AdapterConfig, LokrConfig, LoraConfig, factorize};
pub use error::LoraError;
pub use format::{
    ConvertReport, Format, META_ALPHA, META_BASE_MODEL, META_MODULES, META_NETWORK_ARGS,
    META_NETWORK_MODULE, META_PEFT_CONFIG, META_RANK, META_STEP, PeftAlpha, SaveOptions, convert,
    load, save,
};
pub use keymap::NameMap;
pub use layer::{Adapted, BaseLayer, LoraConv2d, LoraLinear};
pub use model::{
    LayerInfo, LoadReport, adapted_layers, export, load_adapters, merge, set_multiplier, unmerge,
};
pub use plan::{ApplyReport, LoraPlan, WrappedLayer};
pub use set::{AdapterSet, LokrFactor, LoraMetadata, Role, StoredAdapter, flatten_name};
