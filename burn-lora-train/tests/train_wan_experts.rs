//! Two experts training one LoRA by turns, as Wan 2.2 A14B trains in musubi-tuner: the tiny Wan
//! example with a second tiny transformer (`model.transformer_2: tiny`) switched at timestep 500.
//! Both experts train, the file is one LoRA of the single model's names, and an interrupted run
//! continues exactly, the expert of each step included. (Its own test binary: the device's
//! random generator is global to the process.)

mod common;

use std::path::Path;

use burn_lora_train::config::{ModelSource, TrainPlan, TrainSettings};
use burn_lora_train::experts::Expert;
use burn_lora_train::train::Resume;
use common::{example_plan, run, weights};

fn experts_plan(output: &Path, steps: u64) -> TrainPlan {
    let mut plan = example_plan("wan.yaml", output, steps);
    plan.model.transformer_2 = Some(ModelSource::Tiny);
    plan.train.timestep_boundary = 0.5;
    plan
}

#[test]
fn two_tiny_experts_train_one_lora_by_turns_and_resume_exactly() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let straight = run(&experts_plan(dirs[0].path(), 6), Resume::Auto).unwrap();
    assert!(straight.losses.iter().all(|l| l.is_finite() && *l > 0.0));
    assert_eq!(straight.experts.len(), 6);
    for expert in [Expert::HighNoise, Expert::LowNoise] {
        assert!(straight.experts.contains(&expert), "{:?}", straight.experts);
    }
    let lora = straight.lora.clone().unwrap();
    let set = burn_lora_train::lora_names(burn_lora_train::config::Arch::Wan, &ModelSource::Tiny)
        .unwrap()
        .load(&lora)
        .unwrap();
    assert_eq!(set.len(), 26);

    // The same run with one expert trains otherwise.
    let mut single = experts_plan(dirs[1].path(), 6);
    single.model.transformer_2 = None;
    let single = run(&single, Resume::Auto).unwrap();
    assert!(single.experts.is_empty());
    assert_ne!(single.losses, straight.losses);

    let first = experts_plan(dirs[2].path(), 3);
    let interrupted = run(&first, Resume::Auto).unwrap();
    assert_eq!(interrupted.experts, straight.experts[..3]);
    let second = TrainPlan {
        train: TrainSettings {
            steps: 6,
            ..first.train.clone()
        },
        ..first
    };
    let resumed = run(&second, Resume::Required).unwrap();
    assert_eq!(resumed.started_at, 3);
    assert_eq!(resumed.experts, straight.experts[3..]);
    assert_eq!(resumed.losses, straight.losses[3..]);
    assert_eq!(weights(&resumed.lora.unwrap()), weights(&lora));
}
