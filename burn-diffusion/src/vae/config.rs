//! AutoencoderKL hyperparameters: the FLUX.1, FLUX.2 and SDXL presets, diffusers' `config.json`
//! (`AutoencoderKL`, `AutoencoderKLFlux2`), and inference from the tensor shapes of a single file.

use std::collections::BTreeSet;
use std::path::Path;

use burn::config::Config;
use serde::Deserialize;

use crate::error::LoadError;
use crate::weights::{KeyShapes, read_json};

/// The shape of an AutoencoderKL and its latent normalization. Field names follow diffusers'
/// `AutoencoderKL` config (FLUX.2's `AutoencoderKLFlux2` adds [`VaeConfig::batch_norm`]).
#[derive(Config, Debug, PartialEq)]
pub struct VaeConfig {
    /// Image channels in.
    #[config(default = 3)]
    pub in_channels: usize,
    /// Image channels out.
    #[config(default = 3)]
    pub out_channels: usize,
    /// Channels of a latent (FLUX.1: 16, SDXL: 4).
    pub latent_channels: usize,
    /// Channels of each resolution level, finest first; each level but the last halves the
    /// resolution.
    pub block_out_channels: Vec<usize>,
    /// Residual blocks per level in the encoder (the decoder has one more).
    #[config(default = 2)]
    pub layers_per_block: usize,
    /// Groups of every group norm.
    #[config(default = 32)]
    pub norm_num_groups: usize,
    /// Whether a 1×1 convolution follows the encoder (`quant_conv`).
    pub use_quant_conv: bool,
    /// Whether a 1×1 convolution precedes the decoder (`post_quant_conv`).
    pub use_post_quant_conv: bool,
    /// Whether the middle blocks hold a self-attention layer.
    #[config(default = true)]
    pub mid_block_add_attention: bool,
    /// Multiplies a shifted latent to give the diffusion model's input.
    pub scaling_factor: f64,
    /// Subtracted from a latent before scaling (FLUX.1: 0.1159; SDXL: none).
    pub shift_factor: Option<f64>,
    /// FLUX.2's latent normalization by the running statistics of a batch norm over patches
    /// (which replaces the scale and shift); `None` for FLUX.1 and SDXL.
    pub batch_norm: Option<LatentBatchNormConfig>,
}

/// How FLUX.2 normalizes a latent: each `patch_size × patch_size` patch is folded into the
/// channels (`latent_channels · patch_size²` of them), which are then normalized with the running
/// mean and variance of a batch norm without affine transform (diffusers' `vae.bn`).
#[derive(Config, Debug, PartialEq)]
pub struct LatentBatchNormConfig {
    /// Side of the patches (FLUX.2: 2).
    #[config(default = 2)]
    pub patch_size: usize,
    /// Added to the running variance (diffusers' `batch_norm_eps`).
    #[config(default = 1e-4)]
    pub eps: f64,
}

impl LatentBatchNormConfig {
    /// FLUX.2's: 2×2 patches, epsilon 1e-4.
    pub fn flux2() -> Self {
        Self {
            patch_size: 2,
            eps: 1e-4,
        }
    }
}

