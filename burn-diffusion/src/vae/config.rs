//! AutoencoderKL hyperparameters: the FLUX.1 and SDXL presets, diffusers' `config.json`, and
//! inference from the tensor shapes of a single file.

use std::collections::BTreeSet;
use std::path::Path;

use burn::config::Config;
use serde::Deserialize;

use crate::error::LoadError;
use crate::weights::{KeyShapes, read_json};

/// The shape of an AutoencoderKL and its latent normalization. Field names follow diffusers'
/// `AutoencoderKL` config.
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

    /// How many times the encoder halves the resolution's side (8 for FLUX.1 and SDXL).
    pub fn downscale_factor(&self) -> usize {
        1 << self.block_out_channels.len().saturating_sub(1)
    }

    /// Checks that the sizes agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_out_channels.is_empty() {
            return Err("block_out_channels is empty".into());
        }
        let groups = self.norm_num_groups;
        if groups == 0
            || self
                .block_out_channels
                .iter()
                .any(|c| !c.is_multiple_of(groups))
        {
            return Err(format!(
                "norm_num_groups {groups} does not divide every width of {:?}",
                self.block_out_channels
            ));
        }
        if self.scaling_factor == 0.0 {
            return Err("scaling_factor is 0".into());
        }
        Ok(())
    }

    /// Reads diffusers' `vae/config.json` (`AutoencoderKL`).
    pub fn from_diffusers_json(file: &Path) -> Result<Self, LoadError> {
        let raw: DiffusersVaeConfig = read_json(file)?;
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        if let Some(class) = raw.class_name.as_deref()
            && class != "AutoencoderKL"
        {
            return Err(error(format!(
                "`_class_name` is {class}, expected AutoencoderKL"
            )));
        }
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
        let config = Self {
            in_channels: raw.in_channels,
            out_channels: raw.out_channels,
            latent_channels: raw.latent_channels,
            block_out_channels: raw.block_out_channels,
            layers_per_block: raw.layers_per_block,
            norm_num_groups: raw.norm_num_groups,
            use_quant_conv: raw.use_quant_conv,
            use_post_quant_conv: raw.use_post_quant_conv,
            mid_block_add_attention: raw.mid_block_add_attention,
            scaling_factor: raw.scaling_factor,
            shift_factor: raw.shift_factor,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }

    /// Infers the configuration of a single file from its tensors, named in diffusers' layout:
    /// widths from the encoder's convolutions, the number of residual blocks per level, the
    /// quant convolutions and the middle attention from their presence. A file does not record
    /// its group count (32 is taken, as in every released VAE) nor its latent normalization,
    /// which is FLUX.1's for 16 latent channels and SDXL's for 4.
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
        let (scaling_factor, shift_factor) = match latent_channels {
            16 => (0.3611, Some(0.1159)),
            4 => (0.13025, None),
            other => {
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
        };
        config.validate().map_err(error)?;
        Ok(config)
    }
}

/// The fields of diffusers' `AutoencoderKL` config that the model uses.
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
    #[serde(default = "one")]
    layers_per_block: usize,
    #[serde(default = "silu")]
    act_fn: String,
    #[serde(default = "four")]
    latent_channels: usize,
    #[serde(default = "thirty_two")]
    norm_num_groups: usize,
    #[serde(default = "sd_scaling")]
    scaling_factor: f64,
    #[serde(default)]
    shift_factor: Option<f64>,
    #[serde(default = "yes")]
    use_quant_conv: bool,
    #[serde(default = "yes")]
    use_post_quant_conv: bool,
    #[serde(default = "yes")]
    mid_block_add_attention: bool,
}

// diffusers' defaults for the fields a config.json may omit.
fn one() -> usize {
    1
}
fn three() -> usize {
    3
}
fn four() -> usize {
    4
}
fn thirty_two() -> usize {
    32
}
fn sd_scaling() -> f64 {
    0.18215
}
fn silu() -> String {
    "silu".into()
}
fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_downscale_by_eight() {
        for config in [VaeConfig::flux(), VaeConfig::sdxl()] {
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
