//! What the tool fixture tests of every model family share: reading the fixtures (made once by
//! the scripts in fixtures/tools), the updates the trained adapters make under each layout's
//! weight keys, and comparing them with what a tool applied.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::DType;
use burn_diffusion::flux::LinearKeys;
use burn_lora::{AdapterSet, Format, LayoutNames, PeftAlpha, SaveOptions};
use safetensors::{Dtype, SafeTensors};

pub const FORMATS: [(Format, &str); 3] = [
    (Format::Kohya, "kohya"),
    (Format::Peft, "peft"),
    (Format::AiToolkit, "ai-toolkit"),
];

/// A fixture file, by its path under fixtures/tools.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tools")
        .join(name)
}

/// A row-major matrix of f64 values with its shape.
pub type Tensors = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

/// Every tensor of a safetensors file, as f64, and its metadata.
pub fn read(path: &Path) -> (Tensors, BTreeMap<String, String>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let metadata = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let tensors = file
        .iter()
        .map(|(key, view)| {
            let data = view.data();
            let values: Vec<f64> = match view.dtype() {
                Dtype::F64 => data
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
                    .collect(),
                Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect(),
                other => panic!("{key}: unexpected dtype {other:?}"),
            };
            (key.to_string(), (view.shape().to_vec(), values))
        })
        .collect();
    (tensors, metadata)
}

fn assert_close(what: &str, found: &[f64], expected: &[f64]) {
    assert_eq!(found.len(), expected.len(), "{what}: length");
    let peak = expected.iter().fold(0f64, |m, v| m.max(v.abs()));
    assert!(peak > 0.0, "{what}: the expected update is zero");
    for (i, (f, e)) in found.iter().zip(expected).enumerate() {
        assert!(
            (f - e).abs() <= 1e-5 * peak,
            "{what}[{i}]: the tool applied {f}, the model trained {e}"
        );
    }
}

/// The adapters of `set` on the layers `keep` accepts.
pub fn only(
    set: &AdapterSet,
    keys: &[LinearKeys],
    keep: impl Fn(&LinearKeys) -> bool,
) -> AdapterSet {
    let mut out = AdapterSet::default();
    for k in keys.iter().filter(|k| keep(k)) {
        if let Some(adapter) = set.get(&k.module) {
            out.insert(&k.module, adapter.clone());
        }
    }
    out
}

/// Every adapted layer's update under the checkpoint's (BFL) weight keys.
pub fn bfl_updates(keys: &[LinearKeys], set: &AdapterSet) -> Tensors {
    keys.iter()
        .filter_map(|keys| {
            let (rows, cols, delta) = set.get(&keys.module)?.delta();
            Some((format!("{}.weight", keys.bfl), (vec![rows, cols], delta)))
        })
        .collect()
}

/// Every adapted layer's update under diffusers' weight keys (fused layers split, the final
/// modulation's halves swapped), by the table that loads diffusers checkpoints.
pub fn diffusers_updates(keys: &[LinearKeys], set: &AdapterSet) -> Tensors {
    let mut out = Tensors::new();
    for keys in keys {
        let Some(adapter) = set.get(&keys.module) else {
            continue;
        };
        let (_, cols, delta) = adapter.delta();
        for slice in &keys.diffusers {
            let (_, target) = out
                .entry(format!("{}.weight", slice.target))
                .or_insert_with(|| (vec![slice.len, cols], vec![0.0; slice.len * cols]));
            for (i, row) in slice.rows.clone().enumerate() {
                let from = (slice.to + i) * cols;
                target[row * cols..(row + 1) * cols].copy_from_slice(&delta[from..from + cols]);
            }
        }
    }
    out
}

/// The tool changed exactly the weights of `expected`, each by its update.
pub fn assert_updates(tool: &str, found: &Tensors, expected: &Tensors) {
    let found_keys: Vec<&String> = found.keys().collect();
    let expected_keys: Vec<&String> = expected.keys().collect();
    assert_eq!(found_keys, expected_keys, "{tool}: the weights changed");
    for (key, (shape, values)) in expected {
        assert_eq!(&found[key].0, shape, "{tool}: {key}");
        assert_close(&format!("{tool}: {key}"), &found[key].1, values);
    }
}

/// Every Linear of the model has a rank-4, alpha-8 adapter in `set`.
pub fn assert_every_layer_adapted(set: &AdapterSet, keys: &[LinearKeys]) {
    assert_eq!(set.len(), keys.len());
    for k in keys {
        let adapter = set.get(&k.module).unwrap_or_else(|| panic!("{}", k.module));
        assert_eq!((adapter.rank(), adapter.alpha()), (Some(4), 8.0));
    }
}

/// Our writer, today, writes exactly the files `folder`'s `lora_<format>.safetensors` the tools
/// loaded for each of `formats` (keys, values, alphas, and the metadata diffusers reads), and
/// every layout reads back to the same adapters (where the layout bakes alpha / rank into
/// `lora_B`, to adapters of scale 1 with the same updates).
pub fn assert_writer_writes_the_fixtures(
    names: &LayoutNames,
    set: &AdapterSet,
    folder: &str,
    formats: &[(Format, &str)],
) {
    let dir = tempfile::tempdir().unwrap();
    for &(format, name) in formats {
        let written = dir.path().join(format!("{name}.safetensors"));
        let options = SaveOptions {
            dtype: Some(DType::F32),
            ..SaveOptions::for_format(format)
        };
        names.save(set, &written, &options).unwrap();
        let file = fixture(&format!("{folder}lora_{name}.safetensors"));
        let (ours, our_meta) = read(&written);
        let (theirs, their_meta) = read(&file);
        assert_eq!(
            ours.keys().collect::<Vec<_>>(),
            theirs.keys().collect::<Vec<_>>(),
            "{name}"
        );
        assert_eq!(ours, theirs, "{name}");
        let peft = "lora_adapter_metadata";
        assert_eq!(our_meta.get(peft), their_meta.get(peft), "{name}");
        let loaded = names.load(&file).unwrap();
        if format == Format::Kohya || names.peft_alpha != PeftAlpha::Baked {
            assert_eq!(
                loaded.iter().collect::<Vec<_>>(),
                set.iter().collect::<Vec<_>>(),
                "{name}"
            );
            continue;
        }
        // Alpha / rank is in lora_B: the file reads back with alpha = rank, the same updates.
        assert_eq!(
            loaded.iter().map(|(m, _)| m).collect::<Vec<_>>(),
            set.iter().map(|(m, _)| m).collect::<Vec<_>>(),
            "{name}"
        );
        for (module, adapter) in set.iter() {
            let read_back = loaded.get(module).unwrap();
            assert_eq!(read_back.rank(), adapter.rank(), "{name}: {module}");
            assert_eq!(read_back.scale(), 1.0, "{name}: {module}");
            let ((rows, cols, found), (r, c, expected)) = (read_back.delta(), adapter.delta());
            assert_eq!((rows, cols), (r, c), "{name}: {module}");
            assert_close(&format!("{name}: {module}"), &found, &expected);
        }
    }
}
