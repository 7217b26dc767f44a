//! FLUX.1 hyperparameters: the two presets, diffusers' `config.json`, and inference from the
//! tensor shapes of a BFL file.

use std::path::Path;

use burn::config::Config;
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::error::LoadError;
use crate::weights::{numbered, read_json};

/// The shape of a FLUX.1 transformer. Field names follow BFL's `FluxParams`; the diffusers name
/// of each is given where it differs.
#[derive(Config, Debug, PartialEq)]
pub struct FluxConfig {
    /// Channels of an image token (`in_channels`; 64 = 16 latent channels × 2 × 2 patch).
    pub in_channels: usize,
    /// Channels of an output token (`out_channels`).
    pub out_channels: usize,
    /// Width of the pooled text vector (`pooled_projection_dim`; CLIP-L's 768).
    pub vec_in_dim: usize,
    /// Width of a text token (`joint_attention_dim`; T5-XXL's 4096).
    pub context_in_dim: usize,
    /// Width of the residual stream (`num_attention_heads × attention_head_dim`).
    pub hidden_size: usize,
    /// Hidden width of the MLPs relative to `hidden_size`.
    #[config(default = 4.0)]
    pub mlp_ratio: f64,
    /// Attention heads (`num_attention_heads`).
    pub num_heads: usize,
    /// Double-stream blocks (`num_layers`).
    pub depth: usize,
    /// Single-stream blocks (`num_single_layers`).
    pub depth_single_blocks: usize,
    /// Rotary widths per position axis, summing to the head size (`axes_dims_rope`).
    pub axes_dim: Vec<usize>,
    /// Rotary base.
    #[config(default = 10000.0)]
    pub theta: f64,
    /// Whether the model embeds a guidance strength (`guidance_embeds`; dev yes, schnell no).
    pub guidance_embed: bool,
}

impl FluxConfig {
    /// FLUX.1-dev: 19 double and 38 single blocks of width 3072, 24 heads, guidance embedding
    /// (11.9 B parameters).
    pub fn dev() -> Self {
        Self::new(64, 64, 768, 4096, 3072, 24, 19, 38, vec![16, 56, 56], true)
    }

