//! The ops diffusion training needs faster than Burn 0.21 gives them, each with a portable
//! fallback: attention as one kernel each way, GELU (tanh), layer norm, and the queries' and
//! keys' RMS norm with the rotary embedding as one kernel each way, and matrix products through
//! the vendor BLAS.
//!
//! Model code puts [`Kernels`] on its backend and calls [`attention`], [`gelu_tanh`],
//! [`layer_norm`], [`rms_norm`] and [`rms_norm_rope`]; each returns `None` where the backend, the operands or
//! the options leave the op to separate ops, which the caller then writes out. The bound is
//! Burn's custom-kernel pattern: a backend that computes implements [`FusedOps`] (Burn's
//! `Flex`, CUDA and wgpu backends here; decorators such as burn-offload's `Offload` forward to
//! the backend they decorate), and `Autodiff<B, C>` of any such `B`, under any checkpoint
//! strategy, records each fused forward as one op with the fused backward. Layers call
//! [`linear`], which sends the product to the vendor BLAS on every such backend, resident or
//! not, and LoRA layers [`lora_linear`], whose products go there together; a decorator routes
//! its own matrix products with [`products`].
//!
//! Which paths run is a value, [`KernelOptions`], installed per thread by the caller
//! ([`KernelOptions::install`]); [`counters`] says what ran. A fast path that fails falls back
//! to separate ops for that call and says why in the log.
//!
//! | backend | attention | elementwise | products |
//! |---|---|---|---|
//! | `Flex` | separate ops | CPU loops (`flex.rs`) | Flex's |
//! | CUDA (`cuda` feature) | NVRTC kernels, bf16, heads of 64 or 128 | CubeCL kernels | cuBLAS |
//! | wgpu (`wgpu` feature) | separate ops | CubeCL kernels | Burn's |
//!
//! # Example
//! ```
//! use burn::backend::{Autodiff, Flex};
//! use burn::tensor::{Distribution, Tensor};
//! use burn_kernels::{KernelOptions, counters, gelu_tanh};
//!
//! type B = Autodiff<Flex>;
//! let x = Tensor::<B, 2>::random([4, 8], Distribution::Default, &Default::default())
//!     .require_grad();
//! let before = counters();
//! let y = gelu_tanh(&x).expect("Flex has a fused GELU");
//! let grads = y.sum().backward();
//! assert!(x.grad(&grads).is_some());
//! assert_eq!(counters().since(before).fused_elementwise, 1);
//!
//! let _separate = KernelOptions::separate_ops().install();
//! assert!(gelu_tanh(&x).is_none(), "switched off: the caller writes the separate ops");
//! ```
#![warn(missing_docs)]

mod autodiff;
#[cfg(any(feature = "cuda", test))]
mod conv;
mod counters;
#[cfg(feature = "cube")]
mod cube;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod flex;
mod fused;
#[cfg(any(feature = "cuda", test))]
mod gemm;
mod kernels;
mod options;
pub mod products;
#[cfg(feature = "wgpu")]
mod wgpu;

pub use counters::{KernelCounters, counters};
pub use error::{KernelError, fell_back};
pub use fused::{ConvGrad, FusedOps, LoraProducts, NoKernel, NormRope, UnaryOp};
pub use kernels::{
    Kernels, attention, gelu_tanh, layer_norm, linear, linear_add, lora_linear, rms_norm,
    rms_norm_rope, trainable,
};
pub use options::{AttentionRoute, BlasRoute, Installed, KernelOptions, StreamOrder, UnknownName};
