//! `burnlora train` on FLUX.1 files: a tiny pipeline written by diffusers itself
//! (`tests/fixtures/make_pipeline.py`; its tokenizers are the tiny example's). Every component
//! loads from the pipeline folder under its diffusers names, or from its own folder or single
//! file; streaming the frozen weights from host memory through burn-offload trains exactly what
//! the resident run trains.

mod common;

use std::path::{Path, PathBuf};

use burn_lora_train::config::{ModelFiles, ModelSource, TrainPlan};
use burn_lora_train::train::{Resume, TrainSummary};

fn pipeline() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_pipeline")
}

/// The tiny example's run, 3 steps, on the fixture's `files`.
fn run(files: ModelFiles, streamed: bool) -> TrainSummary {
    let output = tempfile::tempdir().unwrap();
    let mut plan: TrainPlan = common::plan(output.path(), 3);
    plan.model.tokenizers = plan.file.parent().unwrap().to_path_buf();
    plan.model.source = ModelSource::Files(files);
    if streamed {
        plan.model.vram_budget_bytes = Some(0);
    }
    let mut summary = common::run(&plan, Resume::Auto).unwrap();
    let lora = summary.lora.take().unwrap();
    let kept = output.keep().join("lora.safetensors");
    std::fs::copy(&lora, &kept).unwrap();
    summary.lora = Some(kept);
    summary
}

#[test]
fn the_pipeline_trains_the_same_from_its_folder_its_parts_and_streamed() {
    let folder = pipeline();
    let resident = run(ModelFiles::pipeline(&folder), false);
    let streamed = run(ModelFiles::pipeline(&folder), true);
    let parts = run(
        ModelFiles {
            transformer: folder.join("transformer"),
            vae: folder.join("vae"),
            text_encoder: folder.join("text_encoder"),
            text_encoder_2: folder.join("text_encoder_2"),
        },
        false,
    );

    assert_eq!(resident.step, 3);
    assert!(
        resident.losses.iter().all(|l| l.is_finite()),
        "{:?}",
        resident.losses
    );
    let weights = |s: &TrainSummary| common::weights(s.lora.as_ref().unwrap());
    let expected = weights(&resident);
    // LoRA on the double and single blocks of a one-double, one-single-block model.
    assert!(
        expected.len() >= 2 * 8,
        "{} adapter tensors",
        expected.len()
    );
    let names: Vec<&str> = expected.iter().map(|(name, _, _)| name.as_str()).collect();
    assert!(
        names.iter().any(|n| n.contains("single_blocks")),
        "{names:?}"
    );
    for (label, other) in [("streamed", &streamed), ("parts", &parts)] {
        assert_eq!(other.losses, resident.losses, "{label}");
        assert_eq!(weights(other), expected, "{label}");
    }
}
