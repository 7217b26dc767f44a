//! The SDXL LoRA files `burnlora train` writes (LoRA on the Linears, LoCon on the
//! convolutions), against what diffusers' and ComfyUI's own loaders made of them
//! (fixtures/tools/sdxl, made once by make_sdxl_fixtures.py): both apply every one of the tiny
//! UNet's 263 adapted layers of the kohya file (SGM names), diffusers every one of the PEFT file
//! (diffusers names), each by exactly the trained update. Of the PEFT file, ComfyUI reads only
//! the layers outside the attention projections, at alpha = rank.

// The FLUX-specific helpers of the shared module are not used here.
#[allow(dead_code)]
mod tools;

use burn_diffusion::sdxl::{ModuleKind, UNetLayout, unet_modules};
use burn_lora::{AdapterSet, Format, LayoutNames};
use burn_lora_train::config::{Arch, ModelSource};
use burn_lora_train::lora_names;
use tools::{Tensors, assert_updates, fixture, read};

/// The formats whose files diffusers reads.
const FORMATS: [(Format, &str); 2] = [(Format::Kohya, "kohya"), (Format::Peft, "peft")];

/// The block structure of `model.path: tiny` for `model.arch: sdxl`: SDXL's at widths 8, 16,
/// 16, with 1 and 2 transformer blocks where SDXL has 2 and 10.
fn tiny_layout() -> UNetLayout {
    UNetLayout {
        block_out_channels: vec![8, 16, 16],
        layers_per_block: 2,
        transformer_depth: vec![0, 1, 2],
        mid_depth: 2,
    }
}

fn tiny_names() -> LayoutNames {
    let names = lora_names(Arch::Sdxl, &ModelSource::Tiny).unwrap();
    assert_eq!(names, burn_diffusion::sdxl::lora_names(&tiny_layout()));
    names
}

/// The adapters `burnlora train` wrote, keyed by the model's module paths (diffusers' names).
fn trained() -> AdapterSet {
    tiny_names()
        .load(&fixture("sdxl/lora_kohya.safetensors"))
        .unwrap()
}

/// Every adapted layer's update under its diffusers weight key, with the fixture's shape of
/// that weight (`[out, in]`, or `[out, in, kh, kw]` for a convolution) where the update has as
/// many values and the same rows.
fn diffusers_updates(set: &AdapterSet, shapes: &Tensors) -> Tensors {
    set.iter()
        .map(|(module, adapter)| {
            let key = format!("{module}.weight");
            let (rows, cols, delta) = adapter.delta();
            let shape = match shapes.get(&key) {
                Some((shape, _))
                    if shape[0] == rows && shape.iter().product::<usize>() == rows * cols =>
                {
                    shape.clone()
                }
                _ => vec![rows, cols],
            };
            (key, (shape, delta))
        })
        .collect()
}

#[test]
fn every_adaptable_layer_of_the_unet_is_adapted_in_the_fixture() {
    let set = trained();
    assert_eq!(set.len(), 263);
    for module in unet_modules(&tiny_layout()) {
        let alpha = match module.kind {
            ModuleKind::Linear { .. } => 8.0,
            ModuleKind::Conv2d => 2.0,
            ModuleKind::Norm => continue,
        };
        let adapter = set
            .get(&module.diffusers)
            .unwrap_or_else(|| panic!("{} is not adapted", module.diffusers));
        assert_eq!((adapter.rank(), adapter.alpha()), (Some(4), alpha));
    }
}

/// Our writer, today, writes exactly the files diffusers loaded.
#[test]
fn the_writer_writes_the_files_the_tools_loaded() {
    tools::assert_writer_writes_the_fixtures(&tiny_names(), &trained(), "sdxl/", &FORMATS);
}

/// Every update of `updates` (under diffusers' weight keys) under the SGM key of its layer,
/// as ComfyUI's UNet holds it.
fn under_sgm_keys(updates: Tensors) -> Tensors {
    let sgm: std::collections::BTreeMap<String, String> = unet_modules(&tiny_layout())
        .into_iter()
        .map(|m| {
            (
                format!("{}.weight", m.diffusers),
                format!("{}.weight", m.sgm),
            )
        })
        .collect();
    updates
        .into_iter()
        .map(|(key, update)| (sgm[&key].clone(), update))
        .collect()
}

/// ComfyUI patches every weight the kohya file names by exactly the trained update.
#[test]
fn comfyui_applies_every_update_of_the_kohya_file() {
    let set = trained();
    let (shapes, _) = read(&fixture("sdxl/diffusers_kohya.safetensors"));
    let expected = under_sgm_keys(diffusers_updates(&set, &shapes));
    let (found, _) = read(&fixture("sdxl/comfyui_kohya.safetensors"));
    assert_updates("ComfyUI, kohya file", &found, &expected);
}

/// What ComfyUI makes of the PEFT file, which is diffusers' layout rather than its own: it
/// skips the attention projections (it looks for them under diffusers' older
/// `attn1.processor.to_q` paths) and, reading no `lora_adapter_metadata`, applies the others at
/// alpha = rank. CONFIG.md sends ComfyUI users to the kohya format for this reason.
#[test]
fn comfyui_reads_the_peft_file_only_in_part() {
    let set = trained();
    let (shapes, _) = read(&fixture("sdxl/diffusers_peft.safetensors"));
    let projection = |module: &str| {
        [".to_q", ".to_k", ".to_v", ".to_out.0"]
            .iter()
            .any(|p| module.ends_with(p))
    };
    let expected: Tensors = diffusers_updates(&set, &shapes)
        .into_iter()
        .filter_map(|(key, (shape, delta))| {
            let module = key.strip_suffix(".weight").unwrap();
            let adapter = set.get(module).unwrap();
            let unscaled = adapter.rank().unwrap() as f64 / adapter.alpha() as f64;
            (!projection(module))
                .then(|| (key, (shape, delta.iter().map(|v| v * unscaled).collect())))
        })
        .collect();
    assert_eq!(expected.len(), 127);
    let (found, _) = read(&fixture("sdxl/comfyui_peft.safetensors"));
    assert_updates("ComfyUI, PEFT file", &found, &under_sgm_keys(expected));
}

/// diffusers patches every weight the kohya and PEFT files name by exactly the trained
/// alpha / rank · up · down (LoCon's updates reshaped to the convolutions' kernels).
#[test]
fn diffusers_applies_every_update() {
    let set = trained();
    for (_, name) in FORMATS {
        let (found, _) = read(&fixture(&format!("sdxl/diffusers_{name}.safetensors")));
        let expected = diffusers_updates(&set, &found);
        assert_updates(&format!("diffusers, {name} file"), &found, &expected);
    }
}
