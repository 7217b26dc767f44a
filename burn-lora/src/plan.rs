//! Which layers of a model get which adapter: include / exclude patterns and per-pattern
//! rank / alpha overrides.

use std::fmt;

use burn::module::Module;
use burn::tensor::backend::Backend;
use regex::Regex;

use crate::LoraError;
use crate::adapter::AdapterKind;
use crate::config::AdapterConfig;
use crate::layer::{Adapted, BaseLayer};
use crate::model;

#[derive(Clone, Debug)]
struct Override {
    pattern: Regex,
    rank: Option<usize>,
    alpha: Option<f64>,
}

/// A recipe for attaching adapters to a whole model by module path.
///
/// Patterns are regular expressions searched anywhere in the module path, so a plain word such
/// as `"attn"` matches like ai-toolkit's `only_if_contains` / `ignore_if_contains`; anchor with
/// `^` / `$` for exact paths. A layer is adapted when it matches an include pattern (or there
/// are none) and no exclude pattern. The first matching override sets its rank and/or alpha.
///
/// ```
/// use burn_lora::{LoraConfig, LoraPlan};
///
/// let plan = LoraPlan::new(LoraConfig::new(16).with_alpha(Some(8.0)))?
///     .include("attn")?
///     .exclude("norm")?
///     .with_override(r"\.qkv$", Some(32), None)?;
/// assert!(plan.config_for("blocks.0.attn.qkv", false).is_some());
/// assert!(plan.config_for("blocks.0.attn.norm.lin", false).is_none());
/// # Ok::<(), burn_lora::LoraError>(())
/// ```
#[derive(Clone, Debug)]
pub struct LoraPlan {
    adapter: AdapterConfig,
    conv: Convs,
    include: Vec<Regex>,
    exclude: Vec<Regex>,
    overrides: Vec<Override>,
}

/// What a plan attaches to convolutions.
#[derive(Clone, Debug)]
enum Convs {
    /// The main adapter config.
    Main,
    /// A config of their own.
    Own(AdapterConfig),
    /// Nothing.
    Skip,
}

fn compile(pattern: &str) -> Result<Regex, LoraError> {
    Regex::new(pattern).map_err(|source| LoraError::Pattern {
        pattern: pattern.to_string(),
        source: Box::new(source),
    })
}

impl LoraPlan {
    /// Adapts every layer with `adapter`.
    pub fn new(adapter: impl Into<AdapterConfig>) -> Result<Self, LoraError> {
        let adapter = adapter.into();
        adapter.validate()?;
        Ok(Self {
            adapter,
            conv: Convs::Main,
            include: Vec::new(),
            exclude: Vec::new(),
            overrides: Vec::new(),
        })
    }

    /// Uses `adapter` for convolutions instead of the main config (kohya's `conv_dim`).
    pub fn with_conv(mut self, adapter: impl Into<AdapterConfig>) -> Result<Self, LoraError> {
        let adapter = adapter.into();
        adapter.validate()?;
        self.conv = Convs::Own(adapter);
        Ok(self)
    }

    /// Leaves every convolution alone (kohya's LoRA without `conv_dim`).
    pub fn without_convs(mut self) -> Self {
        self.conv = Convs::Skip;
        self
    }

    /// Adds an include pattern.
    pub fn include(mut self, pattern: &str) -> Result<Self, LoraError> {
        self.include.push(compile(pattern)?);
        Ok(self)
    }

    /// Adds an exclude pattern.
    pub fn exclude(mut self, pattern: &str) -> Result<Self, LoraError> {
        self.exclude.push(compile(pattern)?);
        Ok(self)
    }

    /// Layers matching `pattern` get this rank and/or alpha.
    pub fn with_override(
        mut self,
        pattern: &str,
        rank: Option<usize>,
        alpha: Option<f64>,
    ) -> Result<Self, LoraError> {
        self.adapter.with_rank_alpha(rank, alpha).validate()?;
        self.overrides.push(Override {
            pattern: compile(pattern)?,
            rank,
            alpha,
        });
        Ok(self)
    }

    /// The adapter config for the layer at `path`, `None` if the plan leaves it alone.
    pub fn config_for(&self, path: &str, is_conv: bool) -> Option<AdapterConfig> {
        let included = self.include.is_empty() || self.include.iter().any(|r| r.is_match(path));
        if !included || self.exclude.iter().any(|r| r.is_match(path)) {
            return None;
        }
        let base = match (&self.conv, is_conv) {
            (Convs::Own(conv), true) => conv,
            (Convs::Skip, true) => return None,
            _ => &self.adapter,
        };
        Some(
            match self.overrides.iter().find(|o| o.pattern.is_match(path)) {
                Some(o) => base.with_rank_alpha(o.rank, o.alpha),
                None => base.clone(),
            },
        )
    }

    /// Attaches adapters to every selected [`Adapted`] layer of `model` (through Burn's module
    /// mapping) and reports what was wrapped. Layers that already have an adapter are skipped.
    pub fn apply<B: Backend, M: Module<B>>(&self, model: M) -> (M, ApplyReport) {
        model::attach(model, self)
    }

