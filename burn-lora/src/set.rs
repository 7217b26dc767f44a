//! Adapters held on the host, in file layout, independent of any backend: what files are read
//! into, written from, converted and renamed as.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use burn::tensor::{DType, TensorData};

use crate::LoraError;

/// One tensor of an adapter, named by its role. Each role has a key suffix per naming style.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// LoRA `A`, `lora_down` (`[rank, in]`, conv `[rank, in, kh, kw]`).
    Down,
    /// LoRA `B`, `lora_up` (`[out, rank]`, conv `[out, rank, 1, 1]`).
    Up,
    /// The scalar alpha.
    Alpha,
    /// LoKr first factor `[out₁, in₁]`.
    W1,
    /// LoKr second factor, full (`[out₂, in₂]`, conv `[out₂, in₂, kh, kw]`).
    W2,
    /// LoKr second factor, left low-rank part `[out₂, rank]`.
    W2A,
    /// LoKr second factor, right low-rank part (`[rank, in₂]`, conv `[rank, in₂·kh·kw]`).
    W2B,
}

impl Role {
    /// The key suffix in kohya / LyCORIS files.
    pub fn kohya_suffix(self) -> &'static str {
        match self {
            Self::Down => ".lora_down.weight",
            Self::Up => ".lora_up.weight",
            other => other.shared_suffix(),
        }
    }

    /// The key suffix in PEFT / diffusers files.
    pub fn peft_suffix(self) -> &'static str {
        match self {
            Self::Down => ".lora_A.weight",
            Self::Up => ".lora_B.weight",
            other => other.shared_suffix(),
        }
    }

    fn shared_suffix(self) -> &'static str {
        match self {
            Self::Alpha => ".alpha",
            Self::W1 => ".lokr_w1",
            Self::W2 => ".lokr_w2",
            Self::W2A => ".lokr_w2_a",
            Self::W2B => ".lokr_w2_b",
            Self::Down | Self::Up => unreachable!("LoRA roles have style-specific suffixes"),
        }
    }

    /// Splits a file key into its module key and role, whatever the naming style.
    pub fn split_key(key: &str) -> Option<(&str, Role)> {
        const ALL: [Role; 7] = [
            Role::Down,
            Role::Up,
            Role::Alpha,
            Role::W1,
            Role::W2,
            Role::W2A,
            Role::W2B,
        ];
        ALL.iter().find_map(|&role| {
            [role.kohya_suffix(), role.peft_suffix()]
                .into_iter()
                .find_map(|suffix| key.strip_suffix(suffix))
                .map(|module| (module, role))
        })
    }
}

/// The second LoKr factor.
#[derive(Clone, Debug, PartialEq)]
pub enum LokrFactor {
    /// A full matrix (`lokr_w2`).
    Full(TensorData),
    /// `w2_a · w2_b` (`lokr_w2_a`, `lokr_w2_b`).
    LowRank {
        /// `[out₂, rank]`.
        a: TensorData,
        /// `[rank, in₂]` or, for a conv, `[rank, in₂·kh·kw]`.
        b: TensorData,
    },
}

/// One adapter on the host, in the layout files use (PyTorch orientation).
#[derive(Clone, Debug, PartialEq)]
pub enum StoredAdapter {
    /// LoRA / LoCon: `ΔW = alpha / rank · up · down`.
    Lora {
        /// `[rank, in]` or `[rank, in, kh, kw]`.
        down: TensorData,
        /// `[out, rank]` or `[out, rank, 1, 1]`.
        up: TensorData,
        /// The alpha; the scale is `alpha / rank`.
        alpha: f32,
    },
    /// LoKr: `ΔW = scale · w1 ⊗ w2`, scale `alpha / rank` for a low-rank `w2`, else 1.
    Lokr {
        /// `[out₁, in₁]`.
        w1: TensorData,
        /// The second factor.
        w2: LokrFactor,
        /// The alpha (used only with a low-rank `w2`).
        alpha: f32,
    },
}

