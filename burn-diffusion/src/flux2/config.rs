//! FLUX.2 hyperparameters: the presets, diffusers' `config.json`, and inference from the tensor
//! shapes of a BFL file.

use std::path::Path;

use burn::config::Config;
use serde::Deserialize;

use crate::error::LoadError;
use crate::flux::{BflBlocks, check_heads, read_diffusers_json};

/// The shape of a FLUX.2 transformer. Field names follow BFL's; the diffusers name of each is
/// given where it differs.
#[derive(Config, Debug, PartialEq)]
pub struct Flux2Config {
    /// Channels of an image token (`in_channels`; 128 = 32 latent channels × 2 × 2 patch).
    pub in_channels: usize,
    /// Channels of an output token (`out_channels`).
    pub out_channels: usize,
    /// Width of a text token (`joint_attention_dim`; three stacked hidden states of the text
    /// encoder).
    pub context_in_dim: usize,
    /// Width of the residual stream (`num_attention_heads × attention_head_dim`).
    pub hidden_size: usize,
    /// Hidden width of the SwiGLU MLPs relative to `hidden_size`.
    #[config(default = 3.0)]
    pub mlp_ratio: f64,
    /// Attention heads (`num_attention_heads`).
    pub num_heads: usize,
    /// Double-stream blocks (`num_layers`).
    pub depth: usize,
    /// Single-stream blocks (`num_single_layers`).
    pub depth_single_blocks: usize,
    /// Rotary widths per position axis `(t, h, w, l)`, summing to the head size
    /// (`axes_dims_rope`).
    pub axes_dim: Vec<usize>,
    /// Rotary base (`rope_theta`).
    #[config(default = 2000.0)]
    pub theta: f64,
    /// Whether the model embeds a guidance strength (`guidance_embeds`; dev yes, klein no).
    pub guidance_embed: bool,
}

impl Flux2Config {
    /// FLUX.2-dev: 8 double and 48 single blocks of width 6144, 48 heads, guidance embedding,
    /// text from Mistral-Small's 3 × 5120 stacked states (32.2 B parameters).
    pub fn dev() -> Self {
        Self::new(128, 128, 15360, 6144, 48, 8, 48, vec![32; 4], true)
    }

    /// FLUX.2-klein 4B: 5 double and 20 single blocks of width 3072, 24 heads, no guidance
    /// embedding, text from Qwen3-4B's 3 × 2560 stacked states.
    pub fn klein_4b() -> Self {
        Self::new(128, 128, 7680, 3072, 24, 5, 20, vec![32; 4], false)
    }

    /// FLUX.2-klein 9B: 8 double and 24 single blocks of width 4096, 32 heads, no guidance
    /// embedding, text from Qwen3-8B's 3 × 4096 stacked states.
    pub fn klein_9b() -> Self {
        Self::new(128, 128, 12288, 4096, 32, 8, 24, vec![32; 4], false)
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Hidden width of the MLPs (the width the SwiGLU gate and value each have).
    pub fn mlp_hidden_dim(&self) -> usize {
        (self.hidden_size as f64 * self.mlp_ratio) as usize
    }

    /// Checks that the sizes agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        check_heads(self.hidden_size, self.num_heads, &self.axes_dim)
    }

