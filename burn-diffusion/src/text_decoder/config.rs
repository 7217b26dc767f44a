//! Decoder hyperparameters: presets of the checkpoints FLUX.2 uses, transformers' `config.json`,
//! and inference from a single file's tensor shapes.

use std::path::Path;

use burn::config::Config;
use serde::Deserialize;

use crate::error::LoadError;
use crate::weights::{KeyShapes, numbered, read_json};

/// The shape of a Llama-family decoder (pre-norm layers of grouped-query attention with rotary
/// positions and a SiLU-gated feed-forward, RMS norms, no biases), with or without Qwen3's RMS
/// norm of every query and key head. Field names follow transformers' `MistralConfig` /
/// `Qwen3Config`.
#[derive(Config, Debug, PartialEq)]
pub struct TextDecoderConfig {
    /// Token vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Hidden width of the feed-forward layers.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads, each shared by `num_attention_heads / num_key_value_heads` queries.
    pub num_key_value_heads: usize,
    /// Width of one head (not always `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// Base of the rotary frequencies.
    pub rope_theta: f64,
    /// Epsilon of the RMS norms.
    pub rms_norm_eps: f64,
    /// Whether each query and key head is RMS-normed before the rotation (Qwen3).
    pub qk_norm: bool,
    /// Whether the model ends with a norm (`norm.weight`); files cut after the last layer FLUX.2
    /// reads have none.
    #[config(default = true)]
    pub final_norm: bool,
}

/// Head width assumed for a single file without per-head norms, whose shapes do not tell it:
/// Mistral Small 3's and Llama 3's.
const DEFAULT_HEAD_DIM: usize = 128;

impl TextDecoderConfig {
    /// Mistral-Small-3.1/3.2-24B's language model, FLUX.2-dev's `text_encoder` (40 layers of
    /// width 5120, 32 query and 8 key-value heads of 128).
    pub fn mistral_small_3() -> Self {
        Self {
            vocab_size: 131072,
            hidden_size: 5120,
            intermediate_size: 32768,
            num_hidden_layers: 40,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rope_theta: 1e9,
            rms_norm_eps: 1e-5,
            qk_norm: false,
            final_norm: true,
        }
    }

    /// Qwen3-4B, FLUX.2-klein-4B's `text_encoder` (36 layers of width 2560).
    pub fn qwen3_4b() -> Self {
        Self {
            vocab_size: 151936,
            hidden_size: 2560,
            intermediate_size: 9728,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rope_theta: 1e6,
            rms_norm_eps: 1e-6,
            qk_norm: true,
            final_norm: true,
        }
    }

    /// Qwen3-8B, FLUX.2-klein-9B's `text_encoder` (36 layers of width 4096).
    pub fn qwen3_8b() -> Self {
        Self {
            hidden_size: 4096,
            intermediate_size: 12288,
            ..Self::qwen3_4b()
        }
    }

    /// Reads transformers' `config.json` of a `MistralForCausalLM`, `Qwen3ForCausalLM`,
    /// `LlamaForCausalLM` or `Mistral3ForConditionalGeneration` (whose language model is its
    /// `text_config`). Rope scaling and sliding-window attention are refused by name.
    pub fn from_json(file: &Path) -> Result<Self, LoadError> {
        let outer: TransformersConfig = read_json(file)?;
        let raw = match outer.text_config {
            Some(text) => *text,
            None => outer,
        };
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        let model_type = raw.model_type.clone().unwrap_or_default();
        let qk_norm = match model_type.as_str() {
            "qwen3" => true,
            "mistral" | "llama" => false,
            other => {
                return Err(error(format!(
                    "model_type `{other}` is not supported (mistral, qwen3, llama)"
                )));
            }
        };
        let rope = raw.rope_parameters.as_ref();
        let rope_type = rope
            .and_then(|r| r.rope_type.clone())
            .or_else(|| raw.rope_scaling.as_ref().and_then(|r| r.rope_type.clone()))
            .unwrap_or_else(|| "default".into());
        if rope_type != "default" {
            return Err(error(format!("rope_type `{rope_type}` is not supported")));
        }
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .ok_or_else(|| error("no rope_theta".into()))?;
        let sliding = match model_type.as_str() {
            "qwen3" => raw.use_sliding_window.unwrap_or(false),
            _ => raw.sliding_window.is_some(),
        };
        if sliding {
            return Err(error("sliding-window attention is not supported".into()));
        }
        let heads = raw.num_attention_heads;
        Ok(Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(heads),
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / heads.max(1)),
            rope_theta,
            rms_norm_eps: raw.rms_norm_eps,
            qk_norm,
            final_norm: true,
        })
    }

    /// Infers the configuration of a single file (ComfyUI's `mistral_3_small_flux2_*` or
    /// `qwen_3_*` files) from its tensors, named without prefix (`layers.0.self_attn.q_proj.weight`):
    /// widths from the embedding and the first layer, layers from the layer indices, the final
    /// norm from its presence. With per-head norms the file is a Qwen3 (head width from the norm,
    /// rope theta 1e6, epsilon 1e-6); without, a Mistral Small 3 (heads of 128, rope theta 1e9,
    /// epsilon 1e-5).
    pub fn from_keys<'a>(
        file: &Path,
        names: impl Iterator<Item = &'a str> + Clone,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let shapes = KeyShapes {
            file,
            model: "text decoder",
            shape_of,
        };
        let num_hidden_layers = numbered(names.clone(), "layers.");
        let final_norm = names.clone().any(|name| name == "norm.weight");
        let [vocab_size, hidden_size] = shapes.matrix("embed_tokens.weight")?;
        let first = "layers.0";
        let [query, _] = shapes.matrix(&format!("{first}.self_attn.q_proj.weight"))?;
        let [key, _] = shapes.matrix(&format!("{first}.self_attn.k_proj.weight"))?;
        let [intermediate_size, _] = shapes.matrix(&format!("{first}.mlp.gate_proj.weight"))?;
        let q_norm = format!("{first}.self_attn.q_norm.weight");
        let qk_norm = names.clone().any(|name| name == q_norm);
        let (head_dim, rope_theta, rms_norm_eps) = if qk_norm {
            (shapes.shape(&q_norm, 1)?[0], 1e6, 1e-6)
        } else {
            (DEFAULT_HEAD_DIM, 1e9, 1e-5)
        };
        if head_dim == 0 || !query.is_multiple_of(head_dim) || !key.is_multiple_of(head_dim) {
            return Err(shapes.error(format!(
                "query width {query} and key width {key} are not multiples of heads of {head_dim}"
            )));
        }
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads: query / head_dim,
            num_key_value_heads: key / head_dim,
            head_dim,
            rope_theta,
            rms_norm_eps,
            qk_norm,
            final_norm,
        })
    }
}

