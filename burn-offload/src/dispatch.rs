//! How the fused ops reach the inner backend. Models are generic over `Backend`, which has no op
//! that autodiff forwards to the inner backend for them (Burn 0.21 decomposes attention under
//! `Autodiff`, and has no GELU with the tanh approximation), so each entry point
//! ([`attention`](crate::attention), [`gelu_tanh`](crate::gelu_tanh)) recognizes the
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

/// Whether the environment variable `var` is `1`, `on` or `true`, read once into `cell`; says so
/// in the log when it is.
pub(crate) fn switched_on(var: &str, cell: &OnceLock<bool>, what: &str) -> bool {
    *cell.get_or_init(|| {
        let on = matches!(std::env::var(var).as_deref(), Ok("1" | "on" | "true"));
        if on {
            tracing::info!("{what} through fused kernels where they apply ({var}=1)");
        }
        on
    })
}

/// Fused elementwise ops run so far, in this process.
static ELEMENTWISE_CALLS: AtomicU64 = AtomicU64::new(0);

/// How many GELU, layer-norm and q/k norm-and-rotation calls this process has run through a
/// fused op (every other one ran as separate ops): lets a program check which path it measured.
pub fn fused_elementwise_calls() -> u64 {
    ELEMENTWISE_CALLS.load(Ordering::Relaxed)
}

/// Counts `out` in [`fused_elementwise_calls`] when it is a fused result, and passes it on.
pub(crate) fn count_elementwise<T>(out: Option<T>) -> Option<T> {
    if out.is_some() {
        ELEMENTWISE_CALLS.fetch_add(1, Ordering::Relaxed);
    }
    out
}

/// Whether the fused elementwise kernels may run: `BURN_LORA_FUSED` is `1`, `on` or `true`.
pub(crate) fn elementwise_on() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    switched_on(
        "BURN_LORA_FUSED",
        &ON,
        "GELU, layer norm, and the q/k norm with the rotary embedding",
    )
}

/// For the backend `$B`, tries the decorated types of each inner backend with fused kernels:
/// `$tracked` runs on `Autodiff<Offload<T>>`, `$untracked` on `Offload<T>` (closures over the
/// inputs seen as that type's tensors); on a match the enclosing function returns their result.
/// `Flex` has no fused kernel and declines; it is listed so that the CPU tests run the dispatch.
macro_rules! dispatch_offload {
    ($B:ty, $inputs:expr, $tracked:expr, $untracked:expr) => {
        $crate::dispatch::dispatch_offload!(@ $B, $inputs, $tracked, $untracked, burn::backend::Flex);
        #[cfg(feature = "cuda")]
        $crate::dispatch::dispatch_offload!(@ $B, $inputs, $tracked, $untracked, burn::backend::Cuda);
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
