//! The FLUX.2 LoRA files `burnlora train` writes, against what ComfyUI's and diffusers' own
//! loaders made of them (fixtures/tools/flux2, made once by make_flux2_fixtures.py, whose doc
//! gives the tools' code that cannot load, or misapplies, the layers listed here). What each
//! tool applies of the 31 layers, every one checked against the trained update but the one
//! diffusers misapplies (checked against what it applies instead):
//! - kohya file: ComfyUI 31, diffusers 25 (not [`DIFFUSERS_KOHYA_UNREAD`]);
//! - PEFT file: ComfyUI 24 (not [`COMFYUI_PEFT_UNREAD`]), diffusers 31;
//! - ai-toolkit file: ComfyUI 31, diffusers 31, [`DIFFUSERS_AI_TOOLKIT_UNSWAPPED`] with its
//!   halves unswapped.

mod tools;

use burn_diffusion::flux::LinearKeys;
use burn_diffusion::flux2::{Flux2Config, linear_keys};
use burn_lora::{AdapterSet, LayoutNames};
use burn_lora_train::config::{Arch, ModelSource};
use burn_lora_train::lora_names;
use tools::{FORMATS, Tensors, assert_updates, fixture, read};

/// What ComfyUI does not read of the PEFT file, by diffusers name: its diffusers names for
/// FLUX.2 are FLUX.1's (`time_text_embed.*`, per-block modulations), so the layers FLUX.2 added
/// or renamed have no key in its map (comfy/utils.py `flux_to_diffusers`).
const COMFYUI_PEFT_UNREAD: [&str; 7] = [
    "time_guidance_embed.timestep_embedder.linear_1",
    "time_guidance_embed.timestep_embedder.linear_2",
    "time_guidance_embed.guidance_embedder.linear_1",
    "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.linear",
    "single_stream_modulation.linear",
];

/// What diffusers' kohya FLUX.2 converter leaves out, by BFL name: it maps the blocks, `img_in`,
/// `txt_in`, `time_in` and `final_layer.linear` only (`_convert_kohya_flux2_lora_to_diffusers`).
const DIFFUSERS_KOHYA_UNREAD: [&str; 6] = [
    "guidance_in.in_layer",
    "guidance_in.out_layer",
    "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.lin",
    "single_stream_modulation.lin",
    "final_layer.adaLN_modulation.1",
];

/// What diffusers applies wrongly of the ai-toolkit file, by BFL name: its ai-toolkit FLUX.2
/// converter maps `final_layer.adaLN_modulation.1` to `norm_out.linear` without swapping BFL's
/// (shift, scale) halves into diffusers' (scale, shift) (loaders/lora_conversion_utils.py
/// `_convert_non_diffusers_flux2_lora_to_diffusers`, `extra_mappings`, line 2555; its FLUX.2
/// checkpoint converter does swap them, loaders/single_file_utils.py line 3937), so it applies
/// the final modulation's shift update as its scale and back. A diffusers bug, not ours: the
/// same adapter in the PEFT file, under `norm_out.linear` with the halves swapped, is applied
/// right.
const DIFFUSERS_AI_TOOLKIT_UNSWAPPED: [&str; 1] = ["final_layer.adaLN_modulation.1"];

/// The shape of `model.path: tiny` for `model.arch: flux2`.
fn tiny_config() -> Flux2Config {
    Flux2Config::new(16, 16, 96, 32, 2, 2, 2, vec![4; 4], true)
}

fn tiny_names() -> LayoutNames {
    let names = lora_names(Arch::Flux2, &ModelSource::Tiny).unwrap();
    assert_eq!(names, burn_diffusion::flux2::lora_names(&tiny_config()));
    names
}

/// The adapters `burnlora train` wrote, keyed by the model's module paths.
fn trained() -> AdapterSet {
    tiny_names()
        .load(&fixture("flux2/lora_kohya.safetensors"))
        .unwrap()
}

fn keys() -> Vec<LinearKeys> {
    linear_keys(&tiny_config())
}

#[test]
fn every_layer_of_the_model_is_adapted_in_the_fixture() {
    let keys = keys();
    assert_eq!(keys.len(), 2 + 4 + 3 + 2 * 8 + 2 * 2 + 2);
    tools::assert_every_layer_adapted(&trained(), &keys);
}

/// Our writer, today, writes exactly the files the tools loaded.
#[test]
fn the_writer_writes_the_files_the_tools_loaded() {
    tools::assert_writer_writes_the_fixtures(&tiny_names(), &trained(), "flux2/", &FORMATS);
}

