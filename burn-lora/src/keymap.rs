//! Module names of one file layout: which layers of the target tool each adapted layer of a
//! model becomes, and back.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::LoraError;
use crate::adapter::AdapterKind;
use crate::set::{AdapterSet, Matrix, StoredAdapter};

/// Output rows `rows` of the target layer `target` (which has `len` output rows in all) are the
/// model layer's output rows `to .. to + rows.len()`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowSlice {
    /// The target tool's layer, e.g. `transformer_blocks.0.attn.to_q`.
    pub target: String,
    /// Output rows of the target layer.
    pub len: usize,
    /// The rows of the target layer this slice fills.
    pub rows: Range<usize>,
    /// The first output row of the model layer that goes there.
    pub to: usize,
}

/// What one model layer is called by the target tool.
#[derive(Clone, Debug, PartialEq)]
enum Target {
    /// One layer of the target tool, whole.
    Whole(String),
    /// Row slices of one or more target layers (diffusers' `to_q`, `to_k`, `to_v` of BFL's
    /// fused `qkv`; the swapped halves of FLUX's final modulation).
    Rows(Vec<RowSlice>),
}

/// The names one file layout gives to the adapted layers of one model.
///
/// A model crate builds one map per layout from the table that also names its checkpoint
/// tensors (FLUX.1: BFL names for kohya and ai-toolkit files, diffusers names for PEFT files).
/// [`NameMap::to_target`] renames an [`AdapterSet`] keyed by the model's module paths into
/// the layout's names, splitting adapters of fused layers exactly: every target layer gets the
/// shared `down` matrix and its rows of `up`, so `up_t · down` is exactly the model update's
/// rows. A model layer the map does not name is an error, never a silently unloadable key.
///
/// [`NameMap::from_target`] is the reverse. Parts that share their `down` matrix and alpha (as
/// files written by [`NameMap::to_target`] do) join back into the original adapter; parts
/// trained separately join into one adapter of the summed rank, with stacked `down` matrices
/// and `up` matrices on a block diagonal:
///
/// ```text
/// down = [A_q; A_k; A_v]                               (3r × in)
/// up   = [[B_q, 0, 0], [0, B_k, 0], [0, 0, B_v]]       (3·out × 3r)
/// up · down = [B_q A_q; B_k A_k; B_v A_v]              (each part's own update)
/// ```
///
/// with alpha equal to `scale · total rank` when the parts share a scale (otherwise each
/// scale is multiplied into its block of `up` and alpha equals the rank). ComfyUI applies such
/// a kohya `qkv` LoRA as `alpha / rank · up · down` on the fused weight, and diffusers' kohya
/// FLUX converter recognises the zero off-diagonal blocks; [`NameMap::to_target`] does the same
/// and gives each part its own block.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NameMap {
    layers: BTreeMap<String, Target>,
}

