//! Module-name mapping between a model and the tool a file is meant for.

use std::collections::BTreeMap;

use burn::tensor::DType;

use crate::LoraError;
use crate::set::{AdapterSet, Matrix, StoredAdapter};

/// Several layers of the model whose weights form one weight in the target tool, stacked along
/// the output dimension in the given order.
#[derive(Clone, Debug, PartialEq)]
struct Fusion {
    into: String,
    parts: Vec<(String, usize)>,
}

/// Renames and fusions from a model's module names to a target tool's names.
///
/// A model crate describes, once per model, how its module paths differ from a target tool's
/// (e.g. a diffusers-layout FLUX to BFL names): plain renames, and fusions of several layers
/// into one weight (`attn.to_q`, `to_k`, `to_v` → `img_attn.qkv`). This crate applies the map
/// to an [`AdapterSet`] in either direction.
///
/// A LoRA on split layers becomes a LoRA on the fused weight by stacking the down matrices and
/// placing the up matrices on a block diagonal:
///
/// ```text
/// down = [A_q; A_k; A_v]            (3r × in)
/// up   = [[B_q, 0, 0], [0, B_k, 0], [0, 0, B_v]]   (3·out × 3r)
/// up · down = [B_q A_q; B_k A_k; B_v A_v]           (each part's own update)
/// ```
///
/// with alpha set to `scale · total rank` (three parts of rank `r` and alpha `a` give rank `3r`,
/// alpha `3a`), so `alpha / rank` is unchanged; parts with different scales have their scale
/// multiplied into their block of `up` and alpha equals the rank. ComfyUI applies a kohya
/// `qkv` LoRA as `alpha / rank · up · down` on the fused weight, which is exactly the per-part
/// updates stacked; diffusers' kohya FLUX converter recognises the zero off-diagonal blocks and
/// splits the file back into the original per-part LoRAs (ref: ComfyUI
/// `comfy/weight_adapter/lora.py`, diffusers 0.42.1 `loaders/lora_conversion_utils.py`
/// `_convert_kohya_flux_lora_to_diffusers`; `tests/fixtures/make_fixtures.py` checks both). Sharing one down matrix
/// and concatenating the up matrices would only be exact if the parts shared their down
/// matrix, which independently trained LoRAs do not. Splitting does the reverse: a block
/// diagonal up splits into the original parts, any other fused LoRA gives each part the whole
/// down matrix and its rows of up.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NameMap {
    renames: Vec<(String, String)>,
    fusions: Vec<Fusion>,
}

impl NameMap {
    /// An empty map (names pass through).
    pub fn new() -> Self {
        Self::default()
    }

    /// Module `from` is called `to` by the target tool.
    pub fn rename(mut self, from: impl Into<String>, to: impl Into<String>) -> Self {
        self.renames.push((from.into(), to.into()));
        self
    }

    /// The target tool has one weight `into` whose output rows are the outputs of `parts`
    /// (module name, output features), in order.
    pub fn fuse(mut self, into: impl Into<String>, parts: &[(&str, usize)]) -> Self {
        self.fusions.push(Fusion {
            into: into.into(),
            parts: parts.iter().map(|(n, d)| (n.to_string(), *d)).collect(),
        });
        self
    }

    /// Model names → target names: renames, and fused adapters for each fusion whose parts
    /// appear in the set (a missing part contributes nothing).
    pub fn apply(&self, set: &AdapterSet) -> Result<AdapterSet, LoraError> {
        let mut out = set.clone();
        let mut adapters = out.take_adapters();
        for fusion in &self.fusions {
            let parts: Vec<Option<StoredAdapter>> = fusion
                .parts
                .iter()
                .map(|(name, _)| adapters.remove(name))
                .collect();
            if parts.iter().all(Option::is_none) {
                continue;
            }
            let fused = fuse(fusion, &parts)?;
            insert_new(&mut adapters, &fusion.into, fused)?;
        }
        rename_all(&mut adapters, self.renames.iter().map(|(f, t)| (f, t)))?;
        out.replace_adapters(adapters);
        Ok(out)
    }

    /// Target names → model names: the inverse renames, and each fused adapter split into its
    /// parts.
    pub fn invert(&self, set: &AdapterSet) -> Result<AdapterSet, LoraError> {
        let mut out = set.clone();
        let mut adapters = out.take_adapters();
        rename_all(&mut adapters, self.renames.iter().map(|(f, t)| (t, f)))?;
        for fusion in &self.fusions {
            if let Some(fused) = adapters.remove(&fusion.into) {
                for ((name, _), part) in fusion.parts.iter().zip(split(fusion, &fused)?) {
                    insert_new(&mut adapters, name, part)?;
                }
            }
        }
        out.replace_adapters(adapters);
        Ok(out)
    }
}

