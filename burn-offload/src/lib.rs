//! `Offload<B>`: a Burn backend decorator that trains models larger than the GPU by streaming
//! their frozen weights from host memory, just before each linear op, through a ring of device
//! buffers filled ahead of the compute by a loader thread.
//!
//! Model code stays plain Burn (`nn::Linear`); the backend type chooses offloading:
//! `Autodiff<Offload<Cuda>>` in production, `Autodiff<Offload<Flex>>` on the CPU. A
//! [`WeightStream`] turns the frozen parameters of any module into streamed weights (cheap
//! handles to host memory, so autodiff keeps no device memory for them until backward), plans
//! which of them stay resident within a VRAM budget (beside the headroom a caller measured for
//! everything else: [`MemoryMeasurement`], [`StepStats::peak_beyond_weights`]), and brackets
//! training steps: the first
//! step records the order in which the forward, the checkpoint recompute and the backward use
//! the weights, later steps replay it so the next weights cross the bus while the current ones
//! compute; a weight used again within a few uses (a checkpointed block's recompute, then its
//! backward) stays on the device in between. Each step reports its traffic, waits and memory
//! in [`StepStats`].
//!
//! A [`GradientSink`] takes the gradients of trainable parameters (read through
//! `burn_kernels::trainable`) to host memory as the backward produces them, and sums them there,
//! so that the device never holds them all.
//!
//! The crate is split into policy and mechanism: `policy` decides (schedule, residency plan,
//! retention)
//! and has no device code; `engine` executes with slots, fences and the loader thread;
//! `target` and `cuda` hold what differs per inner backend. See `DESIGN.md` next to this crate
//! for the CUDA upload path and what was measured.
//!
//! # Features
//! - `cuda`: Burn's CUDA backend (without fusion) as an inner backend: page-locked host
//!   memory, asynchronous copies on the device's copy stream (burn-kernels' `SideContext`) into
//!   slots that Burn owns, FP8 payloads dequantized on the device by burn-quant's kernel.
//!
//! - `wgpu`: Burn's wgpu backend (without fusion) as an inner backend: weights decoded on the
//!   host and uploaded through Burn's own path into ring slots.
//!
//! The matrix products (`float_matmul` and the linear ops, streamed weights included) go
//! through burn-kernels' [`products`](burn_kernels::products) routing, and `Offload<B, P>` is a
//! [`FusedOps`](burn_kernels::FusedOps) backend whenever `B` is: models on it get the inner
//! backend's fused kernels.
//!
//! # Example
//! ```
//! use burn::backend::{Autodiff, Flex};
//! use burn::module::Module;
//! use burn::nn::LinearConfig;
//! use burn::tensor::{Distribution, Tensor};
//! use burn_offload::{Offload, OffloadConfig, ScheduleOutcome, WeightStream};
//!
//! type B = Autodiff<Offload<Flex>>;
//! let device = Default::default();
//! let config = OffloadConfig::default()
//!     .with_ring_slots(2)
//!     .with_direct_threshold(0);
//! let stream = WeightStream::<B>::new(&device, config)?;
//!
//! // A frozen layer: its weight moves to host memory.
//! let layer = LinearConfig::new(64, 32).init::<B>(&device).no_grad();
//! let layer = stream.stream_frozen(layer)?;
//!
//! let x = Tensor::<B, 2>::random([8, 64], Distribution::Default, &device).require_grad();
//! for step in 0..2 {
//!     stream.begin_step();
//!     let grads = layer.forward(x.clone()).sum().backward();
//!     assert!(x.grad(&grads).is_some());
//!     let stats = stream.end_step();
//!     // The weight is used twice per step: forward and backward. Replayed, it crosses the
//!     // bus once, ahead of the forward, and stays on the device for the backward.
//!     if step == 0 {
//!         assert_eq!(stats.schedule, ScheduleOutcome::Recorded { uses: 2 });
//!     } else {
//!         assert_eq!(stats.schedule, ScheduleOutcome::Replayed { uses: 2 });
//!         assert_eq!((stats.prefetched, stats.kept), (1, 1));
//!     }
//! }
//! # Ok::<(), burn_offload::OffloadError>(())
//! ```
#![warn(missing_docs)]

mod backend;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
mod engine;
mod error;
mod fused;
mod ops;
mod policy;
mod sink;
mod stats;
mod stream;
mod target;
mod weight;
#[cfg(feature = "wgpu")]
mod wgpu;

pub use backend::{Lookahead, Offload, OffloadBackend, OffloadTensor, OnDemand, PrefetchPolicy};
pub use config::{OffloadConfig, WireFormat};
pub use error::OffloadError;
pub use policy::{MemoryMeasurement, Route, ScheduleOutcome};
pub use sink::{GradientSink, GradientSums, HostGradient};
pub use stats::{MemoryPlan, StepStats};
pub use stream::WeightStream;
pub use target::{MemoryProbe, StreamTarget};
