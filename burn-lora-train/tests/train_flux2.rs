//! `burnlora train` on the tiny FLUX.2 example (`examples/tiny/flux2.yaml`: a small random
//! dev-shaped FLUX.2 with a tiny VAE and text decoder, six 64×64 images): the run writes an
//! ai-toolkit LoRA under FLUX.2's BFL names, and an interrupted run continues exactly. (Its own test binary: the device's random generator is global to the process.)

mod common;

use burn_lora::Role;
use burn_lora_train::config::{Arch, ModelSource, TimestepSampling, TrainPlan, TrainSettings};
use burn_lora_train::train::Resume;
use common::{example_plan, run, weights};
use safetensors::SafeTensors;

fn plan(output: &std::path::Path, steps: u64) -> TrainPlan {
    let mut plan = example_plan("flux2.yaml", output, steps);
    plan.train.gradient_checkpointing = burn_diffusion::Checkpointing::Blocks;
    plan
}

#[test]
fn the_tiny_flux2_trains_saves_and_resumes_exactly() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = plan(a.path(), 4);
    assert_eq!(straight.model.arch, Arch::Flux2);
    assert_eq!(straight.train.timestep, TimestepSampling::ResolutionShift);
    let straight = run(&straight, Resume::Auto).unwrap();
    assert!(straight.losses.iter().all(|l| l.is_finite() && *l > 0.0));

    let lora = straight.lora.clone().unwrap();
    let bytes = std::fs::read(&lora).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut modules: Vec<String> = file
        .names()
        .iter()
        .filter_map(|k| k.strip_suffix(".lora_A.weight"))
        .map(str::to_string)
        .collect();
    modules.sort();
    // 2 double blocks × (qkv, proj, mlp.0, mlp.2) × 2 streams + 2 single blocks × 2.
    assert_eq!(modules.len(), 20);
    assert!(modules.contains(&"diffusion_model.double_blocks.1.txt_mlp.2".to_string()));
    assert!(modules.contains(&"diffusion_model.single_blocks.0.linear1".to_string()));
    assert!(modules.iter().all(|m| m.starts_with("diffusion_model.")));
    let set = burn_lora_train::lora_names(Arch::Flux2, &ModelSource::Tiny)
        .unwrap()
        .load(&lora)
        .unwrap();
    assert_eq!(set.len(), 20);
    // diffusers' FLUX.2 loaders refuse `.alpha` keys: alpha / rank is in lora_B.
    assert!(file.names().iter().all(|k| !k.ends_with(".alpha")));
    assert!(set.iter().all(|(_, adapter)| adapter.scale() == 1.0));
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