/// The fields of transformers' decoder configs that the model uses; a multimodal config nests
/// them in `text_config`.
#[derive(Deserialize)]
struct TransformersConfig {
    #[serde(default)]
    text_config: Option<Box<TransformersConfig>>,
    #[serde(default)]
    model_type: Option<String>,
    #[serde(default)]
    vocab_size: usize,
    #[serde(default)]
    hidden_size: usize,
    #[serde(default)]
    intermediate_size: usize,
    #[serde(default)]
    num_hidden_layers: usize,
    #[serde(default)]
    num_attention_heads: usize,
    #[serde(default)]
    num_key_value_heads: Option<usize>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default = "epsilon")]
    rms_norm_eps: f64,
    /// transformers 4's place of the rope base.
    #[serde(default)]
    rope_theta: Option<f64>,
    /// transformers 4's rope scaling.
    #[serde(default)]
    rope_scaling: Option<RopeParameters>,
    /// transformers 5's rope base and type.
    #[serde(default)]
    rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    sliding_window: Option<usize>,
    #[serde(default)]
    use_sliding_window: Option<bool>,
}

#[derive(Deserialize)]
struct RopeParameters {
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default)]
    rope_theta: Option<f64>,
}

fn epsilon() -> f64 {
    1e-6
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<TextDecoderConfig, LoadError> {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, json).unwrap();
        TextDecoderConfig::from_json(&file)
    }

    #[test]
    fn transformers_4_mistral3_config_gives_the_preset() {
        let config = parse(
            r#"{"model_type": "mistral3", "text_config": {"model_type": "mistral",
            "vocab_size": 131072, "hidden_size": 5120, "intermediate_size": 32768,
            "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0,
            "sliding_window": null}}"#,
        )
        .unwrap();
        assert_eq!(config, TextDecoderConfig::mistral_small_3());
    }

    #[test]
    fn qwen3_config_gives_the_preset() {
        let config = parse(
            r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0, "sliding_window": null, "use_sliding_window": false}"#,
        )
        .unwrap();
        assert_eq!(config, TextDecoderConfig::qwen3_8b());
    }

    #[test]
    fn rope_scaling_and_sliding_windows_are_refused_by_name() {
        let base = r#""vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rope_theta": 10000.0"#;
        let error = parse(&format!(
            r#"{{"model_type": "llama", {base}, "rope_scaling": {{"rope_type": "llama3"}}}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(error.contains("rope_type `llama3`"), "{error}");
        let error = parse(&format!(
            r#"{{"model_type": "mistral", {base}, "sliding_window": 4096}}"#
        ))
        .unwrap_err()
        .to_string();
        assert!(error.contains("sliding-window"), "{error}");
        let error = parse(&format!(r#"{{"model_type": "gemma3", {base}}}"#))
            .unwrap_err()
            .to_string();
        assert!(error.contains("model_type `gemma3`"), "{error}");
    }
}
