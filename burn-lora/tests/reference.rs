//! Files made by PEFT, diffusers, a kohya-style writer and a LyCORIS-style writer
//! (`tests/fixtures/make_fixtures.py`) load into the Burn port of the fixture model and give
//! the reference outputs computed by PyTorch in float64.

mod common;

use burn::tensor::DType;
use burn_lora::{
    AdapterSet, Format, LoraMetadata, NameMap, PeftAlpha, RowSlice, SaveOptions, export, load,
    load_adapters, save,
};
use common::{Fixture, Tiny, fixture, reference_input, reference_output, rel_err, tiny_model};

const ALL_LAYERS: [&str; 6] = [
    "blocks.0.fc1",
    "blocks.0.fc2",
    "blocks.1.fc1",
    "blocks.1.fc2",
    "conv",
    "head",
];

fn apply_file(path: &str) -> (Tiny<common::B>, burn_lora::LoadReport) {
    let set = load(&fixture(path)).unwrap();
    load_adapters(tiny_model(), set).unwrap()
}

fn output(model: &Tiny<common::B>) -> burn::tensor::TensorData {
    model.forward(reference_input()).into_data()
}

/// Asserts the model's output is within `tolerance` (relative to the largest reference value)
/// of the float64 reference `expected`, and prints the figure.
fn assert_matches(what: &str, model: &Tiny<common::B>, expected: &str, tolerance: f64) {
    let err = rel_err(&output(model), &reference_output(expected));
    eprintln!("{what}: relative error {err:.2e} against {expected}");
    assert!(
        err <= tolerance,
        "{what}: relative error {err} against {expected}"
    );
}

#[test]
fn port_matches_the_base_model() {
    assert_matches("base model", &tiny_model(), "out_base", 1e-6);
}

#[test]
fn peft_save_pretrained_file_gives_the_peft_output() {
    let (model, report) = apply_file("peft_tiny/adapter_model.safetensors");
    assert_eq!(report.loaded, ALL_LAYERS);
    assert!(report.is_complete(), "{report}");
    // rank_pattern / alpha_pattern from adapter_config.json.
    assert_eq!(model.head.adapter().unwrap().rank(), Some(2));
    assert_eq!(model.head.adapter().unwrap().scale(), 4.0);
    assert_eq!(model.blocks[1].fc2.adapter().unwrap().scale(), 0.75);
    assert_eq!(model.blocks[0].fc2.adapter().unwrap().scale(), 2.0);
    assert_matches("PEFT save_pretrained", &model, "out_peft", 1e-5);
    // The adapters matter: the base output is far away.
    assert!(rel_err(&output(&tiny_model()), &reference_output("out_peft")) > 0.05);
}

#[test]
fn diffusers_file_with_alpha_in_metadata_gives_the_peft_output() {
    let (model, report) = apply_file("diffusers_tiny.safetensors");
    assert_eq!(report.loaded, ALL_LAYERS);
    assert_matches("diffusers save_lora_weights", &model, "out_peft", 1e-5);
}

#[test]
fn kohya_file_gives_the_reference_output() {
    let set = load(&fixture("kohya_tiny.safetensors")).unwrap();
    assert!(set.has_flat_names());
    // Known alphas: 1.0 (rank 2), 1.5 (rank 3, stored in bf16), 16 (rank 4), none (rank 2).
    let scales: Vec<f64> = ["conv", "blocks_0_fc1", "blocks_1_fc2", "head"]
        .iter()
        .map(|n| set.get(n).unwrap().scale())
        .collect();
    assert_eq!(scales, [0.5, 0.5, 4.0, 1.0]);
    let (model, report) = load_adapters(tiny_model(), set.clone()).unwrap();
    assert_eq!(
        report.loaded,
        ["blocks.0.fc1", "blocks.1.fc2", "conv", "head"]
    );
    // One adapter is stored in bf16 and runs in bf16 (unit roundoff 2^-9 ≈ 2e-3).
    assert_eq!(model.blocks[1].fc2.adapter().unwrap().dtype(), DType::BF16);
    assert_matches("kohya, bf16 adapter in bf16", &model, "out_kohya", 4e-3);
    // Converted to f32 it matches to f32 precision.
    let (model, _) = load_adapters(tiny_model(), set.with_dtype(DType::F32)).unwrap();
    assert_matches("kohya, converted to f32", &model, "out_kohya", 1e-5);
}

#[test]
fn lycoris_lokr_file_gives_the_reference_output() {
    let (model, report) = apply_file("lokr_tiny.safetensors");
    assert_eq!(report.loaded, ["blocks.0.fc1", "blocks.1.fc2", "conv"]);
    let fc1 = model.blocks[0].fc1.adapter().unwrap();
    assert_eq!((fc1.rank(), fc1.scale()), (None, 1.0));
    assert_eq!(model.blocks[1].fc2.adapter().unwrap().scale(), 1.5);
    assert_matches("LyCORIS LoKr", &model, "out_lokr", 1e-5);
}

