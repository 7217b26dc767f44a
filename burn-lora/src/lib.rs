//! LoRA, LoCon and LoKr adapters for Burn layers, trained while the base stays frozen, with
//! the safetensors formats other tools load (kohya / LyCORIS, PEFT / diffusers, ai-toolkit).
//! Works on any Burn backend.
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
//!
//! # How a model opts in
//!
//! Burn's module mapping can change parameters but not a field's type, so a model declares the
//! layers that may carry an adapter: [`LoraLinear`] where it had `nn::Linear`, [`LoraConv2d`]
//! where it had `nn::Conv2d`, built with `.into()` from the plain layer. That is the whole
//! change:
//!
//! - Without an adapter the layer computes what the plain layer computes, through the same
//!   `burn::tensor::module::linear` / `conv2d` call on the same `nn::Linear` / `nn::Conv2d`
//!   (so backend decorators that intercept those ops keep seeing the base weight).
//! - The base parameters keep their paths and container type (`blocks.0.qkv.weight` inside
//!   `Struct:Linear`), so checkpoint loaders and key tables written for the plain model work
//!   unchanged. Adapter parameters appear under `<layer>.lora.{down,up}` or
//!   `<layer>.lokr.{w1,w2,w2_a,w2_b}`.
//! - The base is frozen when wrapped (lazily initialised weights stay lazy) and stays frozen
//!   through `valid()` / `train()`; only adapter weights receive gradients.
//!
//! # Adapters, alpha and scale
//!
//! [`LoraConfig`]: `ΔW = scale · up · down`, `down` (`A`) Kaiming-uniform as PEFT, `up` (`B`)
//! zero, `scale = alpha / rank` (`alpha` defaults to `rank`; `alpha / sqrt(rank)` with
//! `rslora`). A rank-1024, alpha-64 adapter has scale 0.0625 in the forward, in the saved
//! file and after loading. [`LokrConfig`]: `ΔW = w1 ⊗ w2` with the most balanced factor pair
//! (or a configured factor), full second factor (scale 1) or `w2 = w2_a · w2_b` (scale
//! `alpha / rank`). Adapters are created in the base weight's dtype (bf16 under a bf16 base)
//! unless a dtype is configured; dropout applies to the adapter input when autodiff is on;
//! [`Adapted::with_multiplier`] / [`set_multiplier`] scale the update at inference, and
//! [`merge`] / [`unmerge`] add it to / remove it from the base weights.
//!
//! # Whole-model operations
//!
//! [`LoraPlan::apply`] (include / exclude patterns, per-pattern rank and alpha),
//! [`adapted_layers`], [`merge`], [`unmerge`], [`set_multiplier`], [`export`] and
//! [`load_adapters`] walk the model with Burn's `Module::map` / `visit`; each
//! [`Adapted`] layer hands itself and its path to the running operation. Operations run on the
//! calling thread and do not nest.
//!
//! # Files
//!
//! | style | keys | alpha |
//! | --- | --- | --- |
//! | kohya | `lora_unet_<path_with_underscores>.lora_down.weight`, `.lora_up.weight` | `.alpha` f32 scalar |
//! | PEFT / diffusers | `transformer.<path>.lora_A.weight`, `.lora_B.weight` | `lora_adapter_metadata`, or baked into `lora_B` |
//! | ai-toolkit | `diffusion_model.<path>.lora_A.weight`, `.lora_B.weight` | `.alpha` f32 scalar |
//! | LoKr (any naming) | `.lokr_w1`, `.lokr_w2` or `.lokr_w2_a` + `.lokr_w2_b` | `.alpha` f32 scalar |
//!
//! [`save`] writes atomically and records rank, alpha, network type, base model and step in
//! the metadata; [`load`] detects the style (PEFT alphas also come from an
//! `adapter_config.json` next to the file); [`convert`] rewrites a file in another style.
//! Layout follows PyTorch: `down` is `[rank, in]` (`[rank, in, kh, kw]` for a convolution),
//! `up` is `[out, rank]` (`[out, rank, 1, 1]`).
//!
//! # Names for other tools
//!
//! Other tools find a LoRA's layers by the names of a checkpoint layout they know: kohya and
//! ai-toolkit files use the original checkpoint's module paths (BFL's `img_mlp.0`), PEFT
//! files diffusers' (`ff.net.0.proj`). A model crate describes both once with a
//! [`LayoutNames`] of two [`NameMap`]s, built from the table that names its checkpoint
//! tensors: renames, and splits of fused layers such as BFL's `img_attn.qkv` into diffusers'
//! `attn.to_q`, `to_k`, `to_v`. [`LayoutNames::save`] writes a model's adapters under the
//! format's names (a module without one is an error, never an unloadable key) and
//! [`LayoutNames::load`] reads any layout back into the model's paths. A model that trains more
//! than its denoiser (SDXL's text encoders) names those parts as [`ComponentNames`], which the
//! same file keeps under their own prefixes (`lora_te1_`, `text_encoder.`).
//!
//! ```
//! use burn_lora::{NameMap, RowSlice};
//!
//! let hidden = 3072;
//! let diffusers = (0..19).fold(NameMap::new(), |map, i| {
//!     let attn = format!("transformer_blocks.{i}.attn");
//!     let slices = ["to_q", "to_k", "to_v"]
//!         .iter()
//!         .enumerate()
//!         .map(|(j, p)| RowSlice {
//!             target: format!("{attn}.{p}"),
//!             len: hidden,
//!             rows: 0..hidden,
//!             to: j * hidden,
//!         })
//!         .collect();
//!     map.split(format!("double_blocks.{i}.img_attn.qkv"), slices)
//!         .rename(format!("double_blocks.{i}.img_attn.proj"), format!("{attn}.to_out.0"))
//! });
//! assert!(diffusers.target_names().contains("transformer_blocks.3.attn.to_k"));
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
    ComponentNames, ConvertReport, Format, LayoutNames, PeftAlpha, SaveOptions, convert, load, save,
};
pub use keymap::{NameMap, RowSlice};
pub use layer::{Adapted, BaseLayer, LoraConv2d, LoraLinear};
pub use model::{
    LayerInfo, LoadReport, adapted_layers, export, load_adapters, merge, set_multiplier, unmerge,
};
pub use plan::{ApplyReport, LoraPlan, WrappedLayer};
pub use set::{AdapterSet, LokrFactor, LoraMetadata, Role, StoredAdapter, flatten_name};
