//! CLIP text-encoder hyperparameters: the CLIP-L preset and transformers' `config.json`.

use std::path::Path;

use burn::config::Config;
use serde::{Deserialize, Serialize};

use crate::error::LoadError;
use crate::weights::{KeyShapes, numbered, read_json};

/// The activation of CLIP's MLPs (`hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClipActivation {
    /// `x · sigmoid(1.702 x)` (`quick_gelu`: OpenAI's CLIP-L).
    QuickGelu,
    /// The exact, erf-based GELU (`gelu`: OpenCLIP bigG).
    Gelu,
}

/// The shape of a CLIP text encoder. Field names follow transformers' `CLIPTextConfig`.
#[derive(Config, Debug, PartialEq)]
pub struct ClipTextConfig {
    /// Token vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Hidden width of the MLPs.
    pub intermediate_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Longest sequence (77).
    pub max_position_embeddings: usize,
    /// MLP activation.
    pub hidden_act: ClipActivation,
    /// Epsilon of the layer norms.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// The end-of-text id. The value 2 of older configs (FLUX.1's, SDXL's) means "the largest id
    /// of each row", which is the end-of-text token of CLIP's tokenizer; otherwise the pooled
    /// token is the first occurrence of this id.
    pub eos_token_id: u32,
    /// Width of the text projection of `CLIPTextModelWithProjection`, none for
    /// `CLIPTextModel`.
    pub projection_dim: Option<usize>,
}

impl ClipTextConfig {
    /// OpenAI's CLIP ViT-L/14 text encoder as FLUX.1 uses it (`CLIPTextModel`, no projection).
    pub fn clip_l() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            hidden_act: ClipActivation::QuickGelu,
            layer_norm_eps: 1e-5,
            eos_token_id: 2,
            projection_dim: None,
        }
    }

    /// OpenCLIP's ViT-bigG/14 text encoder as SDXL uses it (`text_encoder_2`,
    /// `CLIPTextModelWithProjection`: GELU, a 1280-wide projection of the pooled output).
    pub fn open_clip_big_g() -> Self {
        Self {
            hidden_size: 1280,
            intermediate_size: 5120,
            num_hidden_layers: 32,
            num_attention_heads: 20,
            hidden_act: ClipActivation::Gelu,
            projection_dim: Some(1280),
            ..Self::clip_l()
        }
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Checks that the sizes agree with each other.
    pub fn validate(&self) -> Result<(), String> {
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "hidden size {} is not a multiple of {} heads",
                self.hidden_size, self.num_attention_heads
            ));
        }
        Ok(())
    }

    /// Reads transformers' `text_encoder/config.json` (`CLIPTextModel` or
    /// `CLIPTextModelWithProjection`, told apart by `architectures`).
    pub fn from_json(file: &Path) -> Result<Self, LoadError> {
        let raw: TransformersClipConfig = read_json(file)?;
        let error = |message: String| LoadError::Config {
            file: file.to_path_buf(),
            message,
        };
        let hidden_act = match raw.hidden_act.as_str() {
            "quick_gelu" => ClipActivation::QuickGelu,
            "gelu" => ClipActivation::Gelu,
            other => {
                return Err(error(format!(
                    "hidden_act `{other}` is not supported (quick_gelu or gelu)"
                )));
            }
        };
        let with_projection = raw
            .architectures
            .iter()
            .any(|a| a == "CLIPTextModelWithProjection");
        let config = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            max_position_embeddings: raw.max_position_embeddings,
            hidden_act,
            layer_norm_eps: raw.layer_norm_eps,
            eos_token_id: raw.eos_token_id,
            projection_dim: with_projection.then_some(raw.projection_dim),
        };
        config.validate().map_err(error)?;
        Ok(config)
    }

    /// Infers the configuration of a single-file text encoder (ComfyUI's `clip_l.safetensors`)
    /// from its tensors (`names`, canonical: without the `text_model.` prefix, and their shapes).
    ///
    /// Sizes come from the shapes; what the shapes do not tell follows the two encoders such
    /// files hold: 64-wide heads, `quick_gelu` for OpenAI's 768-wide CLIP-L and `gelu` for
    /// OpenCLIP's wider bigG, FLUX.1's end-of-text rule, and no text projection (the pooled
    /// output FLUX.1 uses).
    pub fn from_keys<'a>(
        file: &Path,
        names: impl Iterator<Item = &'a str>,
        shape_of: impl Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<Self, LoadError> {
        let shapes = KeyShapes {
            file,
            model: "CLIP",
            shape_of,
        };
        let num_hidden_layers = numbered(names, "encoder.layers.");
        let [vocab_size, hidden_size] = shapes.matrix("embeddings.token_embedding.weight")?;
        let [max_position_embeddings, _] = shapes.matrix("embeddings.position_embedding.weight")?;
        let [intermediate_size, _] = shapes.matrix("encoder.layers.0.mlp.fc1.weight")?;
        if !hidden_size.is_multiple_of(CLIP_HEAD_DIM) {
            return Err(shapes.error(format!(
                "hidden size {hidden_size} is not a multiple of the {CLIP_HEAD_DIM}-wide heads of CLIP-L and bigG; use a folder with config.json"
            )));
        }
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads: hidden_size / CLIP_HEAD_DIM,
            max_position_embeddings,
            hidden_act: if hidden_size == 768 {
                ClipActivation::QuickGelu
            } else {
                ClipActivation::Gelu
            },
            layer_norm_eps: 1e-5,
            eos_token_id: 2,
            projection_dim: None,
        })
    }
}