fn insert_new(
    adapters: &mut BTreeMap<String, StoredAdapter>,
    name: &str,
    adapter: StoredAdapter,
) -> Result<(), LoraError> {
    if adapters.insert(name.to_string(), adapter).is_some() {
        return Err(LoraError::Mapping {
            key: name.to_string(),
            reason: "the mapping produces this name twice".into(),
        });
    }
    Ok(())
}

fn rename_all<'a>(
    adapters: &mut BTreeMap<String, StoredAdapter>,
    pairs: impl Iterator<Item = (&'a String, &'a String)>,
) -> Result<(), LoraError> {
    let moved: Vec<(&String, StoredAdapter)> = pairs
        .filter_map(|(from, to)| adapters.remove(from).map(|a| (to, a)))
        .collect();
    for (to, adapter) in moved {
        insert_new(adapters, to, adapter)?;
    }
    Ok(())
}

fn not_fusable(key: &str, reason: String) -> LoraError {
    LoraError::Mapping {
        key: key.to_string(),
        reason,
    }
}

/// The LoRA factors of an adapter as `(down, up, alpha)` matrices.
fn lora_parts(name: &str, adapter: &StoredAdapter) -> Result<(Matrix, Matrix, f64), LoraError> {
    match adapter {
        StoredAdapter::Lora { down, up, alpha } => Ok((
            Matrix::from_data(down),
            Matrix::from_data(up),
            *alpha as f64,
        )),
        StoredAdapter::Lokr { .. } => Err(not_fusable(
            name,
            "a LoKr update cannot be fused or split exactly; only LoRA can".into(),
        )),
    }
}

/// Shape of the down matrix of a LoRA adapter.
fn down_shape(adapter: &StoredAdapter) -> (Vec<usize>, DType) {
    match adapter {
        StoredAdapter::Lora { down, .. } => (down.shape.to_vec(), down.dtype),
        StoredAdapter::Lokr { .. } => unreachable!("checked by lora_parts"),
    }
}

fn fuse(fusion: &Fusion, parts: &[Option<StoredAdapter>]) -> Result<StoredAdapter, LoraError> {
    let mut factors = Vec::new();
    let mut tail: Option<Vec<usize>> = None;
    let mut dtype = DType::F32;
    for ((name, rows), adapter) in fusion.parts.iter().zip(parts) {
        let Some(adapter) = adapter else { continue };
        let (down, up, alpha) = lora_parts(name, adapter)?;
        let (shape, part_dtype) = down_shape(adapter);
        let expected = tail.get_or_insert_with(|| {
            dtype = part_dtype;
            shape[1..].to_vec()
        });
        if shape[1..] != expected[..] {
            return Err(LoraError::Shape {
                key: name.clone(),
                expected: [vec![down.rows], expected.clone()].concat(),
                found: shape,
            });
        }
        if up.rows != *rows {
            return Err(not_fusable(
                name,
                format!("has {} outputs, the fusion declares {rows}", up.rows),
            ));
        }
        factors.push((name.as_str(), down, up, alpha));
    }
    let tail = tail.expect("at least one part is present");
    let rank: usize = factors.iter().map(|f| f.1.rows).sum();
    let outputs: usize = fusion.parts.iter().map(|(_, d)| d).sum();
    let scales: Vec<f64> = factors
        .iter()
        .map(|(_, d, _, a)| a / d.rows as f64)
        .collect();
    let shared = scales.iter().all(|s| *s == scales[0]);
    let alpha = if shared {
        scales[0] * rank as f64
    } else {
        rank as f64
    };

    let mut down = Matrix::zeros(rank, factors[0].1.cols);
    let mut up = Matrix::zeros(outputs, rank);
    let (mut row, mut col, mut next) = (0, 0, 0);
    for (name, rows) in &fusion.parts {
        if let Some((part, d, u, _)) = factors.get(next)
            && part == name
        {
            down.set_block(col, 0, d);
            if shared {
                up.set_block(row, col, u);
            } else {
                up.set_block(row, col, &u.clone().scaled(scales[next]));
            }
            col += d.rows;
            next += 1;
        }
        row += rows;
    }
    let up_shape = if tail.len() == 3 {
        vec![outputs, rank, 1, 1]
    } else {
        vec![outputs, rank]
    };
    Ok(StoredAdapter::Lora {
        down: down.into_data([vec![rank], tail].concat(), dtype),
        up: up.into_data(up_shape, dtype),
        alpha: alpha as f32,
    })
}