/// Every fixture survives export → save (each style) → load → load_adapters.
#[test]
fn every_fixture_round_trips_through_every_style() {
    let cases = [
        ("peft_tiny/adapter_model.safetensors", "out_peft", 1e-5),
        ("kohya_tiny.safetensors", "out_kohya", 4e-3),
        ("lokr_tiny.safetensors", "out_lokr", 1e-5),
    ];
    let styles = [
        SaveOptions::kohya(),
        SaveOptions::peft(),
        SaveOptions {
            peft_alpha: PeftAlpha::Baked,
            ..SaveOptions::peft()
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    for (file, expected, tolerance) in cases {
        let (model, _) = apply_file(file);
        let set = export(&model, LoraMetadata::default());
        for (i, options) in styles.iter().enumerate() {
            let path = dir.path().join(format!("{i}.safetensors"));
            save(&set, &path, options).unwrap();
            let (reloaded, report) = load_adapters(tiny_model(), load(&path).unwrap()).unwrap();
            assert!(report.is_complete(), "{file} {options:?}: {report}");
            let what = format!("{file} via {:?}/{:?}", options.format, options.peft_alpha);
            assert_matches(&what, &reloaded, expected, tolerance);
        }
    }
}

/// BFL's fused `qkv` of a width-8 double block and the diffusers layers it splits into.
fn qkv_map() -> NameMap {
    let slices = ["to_q", "to_k", "to_v"]
        .iter()
        .enumerate()
        .map(|(i, p)| RowSlice {
            target: format!("transformer_blocks.0.attn.{p}"),
            len: 8,
            rows: 0..8,
            to: 8 * i,
        })
        .collect();
    NameMap::new().split("double_blocks.0.img_attn.qkv", slices)
}

/// Split q, k, v LoRAs (diffusers names) written with BFL names become the exact file the
/// fixture script checked against ComfyUI's rule and diffusers' kohya FLUX converter.
#[test]
fn split_qkv_fuses_into_the_file_comfyui_and_diffusers_load() {
    let split = load(&fixture("qkv_split.safetensors")).unwrap();
    assert_eq!(split.len(), 3);
    let fused = qkv_map().from_target(&split).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qkv.safetensors");
    save(&fused, &path, &SaveOptions::kohya()).unwrap();

    let ours = Fixture::open_path(&path);
    let python = Fixture::open("qkv_fused_kohya.safetensors");
    assert_eq!(ours.keys(), python.keys());
    for key in python.keys() {
        assert_eq!(ours.get(&key), python.get(&key), "{key}");
    }

    // The fused update is the stack of the per-part updates, in q, k, v order.
    let fused_delta = fused.get("double_blocks.0.img_attn.qkv").unwrap().delta().2;
    let by_name = |n: &str| {
        part_delta(
            split
                .get(&format!("transformer_blocks.0.attn.{n}"))
                .unwrap(),
        )
    };
    let stacked: Vec<f64> = ["to_q", "to_k", "to_v"]
        .iter()
        .flat_map(|n| by_name(n))
        .collect();
    assert_eq!(fused_delta.len(), stacked.len());
    for (a, b) in fused_delta.iter().zip(&stacked) {
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    }

    // And back: BFL file → diffusers names gives the original adapters.
    let mut bfl: AdapterSet = load(&fixture("qkv_fused_kohya.safetensors")).unwrap();
    bfl.resolve_names(["double_blocks.0.img_attn.qkv"]).unwrap();
    let back = qkv_map().to_target(&bfl).unwrap();
    for (name, adapter) in split.iter() {
        let b = back.get(name).unwrap();
        assert_eq!(b.rank(), Some(2), "{name}");
        assert_eq!(part_delta(b), part_delta(adapter), "{name}");
    }
}

fn part_delta(adapter: &burn_lora::StoredAdapter) -> Vec<f64> {
    adapter.delta().2
}

#[test]
fn convert_between_styles_keeps_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let kohya = dir.path().join("kohya.safetensors");
    let peft = dir.path().join("peft.safetensors");
    let report = burn_lora::convert(
        &fixture("diffusers_tiny.safetensors"),
        &kohya,
        Format::Kohya,
    )
    .unwrap();
    assert_eq!(report.adapters, 6);
    assert!(report.dropped.is_empty());
    burn_lora::convert(&kohya, &peft, Format::Peft).unwrap();
    let keys = Fixture::open_path(&peft).keys();
    assert!(keys.contains(&"transformer.blocks.0.fc1.lora_A.weight".to_string()));
    for file in [&kohya, &peft] {
        let (model, _) = load_adapters(tiny_model(), load(file).unwrap()).unwrap();
        assert_matches(&format!("converted {file:?}"), &model, "out_peft", 1e-5);
    }

    // A kohya file from another tool has no module table: PEFT names cannot be recovered.
    let err = burn_lora::convert(&fixture("kohya_tiny.safetensors"), &peft, Format::Peft)
        .unwrap_err()
        .to_string();
    assert!(err.contains("resolve_names"), "{err}");
}