    /// FLUX.1-schnell: as dev, without the guidance embedding.
    pub fn schnell() -> Self {
        Self {
            guidance_embed: false,
            ..Self::dev()
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Hidden width of the MLPs.
    pub fn mlp_hidden_dim(&self) -> usize {
        (self.hidden_size as f64 * self.mlp_ratio) as usize
    }

    /// The rotary axes a BFL file gets, which does not record them: the two spatial axes take
    /// 7/16 of the head each (rounded down to even) and the time axis the rest. For FLUX.1's head
    /// size of 128 this is `[16, 56, 56]`.
    pub fn rope_axes_for_head_dim(head_dim: usize) -> Vec<usize> {
        let spatial = head_dim * 7 / 16 / 2 * 2;
        vec![head_dim - 2 * spatial, spatial, spatial]
    }

    /// Checks that the sizes agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        check_heads(self.hidden_size, self.num_heads, &self.axes_dim)
    }

    /// Reads diffusers' `transformer/config.json` (`FluxTransformer2DModel`).
    pub fn from_diffusers_json(file: &Path) -> Result<Self, LoadError> {
        let raw: DiffusersConfig = read_diffusers_json(file, "FluxTransformer2DModel")?;
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        let config = Self {
            in_channels: raw.in_channels,
            out_channels: raw.out_channels.unwrap_or(raw.in_channels),
            vec_in_dim: raw.pooled_projection_dim,
            context_in_dim: raw.joint_attention_dim,
            hidden_size: raw.num_attention_heads * raw.attention_head_dim,
            mlp_ratio: 4.0,
            num_heads: raw.num_attention_heads,
            depth: raw.num_layers,
            depth_single_blocks: raw.num_single_layers,
            axes_dim: raw.axes_dims_rope,
            theta: 10000.0,
            guidance_embed: raw.guidance_embeds,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }

    /// Infers the configuration of a BFL-layout checkpoint from its keys and shapes: block
    /// counts from the `double_blocks.N` / `single_blocks.N` indices, widths from the embedders,
    /// the head size from the length of the query-norm scale, guidance from `guidance_in`, and
    /// the rotary axes from [`FluxConfig::rope_axes_for_head_dim`].
    pub fn from_bfl_keys<'a>(
        file: &Path,
        keys: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        let dims = |key: &str, rank: usize| -> Result<Vec<usize>, LoadError> {
            match shape_of(key) {
                Some(shape) if shape.len() == rank => Ok(shape),
                Some(shape) => Err(error(format!("`{key}` is {shape:?}, expected rank {rank}"))),
                None => Err(error(format!(
                    "cannot infer the FLUX config: `{key}` is missing"
                ))),
            }
        };
        let blocks = BflBlocks::count(keys);
        let img_in = dims("img_in.weight", 2)?;
        let hidden = img_in[0];
        let head_dim = if blocks.double == 0 {
            dims("single_blocks.0.norm.query_norm.scale", 1)?[0]
        } else {
            dims("double_blocks.0.img_attn.norm.query_norm.scale", 1)?[0]
        };
        let mlp_hidden = if blocks.double == 0 {
            dims("single_blocks.0.linear1.weight", 2)?[0].saturating_sub(3 * hidden)
        } else {
            dims("double_blocks.0.img_mlp.0.weight", 2)?[0]
        };
        if head_dim == 0 || !hidden.is_multiple_of(head_dim) {
            return Err(error(format!(
                "head size {head_dim} does not divide the width {hidden}"
            )));
        }
        let config = Self {
            in_channels: img_in[1],
            out_channels: dims("final_layer.linear.weight", 2)?[0],
            vec_in_dim: dims("vector_in.in_layer.weight", 2)?[1],
            context_in_dim: dims("txt_in.weight", 2)?[1],
            hidden_size: hidden,
            mlp_ratio: mlp_hidden as f64 / hidden as f64,
            num_heads: hidden / head_dim,
            depth: blocks.double,
            depth_single_blocks: blocks.single,
            axes_dim: Self::rope_axes_for_head_dim(head_dim),
            theta: 10000.0,
            guidance_embed: blocks.guidance,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }
}

/// What a BFL file's keys say of a FLUX transformer's blocks.
pub(crate) struct BflBlocks {
    /// Double-stream blocks: one more than the largest `double_blocks.N`.
    pub double: usize,
    /// Single-stream blocks.
    pub single: usize,
    /// Whether `guidance_in` is there.
    pub guidance: bool,
}

impl BflBlocks {
    /// Counts the blocks among `keys` (without prefix).
    pub fn count<'a>(keys: impl Iterator<Item = &'a str>) -> Self {
        let keys: Vec<&str> = keys.collect();
        Self {
            double: numbered(keys.iter().copied(), "double_blocks."),
            single: numbered(keys.iter().copied(), "single_blocks."),
            guidance: keys.iter().any(|k| k.starts_with("guidance_in.")),
        }
    }
}

/// Checks that `heads` heads divide the width `hidden` and that the rotary axes are even and
/// sum to the head size (FLUX.1 and FLUX.2).
pub(crate) fn check_heads(hidden: usize, heads: usize, axes_dim: &[usize]) -> Result<(), String> {
    if heads == 0 || !hidden.is_multiple_of(heads) {
        return Err(format!(
            "hidden size {hidden} is not a multiple of {heads} heads"
        ));
    }
    let head_dim = hidden / heads;
    if axes_dim.iter().sum::<usize>() != head_dim || axes_dim.iter().any(|a| a % 2 == 1) {
        return Err(format!(
            "rope axes {axes_dim:?} must be even and sum to the head size {head_dim}"
        ));
    }
    Ok(())
}

/// Reads a diffusers transformer `config.json` as `T`, after checking that its `_class_name`
/// (when given) is `class` and its `patch_size` is 1, the only one FLUX uses.
pub(crate) fn read_diffusers_json<T: DeserializeOwned>(
    file: &Path,
    class: &str,
) -> Result<T, LoadError> {
    #[derive(Deserialize)]
    struct Common {
        #[serde(rename = "_class_name")]
        class_name: Option<String>,
        #[serde(default = "one")]
        patch_size: usize,
    }
    fn one() -> usize {
        1
    }
    let error = |message: String| LoadError::Config {
        file: file.to_path_buf(),
        message,
    };
    let common: Common = read_json(file)?;
    if let Some(found) = common.class_name.as_deref()
        && found != class
    {
        return Err(error(format!("`_class_name` is {found}, expected {class}")));
    }
    if common.patch_size != 1 {
        return Err(error(format!(
            "patch_size {} is not supported (FLUX uses 1)",
            common.patch_size
        )));
    }
    read_json(file)
}

/// The fields of diffusers' `FluxTransformer2DModel` config, with its defaults.
#[derive(Deserialize)]
struct DiffusersConfig {
    #[serde(default = "d_in_channels")]
    in_channels: usize,
    #[serde(default)]
    out_channels: Option<usize>,
    #[serde(default = "d_num_layers")]
    num_layers: usize,
    #[serde(default = "d_num_single_layers")]
    num_single_layers: usize,
    #[serde(default = "d_attention_head_dim")]
    attention_head_dim: usize,
    #[serde(default = "d_num_attention_heads")]
    num_attention_heads: usize,
    #[serde(default = "d_joint_attention_dim")]
    joint_attention_dim: usize,
    #[serde(default = "d_pooled_projection_dim")]
    pooled_projection_dim: usize,
    #[serde(default)]
    guidance_embeds: bool,
    #[serde(default = "d_axes_dims_rope")]
    axes_dims_rope: Vec<usize>,
}

fn d_in_channels() -> usize {
    64
}
fn d_num_layers() -> usize {
    19
}
fn d_num_single_layers() -> usize {
    38
}
fn d_attention_head_dim() -> usize {
    128
}
fn d_num_attention_heads() -> usize {
    24
}
fn d_joint_attention_dim() -> usize {
    4096
}
fn d_pooled_projection_dim() -> usize {
    768
}
fn d_axes_dims_rope() -> Vec<usize> {
    vec![16, 56, 56]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid_and_differ_only_in_guidance() {
        let dev = FluxConfig::dev();
        dev.validate().unwrap();
        assert_eq!(dev.head_dim(), 128);
        assert_eq!(dev.mlp_hidden_dim(), 12288);
        assert_eq!(
            FluxConfig::schnell(),
            FluxConfig {
                guidance_embed: false,
                ..dev
            }
        );
    }

    #[test]
    fn rope_axes_preset_gives_flux_for_128_and_valid_splits_otherwise() {
        assert_eq!(FluxConfig::rope_axes_for_head_dim(128), [16, 56, 56]);
        assert_eq!(FluxConfig::rope_axes_for_head_dim(16), [4, 6, 6]);
        for d in (2..=256).step_by(2) {
            let axes = FluxConfig::rope_axes_for_head_dim(d);
            assert_eq!(axes.iter().sum::<usize>(), d);
            assert!(axes.iter().all(|a| a % 2 == 0), "{d}: {axes:?}");
        }
    }

    #[test]
    fn diffusers_json_defaults_are_flux_dev_without_guidance() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(
            &file,
            r#"{"_class_name": "FluxTransformer2DModel", "guidance_embeds": true}"#,
        )
        .unwrap();
        assert_eq!(
            FluxConfig::from_diffusers_json(&file).unwrap(),
            FluxConfig::dev()
        );
    }