/// Head width of the CLIP text encoders single files hold (CLIP-L, bigG).
const CLIP_HEAD_DIM: usize = 64;

/// The fields of transformers' `CLIPTextConfig` that the model uses (defaults are
/// transformers' own).
#[derive(Deserialize)]
struct TransformersClipConfig {
    #[serde(default)]
    architectures: Vec<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    max_position_embeddings: usize,
    hidden_act: String,
    #[serde(default = "layer_norm_eps")]
    layer_norm_eps: f64,
    #[serde(default = "eos_token_id")]
    eos_token_id: u32,
    #[serde(default = "projection_dim")]
    projection_dim: usize,
}

fn layer_norm_eps() -> f64 {
    1e-5
}
fn eos_token_id() -> u32 {
    49407
}
fn projection_dim() -> usize {
    512
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_activation_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(
            &file,
            r#"{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                "num_attention_heads": 2, "max_position_embeddings": 4, "hidden_act": "relu"}"#,
        )
        .unwrap();
        let error = ClipTextConfig::from_json(&file).unwrap_err().to_string();
        assert!(error.contains("hidden_act `relu`"), "{error}");
    }

    #[test]
    fn clip_l_has_64_wide_heads() {
        assert_eq!(ClipTextConfig::clip_l().head_dim(), 64);
    }

    /// The tensors of a CLIP text encoder of the given sizes: names and shapes.
    fn tensors(hidden: usize, layers: usize) -> Vec<(String, Vec<usize>)> {
        let mut t = vec![
            (
                "embeddings.token_embedding.weight".into(),
                vec![49408, hidden],
            ),
            (
                "embeddings.position_embedding.weight".into(),
                vec![77, hidden],
            ),
            ("final_layer_norm.weight".into(), vec![hidden]),
        ];
        for i in 0..layers {
            t.push((
                format!("encoder.layers.{i}.mlp.fc1.weight"),
                vec![4 * hidden, hidden],
            ));
            t.push((
                format!("encoder.layers.{i}.self_attn.q_proj.weight"),
                vec![hidden, hidden],
            ));
        }
        t
    }

    fn infer(tensors: &[(String, Vec<usize>)]) -> Result<ClipTextConfig, LoadError> {
        ClipTextConfig::from_keys(
            Path::new("clip_l.safetensors"),
            tensors.iter().map(|(n, _)| n.as_str()),
            |name| {
                tensors
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, s)| s.clone())
            },
        )
    }

    #[test]
    fn a_clip_l_file_gives_the_clip_l_config() {
        assert_eq!(infer(&tensors(768, 12)).unwrap(), ClipTextConfig::clip_l());
        let big_g = infer(&tensors(1280, 32)).unwrap();
        assert_eq!(
            (
                big_g.num_attention_heads,
                big_g.hidden_act,
                big_g.num_hidden_layers
            ),
            (20, ClipActivation::Gelu, 32)
        );
    }

    #[test]
    fn an_unknown_clip_file_is_an_error_naming_it() {
        let error = infer(&tensors(32, 2)).unwrap_err().to_string();
        assert!(
            error.contains("clip_l.safetensors") && error.contains("hidden size 32"),
            "{error}"
        );
        let missing = infer(&tensors(768, 12)[1..]).unwrap_err().to_string();
        assert!(
            missing.contains("embeddings.token_embedding.weight"),
            "{missing}"
        );
    }
}