impl VaeConfig {
    /// FLUX.1's VAE (`ae.safetensors`): 16 latent channels, no quant convolutions.
    pub fn flux() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 16,
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            norm_num_groups: 32,
            use_quant_conv: false,
            use_post_quant_conv: false,
            mid_block_add_attention: true,
            scaling_factor: 0.3611,
            shift_factor: Some(0.1159),
            batch_norm: None,
        }
    }

    /// FLUX.2's VAE (`flux2-vae.safetensors`, diffusers' `AutoencoderKLFlux2`): 32 latent
    /// channels, quant convolutions, and the batch-norm normalization of 2×2 patches instead of
    /// a scale and shift.
    pub fn flux2() -> Self {
        Self {
            latent_channels: 32,
            use_quant_conv: true,
            use_post_quant_conv: true,
            scaling_factor: 1.0,
            shift_factor: None,
            batch_norm: Some(LatentBatchNormConfig::flux2()),
            ..Self::flux()
        }
    }

    /// SDXL's VAE: 4 latent channels with quant convolutions.
    pub fn sdxl() -> Self {
        Self {
            latent_channels: 4,
            use_quant_conv: true,
            use_post_quant_conv: true,
            scaling_factor: 0.13025,
            shift_factor: None,
            ..Self::flux()
        }
    }

    /// How many times the encoder halves the resolution's side (8 for FLUX.1, FLUX.2 and SDXL).
    pub fn downscale_factor(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// Checks that the sizes agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_out_channels.is_empty() {
            return Err("block_out_channels is empty".into());
        }
        check_group_norm(self.norm_num_groups, &self.block_out_channels)?;
        if self.scaling_factor == 0.0 {
            return Err("scaling_factor is 0".into());
        }
        if let Some(norm) = &self.batch_norm
            && (norm.patch_size == 0 || norm.eps < 0.0)
        {
            return Err(format!(
                "batch norm patch size {} / epsilon {} is unusable",
                norm.patch_size, norm.eps
            ));
        }
        Ok(())
    }

    /// Reads diffusers' `vae/config.json`: `AutoencoderKL`, or FLUX.2's `AutoencoderKLFlux2`
    /// (whose latent normalization is the batch norm's, with square patches only, and whose
    /// decoder has the encoder's widths).
    pub fn from_diffusers_json(file: &Path) -> Result<Self, LoadError> {
        let raw: DiffusersVaeConfig = read_json(file)?;
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        let flux2 = match raw.class_name.as_deref() {
            None | Some("AutoencoderKL") => false,
            Some("AutoencoderKLFlux2") => true,
            Some(class) => {
                return Err(error(format!(
                    "`_class_name` is {class}, expected AutoencoderKL or AutoencoderKLFlux2"
                )));
            }
        };
        let levels = raw.block_out_channels.len();
        let blocks_ok = |types: &[String], expected: &str| {
            types.len() == levels && types.iter().all(|t| t == expected)
        };
        if !blocks_ok(&raw.down_block_types, "DownEncoderBlock2D")
            || !blocks_ok(&raw.up_block_types, "UpDecoderBlock2D")
        {
            return Err(error(format!(
                "block types {:?} / {:?} are not {levels} DownEncoderBlock2D / UpDecoderBlock2D",
                raw.down_block_types, raw.up_block_types
            )));
        }
        if raw.act_fn != "silu" {
            return Err(error(format!(
                "act_fn `{}` is not supported (expected silu)",
                raw.act_fn
            )));
        }
        if let Some(decoder) = &raw.decoder_block_out_channels
            && decoder != &raw.block_out_channels
        {
            return Err(error(format!(
                "decoder_block_out_channels {decoder:?} differ from block_out_channels {:?}",
                raw.block_out_channels
            )));
        }
        let batch_norm = match (flux2, raw.patch_size.as_deref()) {
            (false, _) => None,
            (true, None) => Some(2),
            (true, Some(&[rows, cols])) if rows == cols => Some(rows),
            (true, Some(other)) => {
                return Err(error(format!("patch_size {other:?} is not square")));
            }
        }
        .map(|patch_size| LatentBatchNormConfig {
            patch_size,
            eps: raw.batch_norm_eps,
        });
        // AutoencoderKLFlux2's defaults differ, and it has no scale or shift.
        let (layers, latent, scaling, shift) = if flux2 {
            (2, 32, 1.0, None)
        } else {
            (
                1,
                4,
                raw.scaling_factor.unwrap_or(0.18215),
                raw.shift_factor,
            )
        };
        let config = Self {
            in_channels: raw.in_channels,
            out_channels: raw.out_channels,
            latent_channels: raw.latent_channels.unwrap_or(latent),
            block_out_channels: raw.block_out_channels,
            layers_per_block: raw.layers_per_block.unwrap_or(layers),
            norm_num_groups: raw.norm_num_groups,
            use_quant_conv: raw.use_quant_conv,
            use_post_quant_conv: raw.use_post_quant_conv,
            mid_block_add_attention: raw.mid_block_add_attention,
            scaling_factor: scaling,
            shift_factor: shift,
            batch_norm,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }

    /// Infers the configuration of a single file from its tensors, named in diffusers' layout:
    /// widths from the encoder's convolutions, the number of residual blocks per level, the
    /// quant convolutions and the middle attention from their presence. A file does not record
    /// its group count (32 is taken, as in every released VAE) nor its latent normalization:
    /// a file with batch-norm statistics (`bn.running_mean`) is FLUX.2's (patch side from their
    /// count, epsilon 1e-4), else it is FLUX.1's for 16 latent channels and SDXL's for 4.
    pub fn from_keys<'a>(
        file: &Path,
        names: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let shapes = KeyShapes {
            file,
            model: "VAE",
            shape_of,
        };
        let error = |message: String| shapes.error(message);
        let dims = |name: &str| shapes.shape(name, 4);
        let mut levels = BTreeSet::new();
        let mut layers = BTreeSet::new();
        let mut names_seen = BTreeSet::new();
        for name in names {
            let parts: Vec<&str> = name.split('.').collect();
            if let ["encoder", "down_blocks", level, "resnets", layer, ..] = parts.as_slice()
                && let (Ok(level), Ok(layer)) = (level.parse::<usize>(), layer.parse::<usize>())
            {
                levels.insert(level);
                if level == 0 {
                    layers.insert(layer);
                }
            }
            names_seen.insert(name.to_string());
        }
        let count = |set: &BTreeSet<usize>| set.last().map_or(0, |last| last + 1);
        let block_out_channels = (0..count(&levels))
            .map(|l| dims(&format!("encoder.down_blocks.{l}.resnets.0.conv1.weight")).map(|s| s[0]))
            .collect::<Result<Vec<_>, _>>()?;
        let latent_channels = dims("decoder.conv_in.weight")?[1];
        let batch_norm = if names_seen.contains("bn.running_mean") {
            let channels = shapes.shape("bn.running_mean", 1)?[0];
            let norm = patch_norm(channels, latent_channels).ok_or_else(|| {
                error(format!(
                    "`bn.running_mean` holds {channels} channels, not {latent_channels} latent \
                     channels times a square patch"
                ))
            })?;
            Some(norm)
        } else {
            None
        };
        let (scaling_factor, shift_factor) = match (latent_channels, &batch_norm) {
            (_, Some(_)) => (1.0, None),
            (16, None) => (0.3611, Some(0.1159)),
            (4, None) => (0.13025, None),
            (other, None) => {
                return Err(error(format!(
                    "a single file with {other} latent channels: give its config"
                )));
            }
        };
        let config = Self {
            in_channels: dims("encoder.conv_in.weight")?[1],
            out_channels: dims("decoder.conv_out.weight")?[0],
            latent_channels,
            block_out_channels,
            layers_per_block: count(&layers),
            norm_num_groups: 32,
            use_quant_conv: names_seen.contains("quant_conv.weight"),
            use_post_quant_conv: names_seen.contains("post_quant_conv.weight"),
            mid_block_add_attention: names_seen
                .contains("encoder.mid_block.attentions.0.to_q.weight"),
            scaling_factor,
            shift_factor,
            batch_norm,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }
}