fn split(fusion: &Fusion, fused: &StoredAdapter) -> Result<Vec<StoredAdapter>, LoraError> {
    let (down, up, alpha) = lora_parts(&fusion.into, fused)?;
    let StoredAdapter::Lora {
        down: down_data,
        up: up_data,
        ..
    } = fused
    else {
        unreachable!("lora_parts accepted it")
    };
    let dims: Vec<usize> = fusion.parts.iter().map(|(_, d)| *d).collect();
    let outputs: usize = dims.iter().sum();
    if up.rows != outputs {
        return Err(not_fusable(
            &fusion.into,
            format!("has {} outputs, the parts declare {outputs}", up.rows),
        ));
    }
    let n = dims.len();
    let rank = down.rows;
    let part_rank = rank / n;
    let offsets: Vec<usize> = dims
        .iter()
        .scan(0, |acc, d| {
            let start = *acc;
            *acc += d;
            Some(start)
        })
        .collect();
    let block_diagonal = rank.is_multiple_of(n)
        && (0..n).all(|j| {
            (0..n).filter(|&k| k != j).all(|k| {
                up.block(offsets[j], dims[j], k * part_rank, part_rank)
                    .values
                    .iter()
                    .all(|v| *v == 0.0)
            })
        });
    let tail = down_data.shape[1..].to_vec();
    let up_tail = up_data.shape[2..].to_vec();
    let dtype = down_data.dtype;
    Ok((0..n)
        .map(|j| {
            let (d, u, a, r) = if block_diagonal {
                (
                    down.rows_range(j * part_rank, part_rank),
                    up.block(offsets[j], dims[j], j * part_rank, part_rank),
                    alpha / n as f64,
                    part_rank,
                )
            } else {
                (
                    down.clone(),
                    up.rows_range(offsets[j], dims[j]),
                    alpha,
                    rank,
                )
            };
            StoredAdapter::Lora {
                down: d.into_data([vec![r], tail.clone()].concat(), dtype),
                up: u.into_data([vec![dims[j], r], up_tail.clone()].concat(), dtype),
                alpha: a as f32,
            }
        })
        .collect())
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

    fn qkv_map() -> NameMap {
        NameMap::new()
            .fuse("attn.qkv", &[("attn.q", 3), ("attn.k", 3), ("attn.v", 3)])
            .rename("mlp.fc", "mlp.0")
    }

    fn assert_close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
        }
    }

    #[test]
    fn fused_delta_is_the_stack_of_part_deltas_and_splits_back() {
        let mut set = AdapterSet::new(LoraMetadata::default());
        let parts = [
            lora(2, 4, 3, 1.0, 0.0),
            lora(2, 4, 3, 1.0, 5.0),
            lora(2, 4, 3, 1.0, 9.0),
        ];
        for (name, part) in ["attn.q", "attn.k", "attn.v"].iter().zip(&parts) {
            set.insert(*name, part.clone());
        }
        set.insert("mlp.fc", lora(1, 4, 2, 0.5, 3.0));
        let mapped = qkv_map().apply(&set).unwrap();
        assert!(mapped.get("attn.q").is_none() && mapped.get("mlp.fc").is_none());
        assert_eq!(mapped.get("mlp.0"), set.get("mlp.fc"));
        let fused = mapped.get("attn.qkv").unwrap();
        assert_eq!(fused.rank(), Some(6));
        assert_eq!(fused.alpha(), 3.0);
        let expected: Vec<f64> = parts.iter().flat_map(|p| p.delta().2).collect();
        assert_close(&fused.delta().2, &expected);

        let back = qkv_map().invert(&mapped).unwrap();
        for (name, part) in ["attn.q", "attn.k", "attn.v"].iter().zip(&parts) {
            assert_eq!(back.get(name), Some(part), "{name}");
        }
        assert_eq!(back.get("mlp.fc"), set.get("mlp.fc"));
    }

    #[test]
    fn unequal_scales_and_missing_parts_keep_each_delta() {
        let mut set = AdapterSet::new(LoraMetadata::default());
        let q = lora(2, 4, 3, 1.0, 0.0);
        let v = lora(1, 4, 3, 4.0, 2.0);
        set.insert("attn.q", q.clone());
        set.insert("attn.v", v.clone());
        let fused = qkv_map().apply(&set).unwrap();
        let fused = fused.get("attn.qkv").unwrap();
        let expected: Vec<f64> = [q.delta().2, vec![0.0; 12], v.delta().2].concat();
        assert_close(&fused.delta().2, &expected);
    }

    #[test]
    fn shared_down_splits_into_full_rank_parts() {
        let mut set = AdapterSet::new(LoraMetadata::default());
        let fused = lora(3, 4, 9, 1.5, 1.0);
        set.insert("attn.qkv", fused.clone());
        let parts = qkv_map().invert(&set).unwrap();
        let deltas: Vec<f64> = ["attn.q", "attn.k", "attn.v"]
            .iter()
            .flat_map(|n| parts.get(n).unwrap().delta().2)
            .collect();
        assert_close(&deltas, &fused.delta().2);
        assert_eq!(parts.get("attn.k").unwrap().rank(), Some(3));
    }

    #[test]
    fn wrong_part_size_is_an_error_naming_the_part() {
        let mut set = AdapterSet::new(LoraMetadata::default());
        set.insert("attn.k", lora(2, 4, 5, 1.0, 0.0));
        let err = qkv_map().apply(&set).unwrap_err().to_string();
        assert!(err.contains("attn.k") && err.contains("5 outputs"), "{err}");
    }
}
