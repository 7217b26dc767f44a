//! Adapter hyperparameters: rank, alpha, scale rule, dropout, dtype, LoKr factoring.

use burn::config::Config;
use burn::tensor::DType;

use crate::LoraError;

/// A low-rank adapter `ΔW = scale · B · A` with `A` (down) `[rank, in]` and `B` (up) `[out, rank]`.
///
/// `scale = alpha / rank`, or `alpha / sqrt(rank)` with `rslora`. `alpha` defaults to `rank`
/// (scale 1). Over a `Conv2d` the same config gives LoCon: `A` is a convolution with the base
/// layer's kernel, stride and padding, `B` a 1×1 convolution.
#[derive(Config, Debug, PartialEq)]
pub struct LoraConfig {
    /// The rank `r` of the update.
    pub rank: usize,
    /// The alpha of the scale rule; `None` means `rank`.
    #[config(default = "None")]
    pub alpha: Option<f64>,
    /// Use rank-stabilised scaling, `alpha / sqrt(rank)`.
    #[config(default = false)]
    pub rslora: bool,
    /// Dropout probability on the adapter input (training only).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// The dtype of the adapter weights; `None` means the dtype of the base weight.
    #[config(default = "None")]
    pub dtype: Option<DType>,
}

/// A Kronecker-product adapter (LoKr): `ΔW = w1 ⊗ w2`, `w1` `[out₁, in₁]`, `w2` `[out₂, in₂]`
/// with `out₁·out₂ = out` and `in₁·in₂ = in`.
///
/// By default both factors are full matrices and the scale is 1 (alpha does not apply, as in
/// LyCORIS, ComfyUI and diffusers). With `decompose_w2`, `w2 = w2_a · w2_b` has rank `rank` and
/// the scale is `alpha / rank`.
#[derive(Config, Debug, PartialEq)]
pub struct LokrConfig {
    /// The rank of `w2 = w2_a · w2_b` when decomposed; also the default alpha.
    pub rank: usize,
    /// The alpha of the scale rule for a decomposed `w2`; `None` means `rank`.
    #[config(default = "None")]
    pub alpha: Option<f64>,
    /// The size of the first factor's dimensions; `None` picks the most balanced factor pair.
    #[config(default = "None")]
    pub factor: Option<usize>,
    /// Store `w2` as the product of two low-rank matrices.
    #[config(default = false)]
    pub decompose_w2: bool,
    /// Dropout probability on the adapter input (training only).
    #[config(default = 0.0)]
    pub dropout: f64,
    /// The dtype of the adapter weights; `None` means the dtype of the base weight.
    #[config(default = "None")]
    pub dtype: Option<DType>,
}

/// The kind of adapter to attach, with its hyperparameters.
#[derive(Config, Debug, PartialEq)]
pub enum AdapterConfig {
    /// LoRA over a `Linear`, LoCon over a `Conv2d`.
    Lora(LoraConfig),
    /// LoKr.
    Lokr(LokrConfig),
}

impl From<LoraConfig> for AdapterConfig {
    fn from(config: LoraConfig) -> Self {
        Self::Lora(config)
    }
}

impl From<LokrConfig> for AdapterConfig {
    fn from(config: LokrConfig) -> Self {
        Self::Lokr(config)
    }
}

impl LoraConfig {
    /// The alpha in effect: the configured one, or `rank`.
    pub fn effective_alpha(&self) -> f64 {
        self.alpha.unwrap_or(self.rank as f64)
    }

    /// The factor applied to `B · A`.
    pub fn scale(&self) -> f64 {
        let rank = self.rank as f64;
        if self.rslora {
            self.effective_alpha() / rank.sqrt()
        } else {
            self.effective_alpha() / rank
        }
    }
}

impl LokrConfig {
    /// The alpha in effect: the configured one, or `rank`.
    pub fn effective_alpha(&self) -> f64 {
        self.alpha.unwrap_or(self.rank as f64)
    }
}