impl NameMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Model layer `module` is the target's layer `target`, whole.
    pub fn rename(mut self, module: impl Into<String>, target: impl Into<String>) -> Self {
        self.layers
            .insert(module.into(), Target::Whole(target.into()));
        self
    }

    /// Model layer `module`'s output rows are spread over the target layers of `slices`.
    pub fn split(mut self, module: impl Into<String>, slices: Vec<RowSlice>) -> Self {
        self.layers.insert(module.into(), Target::Rows(slices));
        self
    }

    /// The same names for a model that holds this map's model at `prefix` (`unet.`): every
    /// model path starts with `prefix`.
    pub fn nested(self, prefix: &str) -> Self {
        let layers = self
            .layers
            .into_iter()
            .map(|(module, target)| (format!("{prefix}{module}"), target))
            .collect();
        Self { layers }
    }

    /// Every target layer name, each once.
    pub fn target_names(&self) -> BTreeSet<&str> {
        self.layers
            .values()
            .flat_map(|t| match t {
                Target::Whole(name) => vec![name.as_str()],
                Target::Rows(slices) => slices.iter().map(|s| s.target.as_str()).collect(),
            })
            .collect()
    }

    /// Checks, before any training, that the layer at `path` in the map's model, adapted by
    /// `kind`, can be written under this map's names: it has a name, and a layer split across
    /// target layers carries LoRA (a LoKr update cannot be split exactly).
    pub(crate) fn check_layer(&self, path: &str, kind: AdapterKind) -> Result<(), LoraError> {
        match self.layers.get(path) {
            None => Err(LoraError::Unnamed {
                module: path.to_string(),
            }),
            Some(Target::Rows(_)) if kind == AdapterKind::Lokr => Err(mapping(
                path,
                "this layout splits the layer across several layers, which a LoKr update \
                 cannot be; choose LoRA or another file format"
                    .into(),
            )),
            Some(_) => Ok(()),
        }
    }

    /// Model names → target names. Fails naming the first module the map does not know.
    pub fn to_target(&self, set: &AdapterSet) -> Result<AdapterSet, LoraError> {
        let mut out = set.clone();
        let mut adapters = BTreeMap::new();
        for (module, adapter) in out.take_adapters() {
            match self.layers.get(&module) {
                None => return Err(LoraError::Unnamed { module }),
                Some(Target::Whole(target)) => insert_new(&mut adapters, target, adapter)?,
                Some(Target::Rows(slices)) => {
                    for (target, part) in split(&module, slices, &adapter)? {
                        insert_new(&mut adapters, &target, part)?;
                    }
                }
            }
        }
        out.replace_adapters(adapters);
        Ok(out)
    }

    /// Target names → model names. Fails listing every adapter whose name the map does not
    /// know.
    pub fn from_target(&self, set: &AdapterSet) -> Result<AdapterSet, LoraError> {
        let mut out = set.clone();
        let mut adapters = out.take_adapters();
        let mut joined = BTreeMap::new();
        for (module, target) in &self.layers {
            let adapter = match target {
                Target::Whole(name) => adapters.remove(name),
                Target::Rows(slices) => {
                    let mut names: Vec<&str> = slices.iter().map(|s| s.target.as_str()).collect();
                    names.dedup();
                    let parts: Vec<(&str, StoredAdapter)> = names
                        .into_iter()
                        .filter_map(|n| adapters.remove(n).map(|a| (n, a)))
                        .collect();
                    if parts.is_empty() {
                        None
                    } else {
                        Some(join(slices, &parts)?)
                    }
                }
            };
            if let Some(adapter) = adapter {
                joined.insert(module.clone(), adapter);
            }
        }
        if !adapters.is_empty() {
            return Err(LoraError::UnknownModules {
                modules: adapters.into_keys().collect(),
            });
        }
        out.replace_adapters(joined);
        Ok(out)
    }
}

fn insert_new(
    adapters: &mut BTreeMap<String, StoredAdapter>,
    name: &str,
    adapter: StoredAdapter,
) -> Result<(), LoraError> {
    if adapters.insert(name.to_string(), adapter).is_some() {
        return Err(mapping(name, "the mapping produces this name twice".into()));
    }
    Ok(())
}

fn mapping(key: &str, reason: String) -> LoraError {
    LoraError::Mapping {
        key: key.to_string(),
        reason,
    }
}

/// The LoRA factors of an adapter as `(down, up, alpha)`; LoKr cannot be split or joined.
fn lora_parts(name: &str, adapter: &StoredAdapter) -> Result<(Matrix, Matrix, f64), LoraError> {
    match adapter {
        StoredAdapter::Lora { down, up, alpha } => Ok((
            Matrix::from_data(down),
            Matrix::from_data(up),
            *alpha as f64,
        )),
        StoredAdapter::Lokr { .. } => Err(mapping(
            name,
            "a LoKr update cannot be split across layers or joined exactly; only LoRA can".into(),
        )),
    }
}

/// The output rows of a model layer described by `slices`.
fn model_rows(slices: &[RowSlice]) -> usize {
    slices
        .iter()
        .map(|s| s.to + s.rows.len())
        .max()
        .unwrap_or(0)
}

