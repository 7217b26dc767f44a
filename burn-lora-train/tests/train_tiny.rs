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
