//! `burnlora train` on the tiny SDXL example (`examples/tiny/sdxl.yaml`) with
//! `train.train_text_encoder`. (Its own test binary: the device's random generator is global
//! to the process.)

mod common;

use burn_lora_train::config::{Arch, ModelSource};
use burn_lora_train::train::Resume;
use common::{example_plan, run};
use safetensors::SafeTensors;

/// With `train.train_text_encoder`, both tiny CLIPs get LoRA on every layer's attention and
/// MLP Linears, saved under kohya's `lora_te1_` / `lora_te2_` names beside the UNet's; their
/// adapters start at zero, so the first step's loss is the frozen encoders' (whose states the
/// other run cached), and the adapters of the layers SDXL reads move.
#[test]
fn the_tiny_sdxl_trains_its_text_encoders() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let frozen = run(&example_plan("sdxl.yaml", a.path(), 2), Resume::Auto).unwrap();
    let mut plan = example_plan("sdxl.yaml", b.path(), 2);
    plan.train.train_text_encoder = true;
    let trained = run(&plan, Resume::Auto).unwrap();
    let (first, cached) = (trained.losses[0], frozen.losses[0]);
    assert!(
        (first - cached).abs() <= 1e-6 * cached.abs(),
        "first loss {first} with the encoders training, {cached} with their states cached"
    );

    let lora = trained.lora.unwrap();
    let bytes = std::fs::read(&lora).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let modules = |prefix: &str| {
        file.names()
            .into_iter()
            .filter(|k| k.starts_with(prefix) && k.ends_with(".lora_down.weight"))
            .count()
    };
    // 3 layers × (q, k, v, out, fc1, fc2) in each encoder.
    assert_eq!(modules("lora_te1_text_model_encoder_layers_"), 18);
    assert_eq!(modules("lora_te2_text_model_encoder_layers_"), 18);
    assert_eq!(modules("lora_unet_"), 263);

    let set = burn_lora_train::lora_names(Arch::Sdxl, &ModelSource::Tiny)
        .unwrap()
        .load(&lora)
        .unwrap();
    assert_eq!(set.len(), 263 + 36);
    assert!(set.unrecognized_keys().is_empty());
    // SDXL reads CLIP-L's penultimate states, so its last layer gets no gradient (as in
    // kohya's runs); every other encoder layer moves.
    for (name, adapter) in set.iter().filter(|(n, _)| n.starts_with("text_encoder")) {
        let (_, _, delta) = adapter.delta();
        let moved = delta.iter().any(|v| *v != 0.0);
        let unread = name.starts_with("text_encoder.encoder.layers.2.");
        assert_eq!(moved, !unread, "{name}");
    }
    assert!(set.get("text_encoder_2.encoder.layers.2.mlp.fc2").is_some());
}
