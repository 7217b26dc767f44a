//! Errors of this crate. Each names the file, key or value at fault.

use std::io;
use std::path::PathBuf;

/// What went wrong while quantizing, reading or writing.
#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    /// An FP8 format name that is neither `e5m2` nor `e4m3`.
    #[error("unknown FP8 format `{0}` (expected e5m2 or e4m3)")]
    UnknownFormat(String),
    /// A scale granularity name that is not one of the four.
    #[error("unknown scale granularity `{0}` (expected none, tensor, row or block64)")]
    UnknownGranularity(String),
    /// A file could not be read, written or renamed.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A file is not valid safetensors (or not a valid shard index).
    #[error("{file}: not a valid safetensors file: {reason}")]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor selected for quantization does not hold floating-point values.
    #[error("{file}: `{key}` is {dtype:?}, not a floating-point tensor that can be quantized")]
    NotFloat {
        /// The file holding the tensor.
        file: PathBuf,
        /// The tensor's key.
        key: String,
        /// Its dtype.
        dtype: safetensors::Dtype,
    },
    /// Two shards of a checkpoint hold the same key, or the output would.
    #[error("{file}: key `{key}` appears twice")]
    DuplicateKey {
        /// The file where the second copy was found.
        file: PathBuf,
        /// The key.
        key: String,
    },
    /// The FP8 payload, scales or shape given to a dequantization do not agree.
    #[error("FP8 tensor of shape {shape:?}: {reason}")]
    Mismatch {
        /// The tensor's shape.
        shape: Vec<usize>,
        /// What disagrees.
        reason: String,
    },
}

impl QuantError {
    pub(crate) fn io(file: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> QuantError {
        let file = file.into();
        move |source| QuantError::Io { file, source }
    }

    pub(crate) fn corrupt(file: impl Into<PathBuf>, reason: impl ToString) -> QuantError {
        QuantError::Corrupt {
            file: file.into(),
            reason: reason.to_string(),
        }
    }
}
