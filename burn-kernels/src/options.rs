//! Which fast paths run: [`KernelOptions`], a value the caller sets (the trainer from its
//! configuration) and installs for the ops of one thread.

use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

/// Which fast paths the ops take. The default takes every one that applies.
///
/// The entry points ([`attention`](crate::attention), [`gelu_tanh`](crate::gelu_tanh),
/// [`layer_norm`](crate::layer_norm), [`rms_norm_rope`](crate::rms_norm_rope) and the product
/// routing of a decorator such as burn-offload's) read the options installed on the calling
/// thread ([`KernelOptions::install`]); backward passes run on the thread that calls
/// `backward`, so one installation covers a whole training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOptions {
    /// Which matrix products go to the vendor BLAS.
    pub blas: BlasRoute,
    /// How attention without a bias runs.
    pub attention: AttentionRoute,
    /// Whether GELU (tanh), layer norm, and RMS norm with the rotary embedding run as one fused
    /// kernel each way.
    pub fused_elementwise: bool,
    /// How work on CUDA streams outside CubeCL's keeps its place in CubeCL's stream.
    pub order: StreamOrder,
}

/// Which matrix products go to the vendor BLAS (cuBLAS on CUDA; other backends have none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlasRoute {
    /// None: Burn's kernels run every product.
    Off,
    /// Every product whose layout allows it while products are ordered on the device, only
    /// those large enough to pay for host waits while the host orders them.
    #[default]
    Auto,
    /// Only those large enough to pay for host waits, whatever the order.
    Large,
    /// Every product whose layout allows it, whatever the order.
    All,
}

/// How attention without a bias runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionRoute {
    /// Fused, each way: cuDNN's flash-attention engine where it has one for the shape (CUDA),
    /// this crate's kernels otherwise.
    #[default]
    Fused,
    /// Fused, each way, by this crate's kernels only.
    Kernels,
    /// Burn's separate ops: two products and a softmax.
    Separate,
}

/// How work queued on a CUDA stream of the kernels' own is ordered with CubeCL's stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamOrder {
    /// Flags in device memory raised and awaited by one-unit kernels: the host never waits.
    #[default]
    Device,
    /// The host drains CubeCL's stream before the work and waits for the work after it.
    Host,
}

thread_local! {
    static INSTALLED: Cell<Option<KernelOptions>> = const { Cell::new(None) };
}

impl KernelOptions {
    /// Every fast path that applies: products through the vendor BLAS where worth it, fused
    /// attention and elementwise kernels, device-side ordering.
    pub const fn fast() -> Self {
        Self {
            blas: BlasRoute::Auto,
            attention: AttentionRoute::Fused,
            fused_elementwise: true,
            order: StreamOrder::Device,
        }
    }

    /// No fast path: every op as Burn's separate ops compute it.
    pub const fn separate_ops() -> Self {
        Self {
            blas: BlasRoute::Off,
            attention: AttentionRoute::Separate,
            fused_elementwise: false,
            order: StreamOrder::Host,
        }
    }

    /// Makes these the options of the ops this thread runs until the returned guard drops
    /// (then the previous ones are back).
    pub fn install(self) -> Installed {
        let previous = INSTALLED.with(|cell| cell.replace(Some(self)));
        Installed { previous }
    }

    /// The options installed on this thread, else [`KernelOptions::fast`].
    pub fn current() -> Self {
        INSTALLED.with(Cell::get).unwrap_or_default()
    }
}

/// Keeps a [`KernelOptions::install`]ation in force; restores the previous options on drop.
#[must_use = "the options are in force only while this guard lives"]
#[derive(Debug)]
pub struct Installed {
    previous: Option<KernelOptions>,
}

impl Drop for Installed {
    fn drop(&mut self) {
        INSTALLED.with(|cell| cell.set(self.previous));
    }
}

impl Default for KernelOptions {
    fn default() -> Self {
        Self::fast()
    }
}

