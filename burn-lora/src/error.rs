//! The crate's error type.

use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while building plans, reading, writing, converting or loading
/// adapter files. Each variant names the file, key or pattern at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A file could not be read, created or renamed.
    #[error("{file}: {source}")]
    Io {
        /// The file.
        file: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// The safetensors container could not be parsed or written.
    #[error("{file}: {source}")]
    Safetensors {
        /// The file.
        file: PathBuf,
        /// The underlying error.
        source: safetensors::SafeTensorError,
    },
    /// A tensor has a dtype that adapters cannot hold.
    #[error("{file}: `{key}` has dtype {dtype}, expected F64, F32, F16 or BF16")]
    Dtype {
        /// The file.
        file: PathBuf,
        /// The tensor key.
        key: String,
        /// The dtype found.
        dtype: String,
    },
    /// A tensor does not have the shape its layer or its partner tensor requires.
    #[error("`{key}` is {found:?}, expected {expected:?}")]
    Shape {
        /// The tensor key.
        key: String,
        /// The shape required.
        expected: Vec<usize>,
        /// The shape found.
        found: Vec<usize>,
    },
    /// A file's adapter has another rank or kind than the adapter already attached to the layer.
    #[error("`{key}` holds {found}, but the layer already has {expected}")]
    Rank {
        /// The tensor key.
        key: String,
        /// The adapter already attached to the layer.
        expected: String,
        /// The adapter in the file.
        found: String,
    },
    /// An adapter lacks one of its tensors (a `lora_down` without `lora_up`, ...).
    #[error("{file}: `{key}` has no `{missing}` partner")]
    Incomplete {
        /// The file.
        file: PathBuf,
        /// The module key in the file.
        key: String,
        /// The suffix of the missing tensor.
        missing: String,
    },
    /// A metadata entry or a scalar tensor has a value that cannot be used.
    #[error("{file}: `{key}`: {reason}")]
    Metadata {
        /// The file.
        file: PathBuf,
        /// The metadata key or tensor key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A module pattern is not a valid regular expression.
    #[error("invalid module pattern `{pattern}`: {source}")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// The regex error.
        source: Box<regex::Error>,
    },
    /// An adapter configuration cannot be built.
    #[error("invalid adapter configuration: {0}")]
    Config(String),
    /// A kohya module name (dots turned into underscores) could not be turned back into a
    /// module path.
    #[error(
        "kohya module name `{key}` cannot be mapped back to a module path; resolve it with \
         `AdapterSet::resolve_names` and the model's module paths"
    )]
    UnresolvedName {
        /// The kohya module name.
        key: String,
    },
    /// Two module paths flatten to the same kohya name.
    #[error("kohya module name `{key}` matches both `{first}` and `{second}`")]
    AmbiguousName {
        /// The kohya module name.
        key: String,
        /// One matching module path.
        first: String,
        /// Another matching module path.
        second: String,
    },
    /// A name mapping cannot be applied to an adapter.
    #[error("`{key}`: {reason}")]
    Mapping {
        /// The module name.
        key: String,
        /// Why the mapping fails.
        reason: String,
    },
    /// A module has no name in the file layout being written: no target tool could load it.
    #[error("module `{module}` has no name in this file layout; no target tool would load it")]
    Unnamed {
        /// The module path.
        module: String,
    },
    /// A file holds adapters for layers the model does not have.
    #[error("the file has adapters for layers this model does not have: {}", modules.join(", "))]
    UnknownModules {
        /// The names as the file spells them.
        modules: Vec<String>,
    },
}