impl AdapterConfig {
    /// Returns the same config with rank and/or alpha replaced.
    pub fn with_rank_alpha(&self, rank: Option<usize>, alpha: Option<f64>) -> Self {
        match self {
            Self::Lora(c) => Self::Lora(LoraConfig {
                rank: rank.unwrap_or(c.rank),
                alpha: alpha.or(c.alpha),
                ..c.clone()
            }),
            Self::Lokr(c) => Self::Lokr(LokrConfig {
                rank: rank.unwrap_or(c.rank),
                alpha: alpha.or(c.alpha),
                ..c.clone()
            }),
        }
    }

    /// Checks the values: rank ≥ 1, finite alpha, dropout in `[0, 1)`, float dtype.
    pub fn validate(&self) -> Result<(), LoraError> {
        let (rank, alpha, dropout, dtype) = match self {
            Self::Lora(c) => (c.rank, c.alpha, c.dropout, c.dtype),
            Self::Lokr(c) => {
                if c.factor == Some(0) {
                    return Err(LoraError::Config("LoKr factor must be at least 1".into()));
                }
                (c.rank, c.alpha, c.dropout, c.dtype)
            }
        };
        if rank == 0 {
            return Err(LoraError::Config("rank must be at least 1".into()));
        }
        if alpha.is_some_and(|a| !a.is_finite()) {
            return Err(LoraError::Config(format!("alpha {alpha:?} is not finite")));
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(LoraError::Config(format!(
                "dropout {dropout} is outside [0, 1)"
            )));
        }
        if let Some(dtype) = dtype
            && !matches!(dtype, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
        {
            return Err(LoraError::Config(format!(
                "adapter dtype {dtype:?} is not a float dtype"
            )));
        }
        Ok(())
    }
}

/// Splits `dimension` into `(m, n)` with `m · n = dimension` and `m ≤ n`.
///
/// With `factor = Some(f)` and `f` dividing `dimension`, the pair is `(f, dimension / f)`
/// (sorted). Otherwise it is the pair with the smallest `m + n` (the most balanced), with
/// `m ≤ f` when a factor is given.
pub fn factorize(dimension: usize, factor: Option<usize>) -> (usize, usize) {
    if let Some(f) = factor
        && f > 0
        && dimension.is_multiple_of(f)
    {
        let other = dimension / f;
        return (f.min(other), f.max(other));
    }
    let limit = factor.unwrap_or(dimension);
    let mut best = (1, dimension);
    let mut m = 1;
    while m * m <= dimension {
        if dimension.is_multiple_of(m) && m <= limit {
            best = (m, dimension / m);
        }
        m += 1;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_rules() {
        let plain = LoraConfig::new(1024).with_alpha(Some(64.0));
        assert_eq!(plain.scale(), 0.0625);
        let rs = plain.clone().with_rslora(true);
        assert_eq!(rs.scale(), 2.0);
        assert_eq!(LoraConfig::new(16).scale(), 1.0);
    }

    #[test]
    fn factorize_balanced_and_forced() {
        assert_eq!(factorize(3072, None), (48, 64));
        assert_eq!(factorize(12, None), (3, 4));
        assert_eq!(factorize(7, None), (1, 7));
        assert_eq!(factorize(64, Some(4)), (4, 16));
        assert_eq!(factorize(64, Some(32)), (2, 32));
        // 7 does not divide 60: the most balanced pair with m <= 7.
        assert_eq!(factorize(60, Some(7)), (6, 10));
        assert_eq!(factorize(60, Some(3)), (3, 20));
    }

    #[test]
    fn validation_names_the_problem() {
        let err = AdapterConfig::from(LoraConfig::new(0))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("rank"));
        let err = AdapterConfig::from(LoraConfig::new(4).with_dropout(1.0))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("dropout"));
        let over = AdapterConfig::from(LoraConfig::new(4)).with_rank_alpha(Some(8), Some(2.0));
        assert_eq!(
            over,
            AdapterConfig::Lora(LoraConfig::new(8).with_alpha(Some(2.0)))
        );
    }
}
