//! Errors of checkpoint loading and of the file-to-file forward pass.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while reading a checkpoint or an input file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file or folder could not be read.
    #[error("reading {file}")]
    Io {
        /// The file.
        file: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A safetensors file, shard index or FP8 payload could not be read.
    #[error(transparent)]
    Checkpoint(#[from] burn_quant::QuantError),
    /// A json file (config or shard index) could not be parsed.
    #[error("{file}: invalid json")]
    Json {
        /// The file.
        file: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// A path is neither a diffusers folder nor a single safetensors file.
    #[error("{path}: expected a diffusers folder (transformer/config.json) or a .safetensors file")]
    UnknownLayout {
        /// The path given.
        path: PathBuf,
    },
    /// The caller's placement of a weight (burn-offload's host memory) refused it.
    #[error("{file}: `{key}`: {source}")]
    Place {
        /// The checkpoint.
        file: PathBuf,
        /// The weight's name in the model.
        key: String,
        /// The placement's error.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The configuration is unusable or cannot be derived from the checkpoint.
    #[error("{file}: {message}")]
    Config {
        /// The config file or checkpoint.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor has a dtype that cannot be used where it is.
    #[error("{file}: `{key}` has dtype {dtype}, which cannot be read as a float tensor")]
    Dtype {
        /// The file.
        file: PathBuf,
        /// The tensor key.
        key: String,
        /// The dtype found.
        dtype: String,
    },
    /// Keys missing from the checkpoint, left over in it, or of the wrong shape; all of them at once.
    #[error("{file}: checkpoint does not match the model:{report}")]
    Keys {
        /// The checkpoint (file or folder).
        file: PathBuf,
        /// The keys, listed.
        report: KeyReport,
    },
    /// An input tensor is missing or has the wrong shape.
    #[error("{file}: input `{key}`: {message}")]
    Input {
        /// The input file.
        file: PathBuf,
        /// The input key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// The output file could not be written.
    #[error("writing {file}")]
    Write {
        /// The file.
        file: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A tokenizer cannot be built from its files, or failed on a caption.
    #[error("{file}: tokenizer: {message}")]
    Tokenizer {
        /// The tokenizer file or folder.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// An image file cannot be decoded.
    #[error("{file}: cannot decode the image")]
    Image {
        /// The image file.
        file: PathBuf,
        /// The cause.
        source: image::ImageError,
    },
}

/// The mismatches between a checkpoint and a model, collected before failing once.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct KeyReport {
    /// Keys the model needs that the checkpoint lacks.
    pub missing: Vec<String>,
    /// Keys of the checkpoint that the model does not use.
    pub unexpected: Vec<String>,
    /// Keys present with another shape.
    pub mismatched: Vec<ShapeMismatch>,
}

/// One tensor whose shape differs from what the model expects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShapeMismatch {
    /// The checkpoint key.
    pub key: String,
    /// The shape the model expects.
    pub expected: Vec<usize>,
    /// The shape in the checkpoint.
    pub found: Vec<usize>,
}

impl KeyReport {
    /// Whether nothing is missing, left over or mis-shaped.
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

impl fmt::Display for KeyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 24;
        fn list<T>(
            f: &mut fmt::Formatter<'_>,
            title: &str,
            items: &[T],
            show: impl Fn(&T) -> String,
        ) -> fmt::Result {
            if items.is_empty() {
                return Ok(());
            }
            write!(f, "\n  {title} ({}):", items.len())?;
            for item in items.iter().take(SHOWN) {
                write!(f, "\n    {}", show(item))?;
            }
            if items.len() > SHOWN {
                write!(f, "\n    ... and {} more", items.len() - SHOWN)?;
            }
            Ok(())
        }
        list(f, "missing", &self.missing, |k| format!("`{k}`"))?;
        list(f, "unexpected", &self.unexpected, |k| format!("`{k}`"))?;
        list(f, "wrong shape", &self.mismatched, |m| {
            format!("`{}` is {:?}, expected {:?}", m.key, m.found, m.expected)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_report_lists_every_kind_and_truncates() {
        let report = KeyReport {
            missing: (0..30)
                .map(|i| format!("double_blocks.{i}.img_mod.lin.weight"))
                .collect(),
            unexpected: vec!["extra.weight".into()],
            mismatched: vec![ShapeMismatch {
                key: "img_in.weight".into(),
                expected: vec![64, 3072],
                found: vec![3072, 64],
            }],
        };
        let text = LoadError::Keys {
            file: "model.safetensors".into(),
            report,
        }
        .to_string();
        assert!(text.starts_with("model.safetensors: checkpoint does not match the model:"));
        assert!(text.contains("missing (30):"));
        assert!(text.contains("`double_blocks.23.img_mod.lin.weight`"));
        assert!(!text.contains("`double_blocks.24.img_mod.lin.weight`"));
        assert!(text.contains("... and 6 more"));
        assert!(text.contains("unexpected (1):\n    `extra.weight`"));
        assert!(text.contains("`img_in.weight` is [3072, 64], expected [64, 3072]"));
    }
}
