//! The SDXL LoRA files `burnlora train` writes (LoRA on the Linears, LoCon on the
//! convolutions), against what diffusers' own loader made of them (fixtures/tools/sdxl, made
//! once by make_sdxl_fixtures.py): diffusers applies every one of the tiny UNet's 263 adapted
//! layers of the kohya file (SGM names) and of the PEFT file (diffusers names), each by
//! exactly the trained update.

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
