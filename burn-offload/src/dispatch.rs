//! How the fused ops reach the inner backend. Models are generic over `Backend`, which has no op
//! that autodiff forwards to the inner backend for them (Burn 0.21 decomposes attention under
//! `Autodiff`, and has no GELU with the tanh approximation), so each entry point
//! ([`attention`](crate::attention), [`gelu_tanh`](crate::gelu_tanh),
//! [`layer_norm`](crate::layer_norm), [`rms_norm_rope`](crate::rms_norm_rope)) recognizes the
//! decorator's backend types by `TypeId` and runs its op on them, or returns `None` so that the
//! caller computes the same thing from separate ops.

use std::any::Any;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::Ops;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;

use crate::backend::{Offload, OffloadTensor, PrefetchPolicy};
use crate::target::StreamTarget;

/// `value` as a `T` when it is one.
fn exactly<A: 'static, T: 'static>(value: A) -> Option<T> {
    let boxed: Box<dyn Any> = Box::new(value);
    boxed.downcast::<T>().ok().map(|t| *t)
}

/// Runs `f` on `tensors` seen as tensors of `T`, which is `B` (the caller compared the
/// `TypeId`s).
pub(crate) fn on<B: Backend, T: Backend, const N: usize, const D: usize>(
    tensors: [&Tensor<B, D>; N],
    f: impl FnOnce([Tensor<T, D>; N]) -> Option<Tensor<T, D>>,
) -> Option<Tensor<B, D>> {
    let same = "the caller compared the TypeIds";
    let out = f(tensors.map(|t| exactly::<_, Tensor<T, D>>(t.clone()).expect(same)))?;
    Some(exactly(out).expect(same))
}

/// The backward step of a fused op with one input: the output's gradient from `grads`, turned
/// by `gradient` (given the op's saved state) into the input's, registered when the input
/// needs one.
pub(crate) fn one_input_backward<T: StreamTarget, P: PrefetchPolicy, S>(
    ops: Ops<S, 1>,
    grads: &mut Gradients,
    gradient: impl FnOnce(&S, FloatTensor<T>) -> FloatTensor<T>,
) {
    let grad = grads.consume::<Offload<T, P>>(&ops.node).into_inner();
    let [parent] = ops.parents;
    if let Some(node) = parent {
        let input = OffloadTensor::from_inner(gradient(&ops.state, grad));
        grads.register::<Offload<T, P>>(node.id, input);
    }
}

/// A switch read once from an environment variable: on unless it is `0`, `off` or `false`.
pub(crate) struct Switch {
    var: &'static str,
    /// What the switch sends through fused kernels, for the log.
    what: &'static str,
    on: OnceLock<bool>,
}

impl Switch {
    const fn new(var: &'static str, what: &'static str) -> Self {
        Self {
            var,
            what,
            on: OnceLock::new(),
        }
    }

    /// Whether the switch is on; says which way in the log the first time.
    pub(crate) fn on(&self) -> bool {
        *self.on.get_or_init(|| {
            let off = matches!(
                std::env::var(self.var).as_deref(),
                Ok("0" | "off" | "false")
            );
            if off {
                tracing::info!("{}: separate ops ({}=0)", self.what, self.var);
            } else {
                tracing::info!(
                    "{}: fused kernels where they apply ({}=0 turns them off)",
                    self.what,
                    self.var
                );
            }
            !off
        })
    }
}

/// The fused attention's switch.
pub(crate) static FLASH: Switch = Switch::new("BURN_LORA_FLASH", "attention");
/// The fused elementwise kernels' switch.
pub(crate) static FUSED: Switch = Switch::new(
    "BURN_LORA_FUSED",
    "GELU, layer norm, and the q/k norm with the rotary embedding",
);

/// Fused results handed out so far, in this process.
pub(crate) struct Calls(AtomicU64);

impl Calls {
    /// Counts `out` when it is a fused result, and passes it on.
    pub(crate) fn count<T>(&self, out: Option<T>) -> Option<T> {
        if out.is_some() {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Attention calls the fused kernels computed.
pub(crate) static ATTENTION_CALLS: Calls = Calls(AtomicU64::new(0));
/// GELU, layer-norm and q/k norm-and-rotation calls the fused ops computed.
pub(crate) static ELEMENTWISE_CALLS: Calls = Calls(AtomicU64::new(0));

/// How many attention forward passes this process has run through a fused kernel (every
/// other one ran as separate ops): lets a program check which path it measured.
pub fn fused_attention_calls() -> u64 {
    ATTENTION_CALLS.get()
}

/// How many GELU, layer-norm and q/k norm-and-rotation calls this process has run through a
/// fused op (every other one ran as separate ops): lets a program check which path it measured.
pub fn fused_elementwise_calls() -> u64 {
    ELEMENTWISE_CALLS.get()
}

/// For the backend `$B`, tries the decorated types of each inner backend with fused kernels:
/// `$tracked` runs on `Autodiff<Offload<T>>`, `$untracked` on `Offload<T>` (closures over the
/// inputs seen as that type's tensors). The expression's value is their result on a match,
/// `None` otherwise.
/// `Flex` is listed so that the CPU tests run the dispatch (it has the elementwise ops as CPU
/// kernels, and declines attention).
macro_rules! dispatch_offload {
    ($B:ty, $inputs:expr, $tracked:expr, $untracked:expr) => {
        (|| {
            $crate::dispatch::dispatch_offload!(@ $B, $inputs, $tracked, $untracked, burn::backend::Flex);
            #[cfg(feature = "cuda")]
            $crate::dispatch::dispatch_offload!(@ $B, $inputs, $tracked, $untracked, burn::backend::Cuda);
            None
        })()
    };
    (@ $B:ty, $inputs:expr, $tracked:expr, $untracked:expr, $inner:ty) => {
        if std::any::TypeId::of::<$B>()
            == std::any::TypeId::of::<burn::backend::Autodiff<$crate::Offload<$inner>>>()
        {
            return $crate::dispatch::on::<$B, burn::backend::Autodiff<$crate::Offload<$inner>>, _, _>(
                $inputs, $tracked,
            );
        }
        if std::any::TypeId::of::<$B>() == std::any::TypeId::of::<$crate::Offload<$inner>>() {
            return $crate::dispatch::on::<$B, $crate::Offload<$inner>, _, _>($inputs, $untracked);
        }
    };
}
pub(crate) use dispatch_offload;
