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