impl StoredAdapter {
    /// The rank: rows of `down`, columns of `w2_a`, or `None` for a full-factor LoKr.
    pub fn rank(&self) -> Option<usize> {
        match self {
            Self::Lora { down, .. } => Some(down.shape[0]),
            Self::Lokr {
                w2: LokrFactor::LowRank { b, .. },
                ..
            } => Some(b.shape[0]),
            Self::Lokr { .. } => None,
        }
    }

    /// The stored alpha.
    pub fn alpha(&self) -> f32 {
        match self {
            Self::Lora { alpha, .. } | Self::Lokr { alpha, .. } => *alpha,
        }
    }

    /// The factor applied to the raw product of the factors.
    pub fn scale(&self) -> f64 {
        match self.rank() {
            Some(rank) => self.alpha() as f64 / rank as f64,
            None => 1.0,
        }
    }

    /// The tensors with their roles, alpha excluded.
    pub fn tensors(&self) -> Vec<(Role, &TensorData)> {
        match self {
            Self::Lora { down, up, .. } => vec![(Role::Down, down), (Role::Up, up)],
            Self::Lokr { w1, w2, .. } => match w2 {
                LokrFactor::Full(w2) => vec![(Role::W1, w1), (Role::W2, w2)],
                LokrFactor::LowRank { a, b } => {
                    vec![(Role::W1, w1), (Role::W2A, a), (Role::W2B, b)]
                }
            },
        }
    }

    /// A short description such as `LoRA rank 16` or `LoKr w1 [4, 8], w2 [16, 32]`.
    pub fn describe(&self) -> String {
        match self {
            Self::Lora { down, .. } => format!("LoRA rank {}", down.shape[0]),
            Self::Lokr { w1, w2, .. } => match w2 {
                LokrFactor::Full(w2) => {
                    format!(
                        "LoKr w1 {:?}, w2 {:?}",
                        w1.shape.to_vec(),
                        w2.shape.to_vec()
                    )
                }
                LokrFactor::LowRank { a, b } => format!(
                    "LoKr w1 {:?}, w2 rank {} ({:?}·{:?})",
                    w1.shape.to_vec(),
                    b.shape[0],
                    a.shape.to_vec(),
                    b.shape.to_vec()
                ),
            },
        }
    }

    /// The `[out, in·kh·kw]` update `scale · product`, in f64, row-major.
    ///
    /// This is the weight change the adapter makes at multiplier 1; tests and tools compare
    /// adapters through it.
    pub fn delta(&self) -> (usize, usize, Vec<f64>) {
        let (rows, cols, raw) = match self {
            Self::Lora { down, up, .. } => {
                let (d, u) = (Matrix::from_data(down), Matrix::from_data(up));
                let p = u.matmul(&d);
                (p.rows, p.cols, p.values)
            }
            Self::Lokr { w1, w2, .. } => {
                let w1 = Matrix::from_data(w1);
                let w2 = match w2 {
                    LokrFactor::Full(w2) => Matrix::from_data(w2),
                    LokrFactor::LowRank { a, b } => {
                        Matrix::from_data(a).matmul(&Matrix::from_data(b))
                    }
                };
                let k = w1.kron(&w2);
                (k.rows, k.cols, k.values)
            }
        };
        let scale = self.scale();
        (rows, cols, raw.into_iter().map(|v| v * scale).collect())
    }

    /// The same adapter with every tensor converted to `dtype`.
    pub fn with_dtype(&self, dtype: DType) -> Self {
        let cast = |t: &TensorData| t.clone().convert_dtype(dtype);
        match self {
            Self::Lora { down, up, alpha } => Self::Lora {
                down: cast(down),
                up: cast(up),
                alpha: *alpha,
            },
            Self::Lokr { w1, w2, alpha } => Self::Lokr {
                w1: cast(w1),
                w2: match w2 {
                    LokrFactor::Full(w2) => LokrFactor::Full(cast(w2)),
                    LokrFactor::LowRank { a, b } => LokrFactor::LowRank {
                        a: cast(a),
                        b: cast(b),
                    },
                },
                alpha: *alpha,
            },
        }
    }

    /// Number of weights (alpha excluded).
    pub fn num_params(&self) -> usize {
        self.tensors().iter().map(|(_, t)| t.num_elements()).sum()
    }
}

