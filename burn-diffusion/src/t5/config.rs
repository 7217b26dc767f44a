//! T5 encoder hyperparameters: the T5-XXL v1.1 and umT5-XXL presets and transformers'
//! `config.json`.

use std::path::Path;

use burn::config::Config;
use serde::Deserialize;

use crate::error::LoadError;
use crate::weights::{KeyShapes, numbered, read_json};

/// The shape of a T5 v1.1 encoder (gated-GELU feed-forward, relative position bias in the
/// first layer) or of a umT5 encoder (the same, with a relative position bias in every layer).
/// Field names follow transformers' `T5Config`.
#[derive(Config, Debug, PartialEq)]
pub struct T5Config {
    /// Token vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Width of one attention head.
    pub d_kv: usize,
    /// Hidden width of the feed-forward layers.
    pub d_ff: usize,
    /// Encoder layers.
    pub num_layers: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// Buckets of relative positions.
    #[config(default = 32)]
    pub relative_attention_num_buckets: usize,
    /// Relative distance from which every position shares the last bucket.
    #[config(default = 128)]
    pub relative_attention_max_distance: usize,
    /// Epsilon of the RMS norms.
    #[config(default = 1e-6)]
    pub layer_norm_epsilon: f64,
    /// Whether every layer holds a relative position bias of its own (umT5), rather than the
    /// first one a bias all layers share (T5).
    #[config(default = false)]
    pub position_bias_per_layer: bool,
}

impl T5Config {
    /// T5-XXL v1.1, the encoder of FLUX.1's `text_encoder_2` (4.76 B parameters).
    pub fn xxl() -> Self {
        Self {
            vocab_size: 32128,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            position_bias_per_layer: false,
        }
    }

    /// umT5-XXL's encoder, Wan 2.1 / 2.2's text encoder (5.68 B parameters).
    pub fn umt5_xxl() -> Self {
        Self {
            vocab_size: 256384,
            position_bias_per_layer: true,
            ..Self::xxl()
        }
    }

    /// Reads transformers' `config.json` of a T5 or umT5 (`model_type: "umt5"`) encoder; only
    /// the gated-GELU feed-forward (`feed_forward_proj: "gated-gelu"`, T5 v1.1) is supported.
    pub fn from_json(file: &Path) -> Result<Self, LoadError> {
        let raw: TransformersT5Config = read_json(file)?;
        if raw.feed_forward_proj != "gated-gelu" {
            return Err(LoadError::Config {
                file: file.to_path_buf(),
                message: format!(
                    "feed_forward_proj `{}` is not supported (T5 v1.1's gated-gelu)",
                    raw.feed_forward_proj
                ),
            });
        }
        Ok(Self {
            vocab_size: raw.vocab_size,
            d_model: raw.d_model,
            d_kv: raw.d_kv,
            d_ff: raw.d_ff,
            num_layers: raw.num_layers,
            num_heads: raw.num_heads,
            relative_attention_num_buckets: raw.relative_attention_num_buckets,
            relative_attention_max_distance: raw.relative_attention_max_distance,
            layer_norm_epsilon: raw.layer_norm_epsilon,
            position_bias_per_layer: raw.model_type == "umt5",
        })
    }

    /// Infers the configuration of a single file (ComfyUI's `t5xxl_*.safetensors`,
    /// `umt5_xxl_*.safetensors`) from the shapes of its tensors, named in transformers' layout:
    /// widths from the embedding and the first layer, heads and buckets from the relative
    /// position bias, layers from the block indices, umT5 from a bias in the second layer. The
    /// maximum distance (128) and epsilon (1e-6) are T5 v1.1's and umT5's.
    pub fn from_keys<'a>(
        file: &Path,
        names: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let shapes = KeyShapes {
            file,
            model: "T5",
            shape_of,
        };
        let names: Vec<&str> = names.collect();
        let num_layers = numbered(names.iter().copied(), "encoder.block.");
        let position_bias_per_layer =
            names.contains(&"encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight");
        let [vocab_size, d_model] = shapes.matrix("encoder.embed_tokens.weight")?;
        let first = "encoder.block.0.layer";
        let [buckets, num_heads] = shapes.matrix(&format!(
            "{first}.0.SelfAttention.relative_attention_bias.weight"
        ))?;
        let [inner, _] = shapes.matrix(&format!("{first}.0.SelfAttention.q.weight"))?;
        let [d_ff, _] = shapes.matrix(&format!("{first}.1.DenseReluDense.wi_0.weight"))?;
        if num_heads == 0 || !inner.is_multiple_of(num_heads) {
            return Err(shapes.error(format!(
                "query width {inner} is not a multiple of {num_heads} heads"
            )));
        }
        Ok(Self {
            vocab_size,
            d_model,
            d_kv: inner / num_heads,
            d_ff,
            num_layers,
            num_heads,
            relative_attention_num_buckets: buckets,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            position_bias_per_layer,
        })
    }
}

/// The fields of transformers' `T5Config` that the encoder uses (defaults are transformers'
/// own).
#[derive(Deserialize)]
struct TransformersT5Config {
    vocab_size: usize,
    d_model: usize,
    d_kv: usize,
    d_ff: usize,
    num_layers: usize,
    num_heads: usize,
    #[serde(default = "buckets")]
    relative_attention_num_buckets: usize,
    #[serde(default = "max_distance")]
    relative_attention_max_distance: usize,
    #[serde(default = "epsilon")]
    layer_norm_epsilon: f64,
    #[serde(default = "relu")]
    feed_forward_proj: String,
    #[serde(default)]
    model_type: String,
}

fn buckets() -> usize {
    32
}
fn max_distance() -> usize {
    128
}
fn epsilon() -> f64 {
    1e-6
}
fn relu() -> String {
    "relu".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn original_t5_feed_forward_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(
            &file,
            r#"{"vocab_size": 10, "d_model": 8, "d_kv": 4, "d_ff": 16, "num_layers": 1, "num_heads": 2}"#,
        )
        .unwrap();
        let error = T5Config::from_json(&file).unwrap_err().to_string();
        assert!(error.contains("feed_forward_proj `relu`"), "{error}");
    }
}
