//! Errors of the offload engine.

use burn::tensor::DType;

/// What can go wrong when configuring the engine or turning parameters into streamed weights.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// The ring needs at least two slots: one read by the compute while the next is filled.
    #[error("ring_slots is {found}, the ring needs at least 2 slots")]
    RingTooSmall {
        /// The configured number of slots.
        found: usize,
    },
    /// A rate of the planner's cost model is not a positive finite number.
    #[error("{name} is {found}, expected a positive finite number")]
    InvalidRate {
        /// The configuration field.
        name: &'static str,
        /// The value found.
        found: f64,
    },
    /// The VRAM budget cannot hold the activation headroom beside the ring that streaming
    /// every weight needs (the least device memory any plan takes for the weights).
    #[error(
        "vram_budget is {budget} bytes, but activation_headroom ({headroom} bytes) and the ring of a plan that streams every weight ({ring} bytes) need {needed}"
    )]
    BudgetTooSmall {
        /// The configured budget.
        budget: u64,
        /// The configured headroom.
        headroom: u64,
        /// Bytes of the ring when every weight streams.
        ring: u64,
        /// The smallest budget that holds both.
        needed: u64,
    },
    /// The wire format cannot encode a parameter of this dtype.
    #[error("`{name}` has dtype {dtype:?}: only f32, f16 and bf16 weights can be streamed")]
    UnsupportedDtype {
        /// The parameter's path in the module.
        name: String,
        /// Its dtype.
        dtype: DType,
    },
    /// The bytes given for a weight do not match its shape and dtype.
    #[error("`{name}` has {found} bytes, its shape {shape:?} and dtype {dtype:?} need {expected}")]
    SizeMismatch {
        /// The weight's name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// Its dtype.
        dtype: DType,
        /// The bytes the shape and dtype need.
        expected: usize,
        /// The bytes given.
        found: usize,
    },
    /// The device rank of a streamed tensor differs from the requested rank.
    #[error("`{name}` has shape {shape:?}, not a tensor of rank {rank}")]
    RankMismatch {
        /// The weight's name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// The requested rank.
        rank: usize,
    },
    /// Reading a parameter back from the device failed.
    #[error("reading `{name}` from the device: {reason}")]
    Read {
        /// The parameter's path in the module.
        name: String,
        /// What the backend reported.
        reason: String,
    },
    /// The device refused an allocation or a copy.
    #[error("device error while {action}: {reason}")]
    Device {
        /// What the engine was doing.
        action: &'static str,
        /// What the driver reported.
        reason: String,
    },
}
