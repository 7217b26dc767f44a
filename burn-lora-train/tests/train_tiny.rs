//! `burnlora train` on the tiny example (a small random FLUX.1 with tiny encoders, six 64×64
//! images): a run writes a LoRA file that loads, and continues from its checkpoint.

mod common;

use burn_lora::Role;
use burn_lora_train::train::{Resume, TrainError};
use common::{plan, run, weights};

#[test]
fn a_tiny_run_writes_a_lora_that_loads() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan(dir.path(), 3);
    let summary = run(&plan, Resume::Auto).unwrap();
    assert_eq!((summary.started_at, summary.step), (0, 3));
    assert_eq!(summary.losses.len(), 3);
    assert!(summary.losses.iter().all(|l| l.is_finite() && *l > 0.0));

    let lora = summary.lora.expect("the last step is saved");
    assert!(lora.starts_with(plan.run_dir()));
    let set = burn_lora::load(&lora).unwrap();
    // 2 double blocks × 10 projections + 2 single blocks × 3 (config: `include` blocks only).
    assert_eq!(set.len(), 26);
    assert!(set.iter().all(|(name, _)| name.contains("blocks")));
    let trained = weights(&lora)
        .iter()
        .filter(|(_, role, _)| *role == Role::Up)
        .any(|(_, _, bits)| bits.iter().any(|b| f32::from_bits(*b) != 0.0));
    assert!(trained, "the up matrices start at zero and must have moved");
    assert!(plan.run_dir().join("loss.csv").is_file());
    assert!(plan.run_dir().join("loss.png").is_file());

    // Running again resumes at step 3, which is the end: nothing more to do.
    let again = run(&plan, Resume::Required).unwrap();
    assert_eq!((again.started_at, again.step), (3, 3));
    assert!(again.losses.is_empty());
}

#[test]
fn resume_without_a_checkpoint_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let error = run(&plan(dir.path(), 2), Resume::Required).unwrap_err();
    assert!(
        matches!(error, TrainError::NothingToResume { .. }),
        "{error}"
    );
}

#[test]
fn a_diverged_run_stops_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut plan = plan(dir.path(), 20);
    plan.train.lr = 1e30;
    plan.train.max_nan_steps = 2;
    let error = run(&plan, Resume::Auto).unwrap_err();
    assert!(matches!(error, TrainError::NonFinite(2)), "{error}");
    let saved: Vec<_> = std::fs::read_dir(plan.run_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.starts_with("state_"))
        .collect();
    assert_eq!(saved.len(), 1, "{saved:?}");
}

/// `network.pretrained_lora_path`: a PEFT file (split `qkv` and `linear1` included) becomes the
/// model's adapters, with their rank and alpha; at learning rate 0 the run saves them unchanged.
#[test]
fn a_run_starts_from_a_pretrained_lora_of_another_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut plan = plan(dir.path(), 1);
    let pretrained = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tools/lora_peft.safetensors");
    plan.network.pretrained = Some(pretrained.clone());
    plan.train.lr = 0.0;
    plan.save.dtype = burn::tensor::DType::F32;
    let lora = run(&plan, Resume::Auto).unwrap().lora.unwrap();

    let names = burn_lora_train::lora_names(plan.model.arch, &plan.model.source).unwrap();
    let saved = names.load(&lora).unwrap();
    let start = names.load(&pretrained).unwrap();
    assert_eq!(saved.len(), start.len(), "the file adapts every layer");
    for (name, adapter) in start.iter() {
        assert_eq!(saved.get(name), Some(adapter), "{name}");
    }
    assert!(
        start
            .iter()
            .all(|(_, a)| a.alpha() == 8.0 && a.rank() == Some(4))
    );
}