/// ComfyUI patches every weight of the kohya and ai-toolkit files by exactly the trained
/// alpha / rank · up · down (from `.alpha` in the kohya file, baked into `lora_B` in the
/// others), and of the PEFT file every weight but those it has no name for (the final
/// modulation's halves swapped back, the blocks' split projections fused).
#[test]
fn comfyui_applies_every_update_it_can() {
    let (set, keys) = (trained(), keys());
    for (_, name) in FORMATS {
        let read_by_comfyui = tools::only(&set, &keys, |k| {
            name != "peft" || !COMFYUI_PEFT_UNREAD.contains(&k.diffusers[0].target.as_str())
        });
        let (found, _) = read(&fixture(&format!("flux2/comfyui_{name}.safetensors")));
        let expected = tools::bfl_updates(&keys, &read_by_comfyui);
        assert_updates(&format!("ComfyUI, {name} file"), &found, &expected);
    }
    let unread = keys
        .iter()
        .filter(|k| COMFYUI_PEFT_UNREAD.contains(&k.diffusers[0].target.as_str()));
    assert_eq!(unread.count(), COMFYUI_PEFT_UNREAD.len());
}

/// diffusers applies every update of the kohya file its converter reads, split into
/// `to_q` / `to_k` / `to_v` (`add_*_proj`) as the key table splits the fused `qkv`.
#[test]
fn diffusers_applies_every_update_of_the_kohya_file_it_reads() {
    let (set, keys) = (trained(), keys());
    let read_by_diffusers = tools::only(&set, &keys, |k| {
        !DIFFUSERS_KOHYA_UNREAD.contains(&k.bfl.as_str())
    });
    assert_eq!(
        read_by_diffusers.len(),
        keys.len() - DIFFUSERS_KOHYA_UNREAD.len()
    );
    let (found, _) = read(&fixture("flux2/diffusers_kohya.safetensors"));
    let expected = tools::diffusers_updates(&keys, &read_by_diffusers);
    assert_updates("diffusers, kohya file", &found, &expected);
}

/// diffusers applies the PEFT file whole, each update as trained (alpha / rank is in lora_B).
#[test]
fn diffusers_applies_the_peft_file_whole() {
    let (set, keys) = (trained(), keys());
    let (found, _) = read(&fixture("flux2/diffusers_peft.safetensors"));
    let expected = tools::diffusers_updates(&keys, &set);
    assert_updates("diffusers, peft file", &found, &expected);
}

/// diffusers applies every layer of the ai-toolkit file: each update as trained, but for the
/// final modulation, which it applies with BFL's halves in diffusers' places
/// ([`DIFFUSERS_AI_TOOLKIT_UNSWAPPED`]).
#[test]
fn diffusers_applies_the_ai_toolkit_file_whole_but_the_final_modulation_unswapped() {
    let (set, keys) = (trained(), keys());
    let (mut found, _) = read(&fixture("flux2/diffusers_ai-toolkit.safetensors"));
    let unswapped: Vec<&LinearKeys> = keys
        .iter()
        .filter(|k| DIFFUSERS_AI_TOOLKIT_UNSWAPPED.contains(&k.bfl.as_str()))
        .collect();
    assert_eq!(unswapped.len(), DIFFUSERS_AI_TOOLKIT_UNSWAPPED.len());

    for k in unswapped {
        // Both halves go to one diffusers weight, swapped.
        let target = &k.diffusers[0].target;
        assert!(k.diffusers.iter().all(|slice| &slice.target == target));
        let key = format!("{target}.weight");
        let applied = found.remove(&key).unwrap_or_else(|| panic!("{key}"));
        let one = tools::only(&set, &keys, |other| other.module == k.module);
        // What diffusers applied is the update in BFL row order...
        let bfl = tools::bfl_updates(&keys, &one);
        let as_in_file = Tensors::from([(key.clone(), bfl[&format!("{}.weight", k.bfl)].clone())]);
        assert_updates(
            "diffusers, ai-toolkit file, final modulation",
            &Tensors::from([(key.clone(), applied.clone())]),
            &as_in_file,
        );
        // ...which is not the update the model trained, in diffusers' row order.
        let trained = &tools::diffusers_updates(&keys, &one)[&key];
        assert_ne!(applied, *trained, "{key}: diffusers now swaps the halves");
    }

    let rest = tools::only(&set, &keys, |k| {
        !DIFFUSERS_AI_TOOLKIT_UNSWAPPED.contains(&k.bfl.as_str())
    });
    assert_eq!(
        rest.len(),
        keys.len() - DIFFUSERS_AI_TOOLKIT_UNSWAPPED.len()
    );
    let expected = tools::diffusers_updates(&keys, &rest);
    assert_updates("diffusers, ai-toolkit file", &found, &expected);
}