    #[test]
    fn diffusers_json_errors_name_the_file_and_field() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, r#"{"_class_name": "SD3Transformer2DModel"}"#).unwrap();
        let text = FluxConfig::from_diffusers_json(&file)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("config.json") && text.contains("SD3Transformer2DModel"),
            "{text}"
        );
        std::fs::write(&file, r#"{"axes_dims_rope": [16, 56, 50]}"#).unwrap();
        let text = FluxConfig::from_diffusers_json(&file)
            .unwrap_err()
            .to_string();
        assert!(text.contains("rope axes [16, 56, 50]"), "{text}");
    }

    #[test]
    fn bfl_inference_reads_counts_widths_and_head_size() {
        let shapes = [
            ("img_in.weight", vec![64, 16]),
            ("txt_in.weight", vec![64, 24]),
            ("vector_in.in_layer.weight", vec![64, 20]),
            ("final_layer.linear.weight", vec![12, 64]),
            ("double_blocks.0.img_attn.norm.query_norm.scale", vec![32]),
            ("double_blocks.0.img_mlp.0.weight", vec![256, 64]),
            ("double_blocks.2.img_mlp.0.weight", vec![256, 64]),
            ("single_blocks.4.linear2.weight", vec![64, 320]),
            ("guidance_in.in_layer.weight", vec![64, 256]),
        ];
        let shape_of = |k: &str| shapes.iter().find(|(n, _)| *n == k).map(|(_, s)| s.clone());
        let config = FluxConfig::from_bfl_keys(
            Path::new("f.safetensors"),
            shapes.iter().map(|(k, _)| *k),
            shape_of,
        )
        .unwrap();
        assert_eq!(
            config,
            FluxConfig::new(16, 12, 20, 24, 64, 2, 3, 5, vec![4, 14, 14], true)
        );
        let missing =
            FluxConfig::from_bfl_keys(Path::new("f.safetensors"), std::iter::empty(), |_| None);
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .contains("`img_in.weight` is missing")
        );
    }
}
