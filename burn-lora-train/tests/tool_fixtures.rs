//! The FLUX.1 LoRA files `burnlora train` writes, against what ComfyUI's and diffusers' own
//! loaders made of them (fixtures/tools, made once by make_fixtures.py; see its doc for what
//! the loaders themselves cannot do).

mod tools;

use burn_diffusion::flux::{FluxConfig, LinearKeys, linear_keys};
use burn_lora::{AdapterSet, Format, LayoutNames, SaveOptions};
use burn_lora_train::config::{Arch, ModelSource};
use burn_lora_train::lora_names;
use tools::{FORMATS, assert_updates, fixture, read};

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

fn keys() -> Vec<LinearKeys> {
    linear_keys(&tiny_config())
}

#[test]
fn every_layer_of_the_model_is_adapted_in_the_fixture() {
    tools::assert_every_layer_adapted(&trained(), &keys());
}

/// Our writer, today, writes exactly the files the tools loaded.
#[test]
fn the_writer_writes_the_files_the_tools_loaded() {
    tools::assert_writer_writes_the_fixtures(&tiny_names(), &trained(), "", &FORMATS);
}

/// ComfyUI patches every weight of every file by exactly alpha / rank · up · down.
#[test]
fn comfyui_applies_every_update_of_every_format() {
    let expected = tools::bfl_updates(&keys(), &trained());
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
    let (set, keys) = (trained(), keys());
    let (peft, _) = read(&fixture("diffusers_peft.safetensors"));
    let expected = tools::diffusers_updates(&keys, &set);
    assert_updates("diffusers, peft file", &peft, &expected);

    let blocks = tools::only(&set, &keys, |k| {
        let block =
            k.module.starts_with("double_blocks.") || k.module.starts_with("single_blocks.");
        block && !k.module.ends_with(".linear1")
    });
    let (kohya, _) = read(&fixture("diffusers_kohya.safetensors"));
    let expected = tools::diffusers_updates(&keys, &blocks);
    assert_updates("diffusers, kohya file", &kohya, &expected);
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
    let keys = keys();
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