/// FLUX.2's normalization for a batch norm over `channels` of `latent_channels` latents, if
/// `channels` is `latent_channels` times a square.
fn patch_norm(channels: usize, latent_channels: usize) -> Option<LatentBatchNormConfig> {
    let area = channels.checked_div(latent_channels)?;
    let side = area.isqrt();
    (side > 0 && side * side * latent_channels == channels).then(|| LatentBatchNormConfig {
        patch_size: side,
        ..LatentBatchNormConfig::flux2()
    })
}

/// The fields of diffusers' `AutoencoderKL` and `AutoencoderKLFlux2` configs that the model
/// uses; those whose default differs between the two are optional.
#[derive(Deserialize)]
struct DiffusersVaeConfig {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    #[serde(default = "three")]
    in_channels: usize,
    #[serde(default = "three")]
    out_channels: usize,
    down_block_types: Vec<String>,
    up_block_types: Vec<String>,
    block_out_channels: Vec<usize>,
    #[serde(default)]
    decoder_block_out_channels: Option<Vec<usize>>,
    #[serde(default)]
    layers_per_block: Option<usize>,
    #[serde(default = "silu")]
    act_fn: String,
    #[serde(default)]
    latent_channels: Option<usize>,
    #[serde(default = "thirty_two")]
    norm_num_groups: usize,
    #[serde(default)]
    scaling_factor: Option<f64>,
    #[serde(default)]
    shift_factor: Option<f64>,
    #[serde(default = "yes")]
    use_quant_conv: bool,
    #[serde(default = "yes")]
    use_post_quant_conv: bool,
    #[serde(default = "yes")]
    mid_block_add_attention: bool,
    #[serde(default = "batch_norm_eps")]
    batch_norm_eps: f64,
    #[serde(default)]
    patch_size: Option<Vec<usize>>,
}