/// `blas=auto attention=fused elementwise=fused order=device`: what a run's metadata and
/// resume fingerprint record.
impl fmt::Display for KernelOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fused = |on| if on { "fused" } else { "separate" };
        write!(
            f,
            "blas={} attention={} elementwise={} order={}",
            self.blas,
            self.attention,
            fused(self.fused_elementwise),
            self.order
        )
    }
}

/// A value that names no variant; the message lists the accepted names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{value}` is not one of {accepted}")]
pub struct UnknownName {
    /// What was given.
    pub value: String,
    /// The accepted names.
    pub accepted: &'static str,
}

impl BlasRoute {
    /// The accepted spellings.
    pub const NAMES: &'static str = "off, auto, large, all";
}

impl fmt::Display for BlasRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Auto => "auto",
            Self::Large => "large",
            Self::All => "all",
        })
    }
}

impl FromStr for BlasRoute {
    type Err = UnknownName;

    fn from_str(value: &str) -> Result<Self, UnknownName> {
        match value {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            "large" => Ok(Self::Large),
            "all" => Ok(Self::All),
            _ => Err(UnknownName {
                value: value.into(),
                accepted: Self::NAMES,
            }),
        }
    }
}

impl AttentionRoute {
    /// The accepted spellings.
    pub const NAMES: &'static str = "fused, kernels, separate";
}

impl fmt::Display for AttentionRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fused => "fused",
            Self::Kernels => "kernels",
            Self::Separate => "separate",
        })
    }
}

impl FromStr for AttentionRoute {
    type Err = UnknownName;

    fn from_str(value: &str) -> Result<Self, UnknownName> {
        match value {
            "fused" => Ok(Self::Fused),
            "kernels" => Ok(Self::Kernels),
            "separate" => Ok(Self::Separate),
            _ => Err(UnknownName {
                value: value.into(),
                accepted: Self::NAMES,
            }),
        }
    }
}

impl StreamOrder {
    /// The accepted spellings.
    pub const NAMES: &'static str = "device, host";
}

impl fmt::Display for StreamOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Device => "device",
            Self::Host => "host",
        })
    }
}

impl FromStr for StreamOrder {
    type Err = UnknownName;

    fn from_str(value: &str) -> Result<Self, UnknownName> {
        match value {
            "device" => Ok(Self::Device),
            "host" => Ok(Self::Host),
            _ => Err(UnknownName {
                value: value.into(),
                accepted: Self::NAMES,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installations_nest_and_restore() {
        assert_eq!(KernelOptions::current(), KernelOptions::fast());
        {
            let _outer = KernelOptions::separate_ops().install();
            assert_eq!(KernelOptions::current(), KernelOptions::separate_ops());
            {
                let inner = KernelOptions {
                    blas: BlasRoute::All,
                    ..KernelOptions::fast()
                };
                let _inner = inner.install();
                assert_eq!(KernelOptions::current(), inner);
            }
            assert_eq!(KernelOptions::current(), KernelOptions::separate_ops());
        }
        assert_eq!(KernelOptions::current(), KernelOptions::fast());
    }

    #[test]
    fn names_round_trip_and_unknown_ones_list_the_choices() {
        for route in [
            BlasRoute::Off,
            BlasRoute::Auto,
            BlasRoute::Large,
            BlasRoute::All,
        ] {
            assert_eq!(route.to_string().parse::<BlasRoute>(), Ok(route));
        }
        for route in [
            AttentionRoute::Fused,
            AttentionRoute::Kernels,
            AttentionRoute::Separate,
        ] {
            assert_eq!(route.to_string().parse::<AttentionRoute>(), Ok(route));
        }
        for order in [StreamOrder::Device, StreamOrder::Host] {
            assert_eq!(order.to_string().parse::<StreamOrder>(), Ok(order));
        }
        let error = "fast".parse::<BlasRoute>().unwrap_err();
        assert_eq!(
            error.to_string(),
            "`fast` is not one of off, auto, large, all"
        );
        assert_eq!(
            KernelOptions::fast().to_string(),
            "blas=auto attention=fused elementwise=fused order=device"
        );
        assert_eq!(
            KernelOptions::separate_ops().to_string(),
            "blas=off attention=separate elementwise=separate order=host"
        );
    }
}