    /// Reads diffusers' `transformer/config.json` (`Flux2Transformer2DModel`).
    pub fn from_diffusers_json(file: &Path) -> Result<Self, LoadError> {
        let raw: DiffusersConfig = read_diffusers_json(file, "Flux2Transformer2DModel")?;
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        if raw.eps != 1e-6 {
            return Err(error(format!(
                "eps {} is not supported (FLUX.2 uses 1e-6)",
                raw.eps
            )));
        }
        let config = Self {
            in_channels: raw.in_channels,
            out_channels: raw.out_channels.unwrap_or(raw.in_channels),
            context_in_dim: raw.joint_attention_dim,
            hidden_size: raw.num_attention_heads * raw.attention_head_dim,
            mlp_ratio: raw.mlp_ratio,
            num_heads: raw.num_attention_heads,
            depth: raw.num_layers,
            depth_single_blocks: raw.num_single_layers,
            axes_dim: raw.axes_dims_rope,
            theta: raw.rope_theta,
            guidance_embed: raw.guidance_embeds,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }

    /// Infers the configuration of a BFL-layout checkpoint from its keys and shapes: block
    /// counts from the `double_blocks.N` / `single_blocks.N` indices, widths from the input
    /// projections, the head size from the length of the query-norm scale, the MLP width from
    /// the first MLP (or the single blocks' fused projection), guidance from `guidance_in`.
    /// BFL files do not record the rotary axes: four equal ones (FLUX.2's 4 × 32 for heads of
    /// 128), θ = 2000.
    pub fn from_bfl_keys<'a>(
        file: &Path,
        keys: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        let dims = |key: &str| -> Result<Vec<usize>, LoadError> {
            shape_of(key).ok_or_else(|| {
                error(format!(
                    "cannot infer the FLUX.2 config: `{key}` is missing"
                ))
            })
        };
        let blocks = BflBlocks::count(keys);
        let img_in = dims("img_in.weight")?;
        let [hidden, in_channels] = img_in[..] else {
            return Err(error(format!(
                "`img_in.weight` is {img_in:?}, expected rank 2"
            )));
        };
        let head_dim = if blocks.double == 0 {
            dims("single_blocks.0.norm.query_norm.scale")?[0]
        } else {
            dims("double_blocks.0.img_attn.norm.query_norm.scale")?[0]
        };
        let mlp_hidden = if blocks.double == 0 {
            dims("single_blocks.0.linear1.weight")?[0].saturating_sub(3 * hidden) / 2
        } else {
            dims("double_blocks.0.img_mlp.0.weight")?[0] / 2
        };
        if head_dim == 0 || !hidden.is_multiple_of(head_dim) || head_dim % 8 != 0 {
            return Err(error(format!(
                "head size {head_dim} does not divide the width {hidden} into four even rotary axes"
            )));
        }
        let config = Self {
            in_channels,
            out_channels: dims("final_layer.linear.weight")?[0],
            context_in_dim: dims("txt_in.weight")?[1],
            hidden_size: hidden,
            mlp_ratio: mlp_hidden as f64 / hidden as f64,
            num_heads: hidden / head_dim,
            depth: blocks.double,
            depth_single_blocks: blocks.single,
            axes_dim: vec![head_dim / 4; 4],
            theta: 2000.0,
            guidance_embed: blocks.guidance,
        };
        config.validate().map_err(error)?;
        Ok(config)
    }
}

/// The fields of diffusers' `Flux2Transformer2DModel` config, with its defaults.
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
    #[serde(default = "d_mlp_ratio")]
    mlp_ratio: f64,
    #[serde(default = "d_axes_dims_rope")]
    axes_dims_rope: Vec<usize>,
    #[serde(default = "d_rope_theta")]
    rope_theta: f64,
    #[serde(default = "d_eps")]
    eps: f64,
    #[serde(default = "yes")]
    guidance_embeds: bool,
}

fn d_in_channels() -> usize {
    128
}
fn d_num_layers() -> usize {
    8
}
fn d_num_single_layers() -> usize {
    48
}
fn d_attention_head_dim() -> usize {
    128
}
fn d_num_attention_heads() -> usize {
    48
}
fn d_joint_attention_dim() -> usize {
    15360
}
fn d_mlp_ratio() -> f64 {
    3.0
}
fn d_axes_dims_rope() -> Vec<usize> {
    vec![32; 4]
}
fn d_rope_theta() -> f64 {
    2000.0
}
fn d_eps() -> f64 {
    1e-6
}
fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_published_sizes() {
        for (config, heads, hidden) in [
            (Flux2Config::dev(), 48, 6144),
            (Flux2Config::klein_4b(), 24, 3072),
            (Flux2Config::klein_9b(), 32, 4096),
        ] {
            config.validate().unwrap();
            assert_eq!((config.num_heads, config.hidden_size), (heads, hidden));
            assert_eq!(config.head_dim(), 128);
            assert_eq!(config.mlp_hidden_dim(), 3 * hidden);
        }
    }
}
