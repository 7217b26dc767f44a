//! `burnlora train` on the tiny SDXL example (`examples/tiny/sdxl.yaml`: a small random
//! SDXL-shaped UNet with a tiny 4-channel VAE and two tiny CLIPs, six 64×64 images, LoRA on the
//! Linears and LoCon on the convolutions, min-SNR-γ): the run writes a kohya LoRA under the
//! original UNet's names, with checkpointing and v-prediction too, and an interrupted run
//! continues exactly. (Its own test binary: the device's random generator is global to the
//! process.)

mod common;

use burn_lora::Role;
use burn_lora_train::config::{
    Arch, ModelSource, Prediction, TimestepSampling, TrainPlan, TrainSettings,
};
use burn_lora_train::train::Resume;
use common::{example_plan, run, weights};
use safetensors::SafeTensors;

fn plan(output: &std::path::Path, steps: u64) -> TrainPlan {
    let mut plan = example_plan("sdxl.yaml", output, steps);
    plan.train.gradient_checkpointing = burn_diffusion::Checkpointing::Blocks;
    plan.train.ddpm.prediction = Prediction::Velocity;
    plan.train.ddpm.noise_offset = 0.05;
    plan
}

#[test]
fn the_tiny_sdxl_trains_saves_and_resumes_exactly() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = plan(a.path(), 4);
    assert_eq!(straight.model.arch, Arch::Sdxl);
    assert_eq!(straight.train.timestep, TimestepSampling::Uniform);
    assert_eq!(straight.train.ddpm.min_snr_gamma, Some(5.0));
    let straight = run(&straight, Resume::Auto).unwrap();
    assert!(straight.losses.iter().all(|l| l.is_finite() && *l > 0.0));

    let lora = straight.lora.clone().unwrap();
    let bytes = std::fs::read(&lora).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let modules: Vec<&str> = file
        .names()
        .into_iter()
        .filter_map(|k| k.strip_suffix(".lora_down.weight"))
        .collect();
    assert_eq!(modules.len(), 263);
    for name in [
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
        "lora_unet_input_blocks_1_0_in_layers_2",
        "lora_unet_output_blocks_2_2_conv",
        "lora_unet_middle_block_1_proj_in",
    ] {
        assert!(modules.contains(&name), "{name}");
    }
    let set = burn_lora_train::lora_names(Arch::Sdxl, &ModelSource::Tiny)
        .unwrap()
        .load(&lora)
        .unwrap();
    assert_eq!(set.len(), 263);
    let trained = weights(&lora)
        .iter()
        .filter(|(_, role, _)| *role == Role::Up)
        .any(|(_, _, bits)| bits.iter().any(|b| f32::from_bits(*b) != 0.0));
    assert!(trained, "the up matrices start at zero and must have moved");

    let first = plan(b.path(), 2);
    run(&first, Resume::Auto).unwrap();
    let second = TrainPlan {
        train: TrainSettings {
            steps: 4,
            ..first.train.clone()
        },
        ..first
    };
    let resumed = run(&second, Resume::Required).unwrap();
    assert_eq!(resumed.started_at, 2);
    assert_eq!(resumed.losses, straight.losses[2..]);
    assert_eq!(weights(&lora), weights(&resumed.lora.unwrap()));
}

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