// diffusers' defaults for the fields a config.json may omit.
fn three() -> usize {
    3
}
fn thirty_two() -> usize {
    32
}
fn batch_norm_eps() -> f64 {
    1e-4
}
fn silu() -> String {
    "silu".into()
}
fn yes() -> bool {
    true
}

/// An error unless `groups` (a group norm's) divides every width of `widths`.
pub(crate) fn check_group_norm(groups: usize, widths: &[usize]) -> Result<(), String> {
    if groups == 0 || widths.iter().any(|c| !c.is_multiple_of(groups)) {
        return Err(format!(
            "norm_num_groups {groups} does not divide every width of {widths:?}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_downscale_by_eight() {
        for config in [VaeConfig::flux(), VaeConfig::flux2(), VaeConfig::sdxl()] {
            config.validate().unwrap();
            assert_eq!(config.downscale_factor(), 8);
        }
    }

    #[test]
    fn unsupported_block_types_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(
            &file,
            r#"{"_class_name": "AutoencoderKL", "block_out_channels": [32, 64],
                "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
                "up_block_types": ["UpDecoderBlock2D", "AttnUpDecoderBlock2D"],
                "norm_num_groups": 32}"#,
        )
        .unwrap();
        let error = VaeConfig::from_diffusers_json(&file)
            .unwrap_err()
            .to_string();
        assert!(error.contains("AttnUpDecoderBlock2D"), "{error}");
    }

    #[test]
    fn flux2_config_reads_the_batch_norm_and_refuses_other_decoders() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        let write = |extra: &str| {
            std::fs::write(
                &file,
                format!(
                    r#"{{"_class_name": "AutoencoderKLFlux2", "block_out_channels": [32, 64],
                        "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D"],
                        "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D"]{extra}}}"#
                ),
            )
            .unwrap();
        };
        write(r#", "batch_norm_eps": 0.001, "patch_size": [3, 3]"#);
        let config = VaeConfig::from_diffusers_json(&file).unwrap();
        let expected = VaeConfig {
            block_out_channels: vec![32, 64],
            batch_norm: Some(LatentBatchNormConfig {
                patch_size: 3,
                eps: 1e-3,
            }),
            ..VaeConfig::flux2()
        };
        assert_eq!(config, expected);
        write(r#", "decoder_block_out_channels": [16, 32]"#);
        let error = VaeConfig::from_diffusers_json(&file)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("decoder_block_out_channels [16, 32]"),
            "{error}"
        );
    }

    #[test]
    fn patch_side_comes_from_the_statistics() {
        assert_eq!(patch_norm(128, 32), Some(LatentBatchNormConfig::flux2()));
        assert_eq!(patch_norm(96, 32), None);
        assert_eq!(patch_norm(128, 0), None);
    }

    #[test]
    fn groups_must_divide_widths() {
        let config = VaeConfig {
            norm_num_groups: 24,
            ..VaeConfig::flux()
        };
        assert!(
            config
                .validate()
                .unwrap_err()
                .contains("norm_num_groups 24")
        );
    }
}
