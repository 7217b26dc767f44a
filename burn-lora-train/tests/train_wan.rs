//! `burnlora train` on the tiny Wan example (`examples/tiny/wan.yaml`: a small random
//! Wan-shaped transformer with a tiny causal 3-D VAE and a tiny umT5): on the tiny images as
//! one-frame clips it writes a kohya LoRA under musubi-tuner's names; on a dataset of 5-frame
//! video clips (tests/fixtures/video) it trains with checkpointing and an interrupted run
//! continues exactly. (Its own test binary: the device's random generator is global to the
//! process.)

mod common;

use std::path::Path;

use burn_lora_train::config::{Arch, ModelSource, TimestepSampling, TrainPlan, TrainSettings};
use burn_lora_train::train::Resume;
use common::{example_plan, run, weights};
use safetensors::SafeTensors;

#[test]
fn the_tiny_wan_trains_on_images_and_saves_musubi_names() {
    let dir = tempfile::tempdir().unwrap();
    let plan = example_plan("wan.yaml", dir.path(), 2);
    assert_eq!(plan.model.arch, Arch::Wan);
    assert_eq!(plan.train.timestep, TimestepSampling::Shift(3.0));
    let summary = run(&plan, Resume::Auto).unwrap();
    assert!(summary.losses.iter().all(|l| l.is_finite() && *l > 0.0));
    let lora = summary.lora.unwrap();
    let bytes = std::fs::read(&lora).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let modules: Vec<&str> = file
        .names()
        .into_iter()
        .filter_map(|k| k.strip_suffix(".lora_down.weight"))
        .collect();
    assert_eq!(modules.len(), 26);
    for name in [
        "lora_unet_blocks_0_self_attn_q",
        "lora_unet_blocks_1_cross_attn_o",
        "lora_unet_blocks_1_ffn_0",
        "lora_unet_time_projection_1",
        "lora_unet_head_head",
    ] {
        assert!(modules.contains(&name), "{name}");
    }
    let set = burn_lora_train::lora_names(Arch::Wan, &ModelSource::Tiny)
        .unwrap()
        .load(&lora)
        .unwrap();
    assert_eq!(set.len(), 26);
}

/// The tiny Wan on 5-frame clips of the video fixtures (a video and a frame folder).
fn video_plan(output: &Path, steps: u64) -> TrainPlan {
    let mut plan = example_plan("wan.yaml", output, steps);
    let dataset = &mut plan.datasets[0];
    dataset.folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video");
    dataset.resolutions = vec![32];
    dataset.frames = vec![5];
    plan.train.gradient_checkpointing = burn_diffusion::Checkpointing::Blocks;
    plan
}

#[test]
fn the_tiny_wan_trains_on_clips_and_resumes_exactly() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = run(&video_plan(a.path(), 4), Resume::Auto).unwrap();
    assert!(straight.losses.iter().all(|l| l.is_finite() && *l > 0.0));

    let first = video_plan(b.path(), 2);
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
    assert_eq!(
        weights(&straight.lora.unwrap()),
        weights(&resumed.lora.unwrap())
    );
}
