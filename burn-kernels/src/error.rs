//! What can go wrong on a fast path. Each failure falls back to the separate ops for that call
//! and is logged ([`fell_back`]); none switches a path off for later calls.

use std::collections::HashSet;
use std::sync::Mutex;

use crate::counters;

/// Why a fast path could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// A CUDA driver, cuBLAS or NVRTC call failed.
    #[error("{action}: {reason}")]
    Device {
        /// What was being done.
        action: &'static str,
        /// The library's message.
        reason: String,
    },
    /// A library the path needs (libcublas, libnvrtc) could not be loaded.
    #[error("{0} could not be loaded")]
    Library(&'static str),
    /// The device lacks what the kernel needs.
    #[error("{0}")]
    Unsupported(String),
}

impl KernelError {
    /// A closure turning a library error into [`KernelError::Device`] for `action`.
    pub fn device<E: std::fmt::Display>(action: &'static str) -> impl Fn(E) -> Self {
        move |e| Self::Device {
            action,
            reason: e.to_string(),
        }
    }
}

/// Logs that `path` fell back to the separate ops for one call because of `error`, and counts
/// it: each distinct message is logged once as a warning, repeats at debug level.
pub fn fell_back(path: &str, error: &KernelError) {
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    counters::count_fallback();
    let message = format!("{path}: {error}; this call runs the separate ops");
    let first = SEEN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(message.clone());
    if first {
        tracing::warn!("{message}");
    } else {
        tracing::debug!("{message}");
    }
}