/// Each target's adapter: the shared `down` and the target's rows of `up`, or only its own
/// columns when `up` is block diagonal over the targets.
fn split(
    module: &str,
    slices: &[RowSlice],
    adapter: &StoredAdapter,
) -> Result<Vec<(String, StoredAdapter)>, LoraError> {
    let (down, up, alpha) = lora_parts(module, adapter)?;
    let StoredAdapter::Lora {
        down: down_data,
        up: up_data,
        ..
    } = adapter
    else {
        unreachable!("lora_parts accepted it")
    };
    let rows = model_rows(slices);
    if up.rows != rows {
        return Err(mapping(
            module,
            format!("has {} outputs, the layout's layers have {rows}", up.rows),
        ));
    }
    let mut targets: Vec<(&str, usize, Vec<&RowSlice>)> = Vec::new();
    for slice in slices {
        match targets.iter_mut().find(|(t, _, _)| *t == slice.target) {
            Some((_, _, list)) => list.push(slice),
            None => targets.push((&slice.target, slice.len, vec![slice])),
        }
    }
    let blocks = diagonal_blocks(&up, &targets);
    let rank = down.rows;
    let dtype = down_data.dtype;
    let tail = down_data.shape[1..].to_vec();
    let up_tail = up_data.shape[2..].to_vec();
    Ok(targets
        .iter()
        .enumerate()
        .map(|(i, (target, len, list))| {
            let cols = blocks.as_ref().map_or(0..rank, |b| b[i].clone());
            let mut part_up = Matrix::zeros(*len, cols.len());
            for s in list {
                let block = up.block(s.to, s.rows.len(), cols.start, cols.len());
                part_up.set_block(s.rows.start, 0, &block);
            }
            let part_down = down.rows_range(cols.start, cols.len());
            let part_alpha = alpha * cols.len() as f64 / rank as f64;
            let part = StoredAdapter::Lora {
                down: part_down.into_data([vec![cols.len()], tail.clone()].concat(), dtype),
                up: part_up.into_data([vec![*len, cols.len()], up_tail.clone()].concat(), dtype),
                alpha: part_alpha as f32,
            };
            (target.to_string(), part)
        })
        .collect())
}

/// The column range of each target when `up` (not all zero) is block diagonal with equal
/// blocks, one per target in order; `None` otherwise.
fn diagonal_blocks(
    up: &Matrix,
    targets: &[(&str, usize, Vec<&RowSlice>)],
) -> Option<Vec<Range<usize>>> {
    let n = targets.len();
    if n < 2 || !up.cols.is_multiple_of(n) || up.values.iter().all(|v| *v == 0.0) {
        return None;
    }
    let width = up.cols / n;
    let blocks: Vec<Range<usize>> = (0..n).map(|j| j * width..(j + 1) * width).collect();
    let diagonal = targets.iter().enumerate().all(|(j, (_, _, list))| {
        list.iter().all(|s| {
            (0..n).filter(|&k| k != j).all(|k| {
                up.block(s.to, s.rows.len(), k * width, width)
                    .values
                    .iter()
                    .all(|v| *v == 0.0)
            })
        })
    });
    diagonal.then_some(blocks)
}

