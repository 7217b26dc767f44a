//! `burnlora train` on a FLUX.1 diffusers folder: a tiny pipeline written by diffusers itself
//! (`tests/fixtures/make_pipeline.py`; its tokenizers are the tiny example's). Every component loads from the folder under its
//! diffusers names, and streaming the transformer's frozen weights from host memory through
//! burn-offload trains exactly what the resident run trains.

mod common;

use std::path::Path;

use burn_lora_train::config::{ModelSource, TrainPlan};
use burn_lora_train::train::Resume;

/// The tiny example's run, on the fixture pipeline instead of the built-in tiny model.
fn pipeline_plan(output: &Path, streamed: bool) -> TrainPlan {
    let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_pipeline");
    let mut plan = common::plan(output, 3);
    plan.model.tokenizers = plan.file.parent().unwrap().to_path_buf();
    plan.model.source = ModelSource::Path(folder);
    if streamed {
        plan.model.vram_budget_bytes = Some(0);
    }
    plan
}

#[test]
fn a_diffusers_folder_trains_the_same_streamed_or_resident() {
    let resident_dir = tempfile::tempdir().unwrap();
    let streamed_dir = tempfile::tempdir().unwrap();
    let resident = common::run(&pipeline_plan(resident_dir.path(), false), Resume::Auto).unwrap();
    let streamed = common::run(&pipeline_plan(streamed_dir.path(), true), Resume::Auto).unwrap();

    assert_eq!(resident.step, 3);
    assert!(
        resident.losses.iter().all(|l| l.is_finite()),
        "{:?}",
        resident.losses
    );
    assert_eq!(resident.losses, streamed.losses);
    let (a, b) = (
        common::weights(&resident.lora.unwrap()),
        common::weights(&streamed.lora.unwrap()),
    );
    // LoRA on the double and single blocks of a one-double, one-single-block model.
    assert!(a.len() >= 2 * 8, "{} adapter tensors", a.len());
    let names: Vec<&str> = a.iter().map(|(name, _, _)| name.as_str()).collect();
    assert!(
        names.iter().any(|n| n.contains("single_blocks")),
        "{names:?}"
    );
    assert_eq!(a, b);
}
