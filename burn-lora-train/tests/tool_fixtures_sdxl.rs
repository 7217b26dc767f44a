//! The SDXL LoRA files `burnlora train` writes (LoRA on the Linears, LoCon on the
//! convolutions, LoRA on both text encoders), against what diffusers' and ComfyUI's own loaders
//! made of them (fixtures/tools/sdxl, made once by make_sdxl_fixtures.py): both apply every one
//! of the tiny UNet's 263 adapted layers and the text encoders' 36 of the kohya file (SGM and
//! `lora_te1_` / `lora_te2_` names), diffusers every one of the PEFT file (diffusers names), each
//! by exactly the trained update. Of the PEFT file, ComfyUI reads every layer but the UNet's
//! attention projections, at alpha = rank.

// The FLUX-specific helpers of the shared module are not used here.
#[allow(dead_code)]
mod tools;

use burn_diffusion::sdxl::{ModuleKind, UNetLayout, text_encoder_names, unet_modules};
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

/// The tiny model's names: the UNet's under `unet.`, and the two 3-layer CLIPs'.
fn tiny_names() -> LayoutNames {
    let names = lora_names(Arch::Sdxl, &ModelSource::Tiny).unwrap();
    let unet = burn_diffusion::sdxl::lora_names(&tiny_layout());
    assert_eq!(names.checkpoint, unet.checkpoint.nested("unet."));
    assert_eq!(names.diffusers, unet.diffusers.nested("unet."));
    assert_eq!(names.components, text_encoder_names((3, 3)));
    names
}

/// Where diffusers and ComfyUI keep the weight of a layer at model path `module`: diffusers
/// under its component's name and the model's key (`unet.down_blocks…`; transformers 5's
/// `CLIPTextModel` has no `text_model.` level, its `CLIPTextModelWithProjection` has:
/// `text_encoder.encoder…`, `text_encoder_2.text_model.encoder…`), ComfyUI by the SGM UNet's
/// path or its CLIPs' (`clip_l.transformer.text_model.encoder…`).
fn weight_keys(module: &str) -> (String, String) {
    let encoders = [
        ("text_encoder_2.", "text_model.", "clip_g"),
        ("text_encoder.", "", "clip_l"),
    ];
    if let Some((prefix, level, clip)) = encoders.iter().find(|(p, _, _)| module.starts_with(p)) {
        let layer = &module[prefix.len()..];
        return (
            format!("{prefix}{level}{layer}.weight"),
            format!("{clip}.transformer.text_model.{layer}.weight"),
        );
    }
    let unet = module.strip_prefix("unet.").expect("a UNet layer");
    let sgm = unet_modules(&tiny_layout())
        .into_iter()
        .find(|m| m.diffusers == unet)
        .expect("a layer of the tiny UNet")
        .sgm;
    (format!("{module}.weight"), format!("{sgm}.weight"))
}

/// The adapters `burnlora train` wrote, keyed by the model's module paths (`unet.` + diffusers'
/// names, `text_encoder.` / `text_encoder_2.` + transformers').
fn trained() -> AdapterSet {
    tiny_names()
        .load(&fixture("sdxl/lora_kohya.safetensors"))
        .unwrap()
}

/// Every adapted layer's update (those that moved: CLIP-L's last layer feeds nothing SDXL
/// reads) under its diffusers weight key, with the fixture's shape of that weight (`[out, in]`,
/// or `[out, in, kh, kw]` for a convolution) where the update has as many values and the same
/// rows.
fn diffusers_updates(set: &AdapterSet, shapes: &Tensors) -> Tensors {
    set.iter()
        .filter(|(_, adapter)| adapter.delta().2.iter().any(|v| *v != 0.0))
        .map(|(module, adapter)| {
            let key = weight_keys(module).0;
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
fn every_adaptable_layer_is_adapted_in_the_fixture() {
    let set = trained();
    assert_eq!(set.len(), 263 + 36);
    for module in unet_modules(&tiny_layout()) {
        let alpha = match module.kind {
            ModuleKind::Linear { .. } => 8.0,
            ModuleKind::Conv2d => 2.0,
            ModuleKind::Norm => continue,
        };
        let adapter = set
            .get(&format!("unet.{}", module.diffusers))
            .unwrap_or_else(|| panic!("{} is not adapted", module.diffusers));
        assert_eq!((adapter.rank(), adapter.alpha()), (Some(4), alpha));
    }
    for component in text_encoder_names((3, 3)) {
        for layer in component.names.target_names() {
            let module = format!(
                "{}{}",
                component.module_prefix,
                layer.trim_start_matches("text_model.")
            );
            let adapter = set
                .get(&module)
                .unwrap_or_else(|| panic!("{module} is not adapted"));
            assert_eq!((adapter.rank(), adapter.alpha()), (Some(4), 8.0));
        }
    }
}

/// Our writer, today, writes exactly the files diffusers loaded.
#[test]
fn the_writer_writes_the_files_the_tools_loaded() {
    tools::assert_writer_writes_the_fixtures(&tiny_names(), &trained(), "sdxl/", &FORMATS);
}

/// Every update of `updates` (under diffusers' weight keys) under the key ComfyUI holds its
/// layer's weight by.
fn under_comfyui_keys(updates: Tensors) -> Tensors {
    let comfyui: std::collections::BTreeMap<String, String> = trained()
        .iter()
        .map(|(module, _)| weight_keys(module))
        .collect();
    updates
        .into_iter()
        .map(|(key, update)| (comfyui[&key].clone(), update))
        .collect()
}

/// ComfyUI patches every weight the kohya file names by exactly the trained update.
#[test]
fn comfyui_applies_every_update_of_the_kohya_file() {
    let set = trained();
    let (shapes, _) = read(&fixture("sdxl/diffusers_kohya.safetensors"));
    let expected = under_comfyui_keys(diffusers_updates(&set, &shapes));
    let (found, _) = read(&fixture("sdxl/comfyui_kohya.safetensors"));
    assert_updates("ComfyUI, kohya file", &found, &expected);
}

/// What ComfyUI makes of the PEFT file, which is diffusers' layout rather than its own: it
/// skips the UNet's attention projections (it looks for them under diffusers' older
/// `attn1.processor.to_q` paths) and, reading no `lora_adapter_metadata`, applies the others
/// (the text encoders' included) at alpha = rank. CONFIG.md sends ComfyUI users to the kohya
/// format for this reason.
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
            let (module, adapter) = set
                .iter()
                .find(|(module, _)| weight_keys(module).0 == key)
                .unwrap();
            let unscaled = adapter.rank().unwrap() as f64 / adapter.alpha() as f64;
            (!projection(module))
                .then(|| (key, (shape, delta.iter().map(|v| v * unscaled).collect())))
        })
        .collect();
    // The UNet's 263 layers but its 136 attention projections, and the 30 encoder layers that
    // moved.
    assert_eq!(expected.len(), 127 + 30);
    let (found, _) = read(&fixture("sdxl/comfyui_peft.safetensors"));
    assert_updates("ComfyUI, PEFT file", &found, &under_comfyui_keys(expected));
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