/// A row-major f64 matrix for host-side arithmetic on adapters (deltas, fusing, splitting).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub values: Vec<f64>,
}

impl Matrix {
    /// Reads a tensor as `[shape[0], product of the rest]`.
    pub fn from_data(data: &TensorData) -> Self {
        let rows = data.shape.first().copied().unwrap_or(1);
        let cols = data.shape.iter().skip(1).product();
        let values = data
            .clone()
            .convert_dtype(DType::F64)
            .into_vec::<f64>()
            .expect("converted to f64");
        Self { rows, cols, values }
    }

    pub fn zeros(rows: usize, cols: usize) -> Self {
        Self {
            rows,
            cols,
            values: vec![0.0; rows * cols],
        }
    }

    pub fn at(&self, r: usize, c: usize) -> f64 {
        self.values[r * self.cols + c]
    }

    pub fn matmul(&self, other: &Matrix) -> Matrix {
        assert_eq!(self.cols, other.rows, "inner dimensions");
        let mut out = Matrix::zeros(self.rows, other.cols);
        for i in 0..self.rows {
            for k in 0..self.cols {
                let a = self.at(i, k);
                if a == 0.0 {
                    continue;
                }
                let row = &other.values[k * other.cols..(k + 1) * other.cols];
                let dst = &mut out.values[i * other.cols..(i + 1) * other.cols];
                for (d, b) in dst.iter_mut().zip(row) {
                    *d += a * b;
                }
            }
        }
        out
    }

    /// The Kronecker product `self ⊗ other`.
    pub fn kron(&self, other: &Matrix) -> Matrix {
        let mut out = Matrix::zeros(self.rows * other.rows, self.cols * other.cols);
        for a in 0..self.rows {
            for c in 0..self.cols {
                let x = self.at(a, c);
                for b in 0..other.rows {
                    for d in 0..other.cols {
                        out.values[(a * other.rows + b) * out.cols + c * other.cols + d] =
                            x * other.at(b, d);
                    }
                }
            }
        }
        out
    }

    /// Rows `start..start + len`.
    pub fn rows_range(&self, start: usize, len: usize) -> Matrix {
        Matrix {
            rows: len,
            cols: self.cols,
            values: self.values[start * self.cols..(start + len) * self.cols].to_vec(),
        }
    }

    /// The block `rows r0..r0+nr`, `cols c0..c0+nc`.
    pub fn block(&self, r0: usize, nr: usize, c0: usize, nc: usize) -> Matrix {
        let mut values = Vec::with_capacity(nr * nc);
        for r in r0..r0 + nr {
            values.extend_from_slice(&self.values[r * self.cols + c0..r * self.cols + c0 + nc]);
        }
        Matrix {
            rows: nr,
            cols: nc,
            values,
        }
    }

    /// Writes `block` at `(r0, c0)`.
    pub fn set_block(&mut self, r0: usize, c0: usize, block: &Matrix) {
        for r in 0..block.rows {
            let dst = (r0 + r) * self.cols + c0;
            self.values[dst..dst + block.cols]
                .copy_from_slice(&block.values[r * block.cols..(r + 1) * block.cols]);
        }
    }

    pub fn scaled(mut self, factor: f64) -> Matrix {
        self.values.iter_mut().for_each(|v| *v *= factor);
        self
    }

    /// Converts back to a tensor of `dtype` and `shape` (same number of elements).
    pub fn into_data(self, shape: Vec<usize>, dtype: DType) -> TensorData {
        assert_eq!(shape.iter().product::<usize>(), self.values.len());
        TensorData::new(self.values, shape).convert_dtype(dtype)
    }
}

/// File-level information carried along with the adapters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraMetadata {
    /// The base model the adapters were trained on.
    pub base_model: Option<String>,
    /// The training step the adapters were saved at.
    pub step: Option<u64>,
    /// Other metadata entries, kept through conversions.
    pub extra: BTreeMap<String, String>,
}

/// Where a set was read from, to name keys in errors the way the file spells them.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Origin {
    pub file: PathBuf,
    pub kohya: bool,
    pub prefix: String,
}

