//! The FLUX.1 LoRA files `burnlora train` writes, against what ComfyUI's and diffusers' own
//! loaders made of them (fixtures/tools, made once by make_fixtures.py; see its doc for what
//! the loaders themselves cannot do).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::DType;
use burn_diffusion::flux::{FluxConfig, linear_keys};
use burn_lora::{AdapterSet, Format, LayoutNames, SaveOptions};
use burn_lora_train::config::{Arch, ModelSource};
use burn_lora_train::lora_names;
use safetensors::{Dtype, SafeTensors};

const FORMATS: [(Format, &str); 3] = [
    (Format::Kohya, "kohya"),
    (Format::Peft, "peft"),
    (Format::AiToolkit, "ai-toolkit"),
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tools")
        .join(name)
}

/// A row-major matrix of f64 values with its shape.
type Tensors = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

/// Every tensor of a safetensors file, as f64, and its metadata.
fn read(path: &Path) -> (Tensors, BTreeMap<String, String>) {
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

/// The shape of `model.path: tiny`.
fn tiny_config() -> FluxConfig {
    FluxConfig::new(64, 64, 32, 32, 32, 2, 2, 2, vec![4, 6, 6], true)
}

fn tiny_names() -> LayoutNames {
    let names = lora_names(Arch::Flux1, &ModelSource::Tiny).unwrap();
    assert_eq!(names, burn_diffusion::flux::lora_names(&tiny_config()));
    names
}

/// The adapters `burnlora train` wrote, keyed by the model's module paths.
fn trained() -> AdapterSet {
    tiny_names()
        .load(&fixture("lora_kohya.safetensors"))
        .unwrap()
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

/// Every adapted layer's update under the checkpoint's (BFL) weight keys.
fn bfl_updates(set: &AdapterSet) -> Tensors {
    linear_keys(&tiny_config())
        .into_iter()
        .filter_map(|keys| {
            let (rows, cols, delta) = set.get(&keys.module)?.delta();
            Some((format!("{}.weight", keys.bfl), (vec![rows, cols], delta)))
        })
        .collect()
}

/// Every adapted layer's update under diffusers' weight keys (fused layers split, the final
/// modulation's halves swapped), by the table that loads diffusers checkpoints.
fn diffusers_updates(set: &AdapterSet) -> Tensors {
    let mut out = Tensors::new();
    for keys in linear_keys(&tiny_config()) {
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

fn assert_updates(tool: &str, found: &Tensors, expected: &Tensors) {
    let found_keys: Vec<&String> = found.keys().collect();
    let expected_keys: Vec<&String> = expected.keys().collect();
    assert_eq!(found_keys, expected_keys, "{tool}: the weights changed");
    for (key, (shape, values)) in expected {
        assert_eq!(&found[key].0, shape, "{tool}: {key}");
        assert_close(&format!("{tool}: {key}"), &found[key].1, values);
    }
}

#[test]
fn every_layer_of_the_model_is_adapted_in_the_fixture() {
    let set = trained();
    assert_eq!(set.len(), linear_keys(&tiny_config()).len());
    for (_, adapter) in set.iter() {
        assert_eq!((adapter.rank(), adapter.alpha()), (Some(4), 8.0));
    }
}

/// Our writer, today, writes exactly the files the tools loaded (keys, values, alphas, and
/// the metadata diffusers reads), and every layout reads back to the same adapters.
#[test]
fn the_writer_writes_the_files_the_tools_loaded() {
    let names = tiny_names();
    let set = trained();
    let dir = tempfile::tempdir().unwrap();
    for (format, name) in FORMATS {
        let written = dir.path().join(format!("{name}.safetensors"));
        let options = SaveOptions {
            dtype: Some(DType::F32),
            ..SaveOptions::for_format(format)
        };
        names.save(&set, &written, &options).unwrap();
        let file = fixture(&format!("lora_{name}.safetensors"));
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
        assert_eq!(
            names.load(&file).unwrap().iter().collect::<Vec<_>>(),
            set.iter().collect::<Vec<_>>(),
            "{name}"
        );
    }
}

/// ComfyUI patches every weight of every file by exactly alpha / rank · up · down.
#[test]
fn comfyui_applies_every_update_of_every_format() {
    let expected = bfl_updates(&trained());
    for (_, name) in FORMATS {
        let (found, _) = read(&fixture(&format!("comfyui_{name}.safetensors")));
        assert_updates(&format!("ComfyUI, {name} file"), &found, &expected);
    }
}

/// diffusers applies every update of the PEFT file, and of the kohya file what its converter
/// reads: the double and single blocks (it drops the layers outside them), without the single
/// blocks' `linear1` (it splits those at FLUX.1-dev's widths only; see the full-width test).
#[test]
fn diffusers_applies_every_update_it_can() {
    let set = trained();
    let (peft, _) = read(&fixture("diffusers_peft.safetensors"));
    assert_updates("diffusers, peft file", &peft, &diffusers_updates(&set));

    let mut blocks = AdapterSet::default();
    for (name, adapter) in set.iter() {
        let block = name.starts_with("double_blocks.") || name.starts_with("single_blocks.");
        if block && !name.ends_with(".linear1") {
            blocks.insert(name, adapter.clone());
        }
    }
    let (kohya, _) = read(&fixture("diffusers_kohya.safetensors"));
    assert_updates("diffusers, kohya file", &kohya, &diffusers_updates(&blocks));
}

/// At FLUX.1-dev's width, LoRAs on a single block's diffusers parts convert into the kohya
/// `linear1` file whose split diffusers' converter gave back exactly.
#[test]
fn full_width_parts_convert_to_the_kohya_file_diffusers_splits() {
    let names = lora_names(Arch::Flux1, &ModelSource::Random("flux1-dev".into())).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("kohya.safetensors");
    let report = names
        .convert(
            &fixture("full_width_parts.safetensors"),
            &out,
            Format::Kohya,
        )
        .unwrap();
    assert_eq!(report.adapters, 1);
    let (ours, _) = read(&out);
    let (theirs, _) = read(&fixture("full_width_kohya.safetensors"));
    assert_eq!(ours, theirs);
    let linear1 = &ours["lora_unet_single_blocks_0_linear1.lora_up.weight"];
    assert_eq!(linear1.0, vec![3 * 3072 + 12288, 2]);
}

/// kohya → PEFT → ai-toolkit → kohya keeps every value and the scale of a rank-1024, alpha-64
/// LoRA on the layers each layout names differently (fused `qkv` and `linear1`, the swapped
/// final modulation, an MLP).
#[test]
fn round_trips_through_every_layout_keep_values_and_scale() {
    let names = tiny_names();
    let keys = linear_keys(&tiny_config());
    let mut set = AdapterSet::default();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let rank = 1024;
    for module in [
        "double_blocks.0.img_attn.qkv",
        "double_blocks.1.txt_mlp.lin1",
        "single_blocks.1.linear1",
        "final_layer.ada_ln_modulation",
    ] {
        let k = keys.iter().find(|k| k.module == module).unwrap();
        let mut data = |rows: usize, cols: usize| {
            let values: Vec<f32> = (0..rows * cols).map(|_| next()).collect();
            burn::tensor::TensorData::new(values, [rows, cols])
        };
        let adapter = burn_lora::StoredAdapter::Lora {
            down: data(rank, k.d_input),
            up: data(k.d_output, rank),
            alpha: 64.0,
        };
        set.insert(module, adapter);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut current = set.clone();
    for (format, name) in [FORMATS[1], FORMATS[2], FORMATS[0]] {
        let path = dir.path().join(format!("{name}.safetensors"));
        names
            .save(&current, &path, &SaveOptions::for_format(format))
            .unwrap();
        current = names.load(&path).unwrap();
        for (module, adapter) in set.iter() {
            let back = current.get(module).unwrap();
            assert_eq!(back, adapter, "{module} after {name}");
            assert_eq!(back.scale(), 0.0625);
        }
    }
}

/// `burnlora convert-lora` turns the PEFT file into the kohya file the tools loaded, and
/// refuses, naming the layer, a file whose shapes do not fit the model given.
#[test]
fn convert_lora_command_converts_and_names_what_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("kohya.safetensors");
    let convert = |model: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_burnlora"))
            .args(["convert-lora", "--to", "kohya", "--model", model])
            .arg(fixture("lora_peft.safetensors"))
            .arg(&out)
            .output()
            .unwrap()
    };
    let done = convert("tiny");
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    assert_eq!(read(&out).0, read(&fixture("lora_kohya.safetensors")).0);

    std::fs::remove_file(&out).unwrap();
    let refused = convert("flux1");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("outputs"), "{stderr}");
    assert!(!out.exists(), "nothing is written");
}
