//! The Wan LoRA files `burnlora train` writes, against what diffusers' and ComfyUI's own
//! loaders made of them (fixtures/tools/wan, made once by make_wan_fixtures.py): diffusers
//! applies every one of the tiny transformer's 20 adapted block Linears of the kohya
//! (musubi-tuner's names), ai-toolkit (ComfyUI's `diffusion_model.` names) and PEFT files,
//! ComfyUI every one of the kohya and ai-toolkit files, each by exactly the trained update.

// The FLUX-specific helpers of the shared module are not used here.
#[allow(dead_code)]
mod tools;

use burn_diffusion::wan::original_name;
use burn_lora::{AdapterSet, Format, LayoutNames};
use burn_lora_train::config::{Arch, ModelSource};
use burn_lora_train::lora_names;
use tools::{Tensors, assert_updates, fixture, read};

/// Every format, with its file name.
const FORMATS: [(Format, &str); 3] = [
    (Format::Kohya, "kohya"),
    (Format::AiToolkit, "ai-toolkit"),
    (Format::Peft, "peft"),
];

fn tiny_names() -> LayoutNames {
    lora_names(Arch::Wan, &ModelSource::Tiny).unwrap()
}

/// The adapters `burnlora train` wrote, keyed by the model's module paths (diffusers' names).
fn trained() -> AdapterSet {
    tiny_names()
        .load(&fixture("wan/lora_kohya.safetensors"))
        .unwrap()
}

/// Every adapted layer's update `[out, in]` under its weight key, named by `name` from the
/// diffusers module path.
fn updates(set: &AdapterSet, name: impl Fn(&str) -> String) -> Tensors {
    set.iter()
        .map(|(module, adapter)| {
            let (rows, cols, delta) = adapter.delta();
            (name(&format!("{module}.weight")), (vec![rows, cols], delta))
        })
        .collect()
}

#[test]
fn every_block_linear_is_adapted_in_the_fixture() {
    let set = trained();
    assert_eq!(set.len(), 20);
    for (module, adapter) in set.iter() {
        assert!(module.starts_with("blocks."), "{module}");
        assert_eq!(
            (adapter.rank(), adapter.alpha()),
            (Some(4), 8.0),
            "{module}"
        );
    }
}

/// Our writer, today, writes exactly the files the tools loaded.
#[test]
fn the_writer_writes_the_files_the_tools_loaded() {
    tools::assert_writer_writes_the_fixtures(&tiny_names(), &trained(), "wan/", &FORMATS);
}

/// ComfyUI patches every weight the kohya and ai-toolkit files name, under Wan's original
/// keys, by exactly the trained update.
#[test]
fn comfyui_applies_every_update() {
    let expected = updates(&trained(), original_name);
    for name in ["kohya", "ai-toolkit"] {
        let (found, _) = read(&fixture(&format!("wan/comfyui_{name}.safetensors")));
        assert_updates(&format!("ComfyUI, {name} file"), &found, &expected);
    }
}

/// diffusers patches every weight each file names by exactly the trained alpha / rank · up ·
/// down.
#[test]
fn diffusers_applies_every_update() {
    let expected = updates(&trained(), str::to_string);
    for (_, name) in FORMATS {
        let (found, _) = read(&fixture(&format!("wan/diffusers_{name}.safetensors")));
        assert_updates(&format!("diffusers, {name} file"), &found, &expected);
    }
}