/// A collection of adapters keyed by module name, with file metadata.
///
/// Names are module paths with dots (`double_blocks.0.img_attn.qkv`), except in sets read from
/// kohya files written by other tools, where dots were turned into underscores
/// (`double_blocks_0_img_attn_qkv`); [`AdapterSet::resolve_names`] turns those back into paths.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AdapterSet {
    adapters: BTreeMap<String, StoredAdapter>,
    flat_names: bool,
    /// File metadata.
    pub metadata: LoraMetadata,
    pub(crate) origin: Option<Origin>,
    pub(crate) unrecognized: Vec<String>,
}

impl AdapterSet {
    /// An empty set.
    pub fn new(metadata: LoraMetadata) -> Self {
        Self {
            metadata,
            ..Self::default()
        }
    }

    pub(crate) fn with_flat_names(mut self, flat: bool) -> Self {
        self.flat_names = flat;
        self
    }

    /// Adds or replaces the adapter of module `name`.
    pub fn insert(&mut self, name: impl Into<String>, adapter: StoredAdapter) {
        self.adapters.insert(name.into(), adapter);
    }

    /// The adapter of module `name`.
    pub fn get(&self, name: &str) -> Option<&StoredAdapter> {
        self.adapters.get(name)
    }

    /// Removes and returns the adapter of module `name`.
    pub fn remove(&mut self, name: &str) -> Option<StoredAdapter> {
        self.adapters.remove(name)
    }

    /// Adapters in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &StoredAdapter)> {
        self.adapters.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Number of adapters.
    pub fn len(&self) -> usize {
        self.adapters.len()
    }

    /// Whether the set holds no adapter.
    pub fn is_empty(&self) -> bool {
        self.adapters.is_empty()
    }

    /// The same set with every weight converted to `dtype` (adapters load in their file's
    /// dtype; convert first to train a bf16 file in f32, for example).
    pub fn with_dtype(mut self, dtype: DType) -> Self {
        for adapter in self.adapters.values_mut() {
            *adapter = adapter.with_dtype(dtype);
        }
        self
    }

    /// Total number of adapter weights.
    pub fn num_params(&self) -> usize {
        self.adapters.values().map(StoredAdapter::num_params).sum()
    }

    /// Whether names are kohya names with underscores that still need
    /// [`resolve_names`](Self::resolve_names).
    pub fn has_flat_names(&self) -> bool {
        self.flat_names
    }

    /// File keys that were not recognised as adapter tensors when the set was read.
    pub fn unrecognized_keys(&self) -> &[String] {
        &self.unrecognized
    }

    /// Renames kohya names (`a_0_b`) to the module paths (`a.0.b`) they flatten from.
    ///
    /// Every name must match exactly one path.
    pub fn resolve_names<'a>(
        &mut self,
        module_paths: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), LoraError> {
        if !self.flat_names {
            return Ok(());
        }
        let mut by_flat: BTreeMap<String, &str> = BTreeMap::new();
        for path in module_paths {
            let flat = flatten_name(path);
            if let Some(first) = by_flat.insert(flat.clone(), path)
                && first != path
            {
                return Err(LoraError::AmbiguousName {
                    key: flat,
                    first: first.to_string(),
                    second: path.to_string(),
                });
            }
        }
        if let Some(name) = self.adapters.keys().find(|n| !by_flat.contains_key(*n)) {
            return Err(LoraError::UnresolvedName { key: name.clone() });
        }
        self.adapters = std::mem::take(&mut self.adapters)
            .into_iter()
            .map(|(name, adapter)| (by_flat[&name].to_string(), adapter))
            .collect();
        self.flat_names = false;
        Ok(())
    }

    /// The key the file used for `role` of module `name`, for error messages.
    pub(crate) fn file_key(&self, name: &str, role: Role) -> String {
        match &self.origin {
            Some(o) if o.kohya => {
                let module = if self.flat_names {
                    name.to_string()
                } else {
                    flatten_name(name)
                };
                format!("{}_{}{}", o.prefix, module, role.kohya_suffix())
            }
            Some(o) if !o.prefix.is_empty() => {
                format!("{}.{}{}", o.prefix, name, role.peft_suffix())
            }
            _ => format!("{}{}", name, role.peft_suffix()),
        }
    }

    pub(crate) fn take_adapters(&mut self) -> BTreeMap<String, StoredAdapter> {
        std::mem::take(&mut self.adapters)
    }

    pub(crate) fn replace_adapters(&mut self, adapters: BTreeMap<String, StoredAdapter>) {
        self.adapters = adapters;
    }
}