/// One model adapter from the adapters of its target layers.
fn join(slices: &[RowSlice], parts: &[(&str, StoredAdapter)]) -> Result<StoredAdapter, LoraError> {
    let factors = parts
        .iter()
        .map(|(name, adapter)| {
            let (down, up, alpha) = lora_parts(name, adapter)?;
            let len = slices
                .iter()
                .find(|s| s.target == *name)
                .map_or(0, |s| s.len);
            if up.rows != len {
                return Err(mapping(
                    name,
                    format!("has {} outputs, the model's layer has {len}", up.rows),
                ));
            }
            Ok((*name, down, up, alpha))
        })
        .collect::<Result<Vec<_>, LoraError>>()?;
    let StoredAdapter::Lora {
        down: first_down,
        up: first_up,
        alpha: first_alpha,
    } = &parts[0].1
    else {
        unreachable!("lora_parts accepted it")
    };
    for (name, down, _, _) in &factors[1..] {
        if down.cols != factors[0].1.cols {
            return Err(LoraError::Shape {
                key: name.to_string(),
                expected: vec![down.rows, factors[0].1.cols],
                found: vec![down.rows, down.cols],
            });
        }
    }
    let shared_down = parts.iter().all(|(_, a)| {
        matches!(a, StoredAdapter::Lora { down, alpha, .. } if down == first_down && alpha == first_alpha)
    });
    let columns: Vec<usize> = if shared_down {
        vec![0; factors.len()]
    } else {
        factors
            .iter()
            .scan(0, |acc, f| {
                let start = *acc;
                *acc += f.1.rows;
                Some(start)
            })
            .collect()
    };
    let scales: Vec<f64> = factors.iter().map(|f| f.3 / f.1.rows as f64).collect();
    let same_scale = scales.iter().all(|s| *s == scales[0]);
    let (down, rank) = if shared_down {
        (factors[0].1.clone(), factors[0].1.rows)
    } else {
        let rank: usize = factors.iter().map(|f| f.1.rows).sum();
        let mut down = Matrix::zeros(rank, factors[0].1.cols);
        for (f, col) in factors.iter().zip(&columns) {
            down.set_block(*col, 0, &f.1);
        }
        (down, rank)
    };
    let mut up = Matrix::zeros(model_rows(slices), rank);
    for slice in slices {
        let Some(i) = factors.iter().position(|f| f.0 == slice.target) else {
            continue;
        };
        let part = factors[i]
            .2
            .block(slice.rows.start, slice.rows.len(), 0, factors[i].2.cols);
        let part = if same_scale {
            part
        } else {
            part.scaled(scales[i])
        };
        up.set_block(slice.to, columns[i], &part);
    }
    let alpha = if same_scale {
        scales[0] * rank as f64
    } else {
        rank as f64
    };
    let tail = first_down.shape[1..].to_vec();
    let up_shape = [vec![up.rows, rank], first_up.shape[2..].to_vec()].concat();
    Ok(StoredAdapter::Lora {
        down: down.into_data([vec![rank], tail].concat(), first_down.dtype),
        up: up.into_data(up_shape, first_up.dtype),
        alpha: alpha as f32,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::set::LoraMetadata;
    use burn::tensor::TensorData;

    fn lora(rank: usize, fan_in: usize, out: usize, alpha: f32, seed: f32) -> StoredAdapter {
        let values = |n: usize, k: f32| (0..n).map(|i| ((i as f32 + k) * 0.37).sin()).collect();
        StoredAdapter::Lora {
            down: TensorData::new::<f32, _>(values(rank * fan_in, seed), [rank, fan_in]),
            up: TensorData::new::<f32, _>(values(out * rank, seed + 1.0), [out, rank]),
            alpha,
        }
    }

    fn slice(target: &str, len: usize, rows: Range<usize>, to: usize) -> RowSlice {
        RowSlice {
            target: target.into(),
            len,
            rows,
            to,
        }
    }

    /// BFL-style `qkv` (3 × 3 rows) over diffusers-style `q`, `k`, `v`; a final layer whose
    /// halves are swapped; an MLP renamed.
    fn map() -> NameMap {
        NameMap::new()
            .split(
                "attn.qkv",
                vec![
                    slice("attn.q", 3, 0..3, 0),
                    slice("attn.k", 3, 0..3, 3),
                    slice("attn.v", 3, 0..3, 6),
                ],
            )
            .split(
                "final",
                vec![slice("norm_out", 4, 2..4, 0), slice("norm_out", 4, 0..2, 2)],
            )
            .rename("mlp.lin1", "mlp.0")
    }

    fn set(adapters: &[(&str, StoredAdapter)]) -> AdapterSet {
        let mut set = AdapterSet::new(LoraMetadata::default());
        for (name, adapter) in adapters {
            set.insert(*name, adapter.clone());
        }
        set
    }

    fn assert_close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    /// Rows `rows` of a `cols`-wide row-major matrix.
    fn rows(values: &[f64], cols: usize, rows: Range<usize>) -> Vec<f64> {
        values[rows.start * cols..rows.end * cols].to_vec()
    }

    #[test]
    fn split_parts_share_down_and_carry_their_rows() {
        let qkv = lora(2, 4, 9, 3.0, 0.0);
        let fin = lora(2, 4, 4, 1.0, 7.0);
        let mlp = lora(1, 4, 5, 0.5, 3.0);
        let model = set(&[
            ("attn.qkv", qkv.clone()),
            ("final", fin.clone()),
            ("mlp.lin1", mlp.clone()),
        ]);
        let target = map().to_target(&model).unwrap();
        assert_eq!(target.get("mlp.0"), Some(&mlp));
        let (_, cols, full) = qkv.delta();
        for (i, part) in ["attn.q", "attn.k", "attn.v"].iter().enumerate() {
            let adapter = target.get(part).unwrap();
            assert_eq!((adapter.rank(), adapter.alpha()), (Some(2), 3.0), "{part}");
            assert_close(&adapter.delta().2, &rows(&full, cols, 3 * i..3 * i + 3));
        }
        // norm_out rows 2..4 are the model's rows 0..2 and the other way round.
        let (_, cols, fin_delta) = fin.delta();
        let swapped = [rows(&fin_delta, cols, 2..4), rows(&fin_delta, cols, 0..2)].concat();
        assert_close(&target.get("norm_out").unwrap().delta().2, &swapped);

        // And back to exactly the model's adapters.
        assert_eq!(map().from_target(&target).unwrap(), model);
    }

    #[test]
    fn separately_trained_parts_join_block_diagonally_and_split_back() {
        let parts = [
            lora(2, 4, 3, 1.0, 0.0),
            lora(2, 4, 3, 1.0, 5.0),
            lora(2, 4, 3, 1.0, 9.0),
        ];
        let target = set(&[
            ("attn.q", parts[0].clone()),
            ("attn.k", parts[1].clone()),
            ("attn.v", parts[2].clone()),
        ]);
        let model = map().from_target(&target).unwrap();
        let fused = model.get("attn.qkv").unwrap();
        assert_eq!((fused.rank(), fused.alpha()), (Some(6), 3.0));
        let stacked: Vec<f64> = parts.iter().flat_map(|p| p.delta().2).collect();
        assert_close(&fused.delta().2, &stacked);
        // The block-diagonal up splits into the original rank-2 parts.
        assert_eq!(map().to_target(&model).unwrap(), target);
    }

    #[test]
    fn unequal_scales_and_missing_parts_keep_each_update() {
        let q = lora(2, 4, 3, 1.0, 0.0);
        let v = lora(1, 4, 3, 4.0, 2.0);
        let model = map()
            .from_target(&set(&[("attn.q", q.clone()), ("attn.v", v.clone())]))
            .unwrap();
        let expected: Vec<f64> = [q.delta().2, vec![0.0; 12], v.delta().2].concat();
        assert_close(&model.get("attn.qkv").unwrap().delta().2, &expected);
    }

    #[test]
    fn unnamed_modules_and_unknown_layers_are_errors_naming_them() {
        let err = map()
            .to_target(&set(&[("mlp.lin2", lora(1, 4, 2, 1.0, 0.0))]))
            .unwrap_err();
        assert!(
            matches!(&err, LoraError::Unnamed { module } if module == "mlp.lin2"),
            "{err}"
        );
        let err = map()
            .from_target(&set(&[
                ("mlp.0", lora(1, 4, 5, 1.0, 0.0)),
                ("te.fc", lora(1, 4, 2, 1.0, 0.0)),
            ]))
            .unwrap_err();
        assert!(err.to_string().ends_with(": te.fc"), "{err}");
        let err = map()
            .to_target(&set(&[("attn.qkv", lora(1, 4, 8, 1.0, 0.0))]))
            .unwrap_err();
        assert!(err.to_string().contains("8 outputs"), "{err}");
    }
}