    pub(crate) fn attach_one<B: Backend, L: BaseLayer<B>>(
        &self,
        path: &str,
        layer: Adapted<B, L>,
        report: &mut ApplyReport,
    ) -> Adapted<B, L> {
        let is_conv = layer.base().geometry().kernel.is_some();
        let Some(config) = self.config_for(path, is_conv) else {
            return layer;
        };
        if layer.adapter().is_some() {
            report
                .skipped
                .push((path.to_string(), "already has an adapter".to_string()));
            return layer;
        }
        match layer.clone().attach(&config) {
            Ok(layer) => {
                let adapter = layer.adapter().expect("just attached");
                report.wrapped.push(WrappedLayer {
                    path: path.to_string(),
                    kind: adapter.kind(),
                    rank: adapter.rank(),
                    alpha: adapter.alpha(),
                    params: adapter.num_params(),
                });
                layer
            }
            Err(err) => {
                report.skipped.push((path.to_string(), err.to_string()));
                layer
            }
        }
    }
}

/// One layer that received an adapter.
#[derive(Clone, Debug, PartialEq)]
pub struct WrappedLayer {
    /// The module path.
    pub path: String,
    /// The adapter family.
    pub kind: AdapterKind,
    /// The rank (`None` for a full-factor LoKr).
    pub rank: Option<usize>,
    /// The alpha in plain LoRA terms (`scale · rank`).
    pub alpha: f64,
    /// Number of adapter weights.
    pub params: usize,
}

/// What [`LoraPlan::apply`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ApplyReport {
    /// Layers that received an adapter, in traversal order.
    pub wrapped: Vec<WrappedLayer>,
    /// Selected layers left alone, with the reason.
    pub skipped: Vec<(String, String)>,
}

impl ApplyReport {
    /// Number of wrapped layers.
    pub fn count(&self) -> usize {
        self.wrapped.len()
    }

    /// Total number of adapter weights added.
    pub fn params(&self) -> usize {
        self.wrapped.iter().map(|w| w.params).sum()
    }
}

impl fmt::Display for ApplyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "wrapped {} layers, {} adapter parameters",
            self.count(),
            self.params()
        )?;
        for (path, reason) in &self.skipped {
            write!(f, "; skipped {path}: {reason}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn convolutions_take_the_main_config_their_own_or_none() {
        let main = LoraConfig::new(8);
        let plan = LoraPlan::new(main.clone()).unwrap();
        assert_eq!(
            plan.config_for("down.0.conv1", true),
            Some(main.clone().into())
        );
        let own = LoraConfig::new(4);
        let plan = plan.with_conv(own.clone()).unwrap();
        assert_eq!(plan.config_for("down.0.conv1", true), Some(own.into()));
        let plan = plan.without_convs();
        assert_eq!(plan.config_for("down.0.conv1", true), None);
        assert_eq!(plan.config_for("down.0.proj", false), Some(main.into()));
    }
    use crate::config::{LokrConfig, LoraConfig};

    fn rank(config: Option<AdapterConfig>) -> Option<(usize, Option<f64>, bool)> {
        config.map(|c| match c {
            AdapterConfig::Lora(c) => (c.rank, c.alpha, false),
            AdapterConfig::Lokr(c) => (c.rank, c.alpha, true),
        })
    }

    #[test]
    fn include_exclude_overrides_and_conv() {
        let plan = LoraPlan::new(LoraConfig::new(4))
            .unwrap()
            .with_conv(LokrConfig::new(2))
            .unwrap()
            .include("attn")
            .unwrap()
            .include("^conv_in$")
            .unwrap()
            .exclude("norm")
            .unwrap()
            .with_override(r"\.qkv$", Some(16), None)
            .unwrap()
            .with_override("qkv", Some(8), Some(1.0))
            .unwrap();
        assert_eq!(
            rank(plan.config_for("blocks.0.attn.proj", false)),
            Some((4, None, false))
        );
        assert_eq!(
            rank(plan.config_for("blocks.0.attn.qkv", false)),
            Some((16, None, false))
        );
        assert_eq!(
            rank(plan.config_for("blocks.0.attn.qkv_extra", false)),
            Some((8, Some(1.0), false))
        );
        assert_eq!(rank(plan.config_for("blocks.0.attn.norm.lin", false)), None);
        assert_eq!(rank(plan.config_for("blocks.0.mlp.fc1", false)), None);
        assert_eq!(
            rank(plan.config_for("conv_in", true)),
            Some((2, None, true))
        );
        assert_eq!(rank(plan.config_for("up.conv_in", true)), None);
    }

    #[test]
    fn bad_patterns_and_overrides_are_errors() {
        let plan = LoraPlan::new(LoraConfig::new(4)).unwrap();
        let err = plan.clone().include("(").unwrap_err().to_string();
        assert!(err.starts_with("invalid module pattern `(`"), "{err}");
        let err = plan.with_override("x", Some(0), None).unwrap_err();
        assert!(err.to_string().contains("rank"), "{err}");
    }
}