impl fmt::Display for AdapterSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} adapters, {} parameters",
            self.adapters.len(),
            self.num_params()
        )
    }
}

/// kohya's module naming: dots become underscores.
pub fn flatten_name(path: &str) -> String {
    path.replace('.', "_")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(values: &[f32], shape: &[usize]) -> TensorData {
        TensorData::new(values.to_vec(), shape.to_vec())
    }

    #[test]
    fn roles_parse_both_styles() {
        assert_eq!(
            Role::split_key("lora_unet_a_0.lora_down.weight"),
            Some(("lora_unet_a_0", Role::Down))
        );
        assert_eq!(
            Role::split_key("transformer.a.0.lora_B.weight"),
            Some(("transformer.a.0", Role::Up))
        );
        assert_eq!(Role::split_key("x.lokr_w2_a"), Some(("x", Role::W2A)));
        assert_eq!(Role::split_key("x.lokr_w2"), Some(("x", Role::W2)));
        assert_eq!(Role::split_key("x.alpha"), Some(("x", Role::Alpha)));
        assert_eq!(Role::split_key("x.weight"), None);
    }

    #[test]
    fn lora_delta_is_scaled_product() {
        // up [2,1] = [1,2]^T, down [1,2] = [3,4]; alpha 0.5 over rank 1.
        let a = StoredAdapter::Lora {
            down: data(&[3.0, 4.0], &[1, 2]),
            up: data(&[1.0, 2.0], &[2, 1]),
            alpha: 0.5,
        };
        assert_eq!(a.delta(), (2, 2, vec![1.5, 2.0, 3.0, 4.0]));
    }

    #[test]
    fn lokr_delta_is_kronecker_product() {
        let a = StoredAdapter::Lokr {
            w1: data(&[1.0, 2.0], &[1, 2]),
            w2: LokrFactor::Full(data(&[1.0, 10.0], &[2, 1])),
            alpha: 99.0,
        };
        // Full factors: scale 1 whatever alpha says.
        assert_eq!(a.delta(), (2, 2, vec![1.0, 2.0, 10.0, 20.0]));
        let low = StoredAdapter::Lokr {
            w1: data(&[1.0], &[1, 1]),
            w2: LokrFactor::LowRank {
                a: data(&[1.0, 2.0], &[2, 1]),
                b: data(&[3.0], &[1, 1]),
            },
            alpha: 2.0,
        };
        assert_eq!(low.delta(), (2, 1, vec![6.0, 12.0]));
    }

    #[test]
    fn resolve_flat_names() {
        let mut set = AdapterSet::default().with_flat_names(true);
        let lora = StoredAdapter::Lora {
            down: data(&[1.0], &[1, 1]),
            up: data(&[1.0], &[1, 1]),
            alpha: 1.0,
        };
        set.insert("blocks_0_attn_to_q", lora.clone());
        let mut unknown = set.clone();
        set.resolve_names(["blocks.0.attn.to_q", "blocks.0.attn.to_k"])
            .unwrap();
        assert!(set.get("blocks.0.attn.to_q").is_some());
        assert!(!set.has_flat_names());

        unknown.insert("unknown_x", lora.clone());
        let err = unknown.resolve_names(["blocks.0.attn.to_q"]).unwrap_err();
        assert!(matches!(err, LoraError::UnresolvedName { key } if key == "unknown_x"));

        let mut set = AdapterSet::default().with_flat_names(true);
        set.insert("a_b_c", lora);
        let err = set.resolve_names(["a.b_c", "a_b.c"]).unwrap_err();
        assert!(matches!(err, LoraError::AmbiguousName { .. }));
    }
}
