//! How many calls took each fast path, on the calling thread: lets a program or a test check
//! which path it measured.

use std::cell::Cell;

/// Calls per path on one thread since it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelCounters {
    /// Attention forward passes a fused kernel computed.
    pub fused_attention: u64,
    /// Of those, forward passes cuDNN's fused attention engine computed.
    pub dnn_attention: u64,
    /// GELU, layer-norm and RMS-norm-with-rotation forward passes a fused kernel computed.
    pub fused_elementwise: u64,
    /// Matrix products the vendor BLAS computed (forward and backward).
    pub blas_products: u64,
    /// Of those, products the BLAS accumulated into a tensor they are added to
    /// ([`linear_add`](crate::linear_add)).
    pub blas_accumulated: u64,
    /// Convolutions the vendor DNN library computed.
    pub dnn_convolutions: u64,
    /// Calls whose fast path failed and that ran the separate ops instead.
    pub fallbacks: u64,
}

impl KernelCounters {
    /// The calls counted since `earlier`, a snapshot of the same thread.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            fused_attention: self.fused_attention - earlier.fused_attention,
            dnn_attention: self.dnn_attention - earlier.dnn_attention,
            fused_elementwise: self.fused_elementwise - earlier.fused_elementwise,
            blas_products: self.blas_products - earlier.blas_products,
            blas_accumulated: self.blas_accumulated - earlier.blas_accumulated,
            dnn_convolutions: self.dnn_convolutions - earlier.dnn_convolutions,
            fallbacks: self.fallbacks - earlier.fallbacks,
        }
    }
}

thread_local! {
    static COUNTERS: Cell<KernelCounters> = const {
        Cell::new(KernelCounters {
            fused_attention: 0,
            dnn_attention: 0,
            fused_elementwise: 0,
            blas_products: 0,
            blas_accumulated: 0,
            dnn_convolutions: 0,
            fallbacks: 0,
        })
    };
}

/// This thread's counters.
pub fn counters() -> KernelCounters {
    COUNTERS.with(Cell::get)
}

fn bump(field: impl FnOnce(&mut KernelCounters)) {
    COUNTERS.with(|cell| {
        let mut counters = cell.get();
        field(&mut counters);
        cell.set(counters);
    });
}

pub(crate) fn count_attention() {
    bump(|c| c.fused_attention += 1);
}

#[cfg(feature = "cuda")]
pub(crate) fn count_dnn_attention() {
    bump(|c| c.dnn_attention += 1);
}

pub(crate) fn count_elementwise() {
    bump(|c| c.fused_elementwise += 1);
}

pub(crate) fn count_blas_product() {
    bump(|c| c.blas_products += 1);
}

pub(crate) fn count_blas_accumulated() {
    bump(|c| {
        c.blas_products += 1;
        c.blas_accumulated += 1;
    });
}

/// `products` BLAS products taken in one ordering, one of them accumulated: a LoRA layer's
/// forward (3) or backward (5).
pub(crate) fn count_lora(products: u64) {
    bump(|c| {
        c.blas_products += products;
        c.blas_accumulated += 1;
    });
}

pub(crate) fn count_dnn_convolution() {
    bump(|c| c.dnn_convolutions += 1);
}

pub(crate) fn count_fallback() {
    bump(|c| c.fallbacks += 1);
}
