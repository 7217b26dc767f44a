//! A VRAM budget covers the whole run. The CPU reports no device memory, so these runs read it
//! from a probe that models a device holding 50 MB beside the engine's weights: the first step
//! streams every frozen weight and measures that need, the weights are then planned within the
//! rest of the budget (training exactly what a resident run trains), a later step that needs
//! more has them planned again, and a budget that cannot hold the need stops the run, naming
//! the key and the size, before anything of the step is saved.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn_lora_train::config::TrainPlan;
use burn_lora_train::report::StopFlag;
use burn_lora_train::train::{Resume, TrainError, TrainSummary, train_with_memory_probe};
use burn_offload::MemoryProbe;
use common::{plan, run, weights};

/// What the modelled device holds beside the engine's weights (activations and the like).
const BESIDE: u64 = 50_000_000;

/// The backend's random generator is global to the process: one run at a time.
static DEVICE: Mutex<()> = Mutex::new(());

fn probed(plan: &TrainPlan, resume: Resume) -> Result<TrainSummary, TrainError> {
    probed_by(plan, resume, Arc::new(|weights| Some(weights + BESIDE)))
}

fn probed_by(
    plan: &TrainPlan,
    resume: Resume,
    probe: Arc<dyn MemoryProbe>,
) -> Result<TrainSummary, TrainError> {
    common::on_large_stack(|| {
        train_with_memory_probe::<Flex>(plan, resume, &StopFlag::default(), &[FlexDevice], probe)
    })
}

fn with_budget(output: &Path, steps: u64, budget: Option<u64>) -> TrainPlan {
    let mut plan = plan(output, steps);
    plan.model.vram_budget_bytes = budget;
    plan
}

#[test]
fn the_first_step_is_measured_and_the_weights_are_planned_within_the_rest() {
    let _device = DEVICE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let dirs: Vec<_> = (0..5).map(|_| tempfile::tempdir().unwrap()).collect();
    let resident = run(&with_budget(dirs[0].path(), 3, None), Resume::Auto).unwrap();
    assert_eq!(resident.memory, None);
    let expected = weights(resident.lora.as_ref().unwrap());

    // Room for every weight beside the measured need: all resident, no ring.
    let roomy = probed(
        &with_budget(dirs[1].path(), 3, Some(BESIDE + 1_000_000_000)),
        Resume::Auto,
    )
    .unwrap();
    let all = roomy.memory.clone().expect("the first step was measured");
    assert_eq!(all.activation_headroom, BESIDE);
    assert_eq!(all.vram_budget, BESIDE + 1_000_000_000);
    assert_eq!((all.streamed_weights, all.ring_bytes), (0, 0));
    assert!(
        all.resident_weights > 0 && all.resident_bytes > 0,
        "{all:?}"
    );

    // A share of the budget stays free of weights beside the need.
    assert!(
        all.margin > 0 && all.margin < all.vram_budget / 10,
        "{all:?}"
    );
    let share = all.margin as f64 / all.vram_budget as f64;

    // Half of the weights' bytes beside the need and the margin: some stay, the others stream.
    let budget = ((BESIDE + all.resident_bytes / 2) as f64 / (1.0 - share)) as u64;
    let tight = probed(&with_budget(dirs[2].path(), 3, Some(budget)), Resume::Auto).unwrap();
    let half = tight.memory.clone().expect("the first step was measured");
    assert_eq!(half.activation_headroom, BESIDE);
    assert!(
        half.resident_weights > 0 && half.streamed_weights > 0,
        "{half:?}"
    );
    assert_eq!(
        half.resident_weights + half.streamed_weights,
        all.resident_weights
    );
    assert!(
        half.resident_bytes + half.ring_bytes + half.activation_headroom + half.margin <= budget,
        "{half:?}"
    );

    for (label, summary) in [("roomy", &roomy), ("tight", &tight)] {
        assert_eq!(summary.losses, resident.losses, "{label}");
        assert_eq!(weights(summary.lora.as_ref().unwrap()), expected, "{label}");
    }

    // Nothing is measured where the budget bounds nothing (0), nor without a reading.
    let zero = probed(&with_budget(dirs[3].path(), 3, Some(0)), Resume::Auto).unwrap();
    assert_eq!(zero.memory, None);
    assert_eq!(zero.losses, resident.losses);
    let unread = run(&with_budget(dirs[4].path(), 1, Some(budget)), Resume::Auto).unwrap();
    assert_eq!(unread.memory, None);
}

/// Every file of the run folder, by name, with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).unwrap())
        })
        .collect()
}

#[test]
fn a_budget_short_of_the_measured_need_stops_the_run_and_keeps_the_saved_work() {
    let _device = DEVICE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let straight = run(&with_budget(a.path(), 4, None), Resume::Auto).unwrap();

    // Two steps, a checkpoint after each.
    let mut first = with_budget(b.path(), 2, Some(40_000_000));
    first.save.every = 1;
    run(&first, Resume::Auto).unwrap();
    let saved = files(&first.run_dir());
    assert!(
        saved.keys().any(|name| name.starts_with("state_")),
        "{saved:?}"
    );

    // Resumed where the device needs more than the budget: its third step stops the run.
    let second = TrainPlan {
        train: burn_lora_train::config::TrainSettings {
            steps: 4,
            ..first.train.clone()
        },
        ..first.clone()
    };
    let err = probed(&second, Resume::Required).unwrap_err();
    let TrainError::Budget {
        file,
        step,
        budget,
        headroom,
        needed,
        ..
    } = &err
    else {
        panic!("expected a budget error, got {err}");
    };
    assert_eq!((*step, *budget, *headroom), (3, 40_000_000, BESIDE));
    assert!(*needed >= BESIDE, "{err}");
    let message = err.to_string();
    assert!(
        message.starts_with(&file.display().to_string()),
        "{message}"
    );
    assert!(
        message.contains("`model.offload.vram_budget_gb` is 0.04 GB")
            && message.contains("needs at least 0.05 GB"),
        "{message}"
    );
    // The tiny run keeps every activation and its optimizer on the device: both are named.
    assert!(
        message.contains("`train.gradient_checkpointing: true`")
            && message.contains("`train.optimizer_state: host`")
            && !message.contains("cpu_offload"),
        "{message}"
    );
    assert_eq!(
        files(&first.run_dir()),
        saved,
        "the stopped run changed nothing"
    );

    // With a budget that holds the need, the run resumes from step 2 as if nothing happened.
    let third = TrainPlan {
        model: burn_lora_train::config::ModelPlan {
            vram_budget_bytes: Some(2 * BESIDE),
            ..second.model.clone()
        },
        ..second
    };
    let resumed = probed(&third, Resume::Required).unwrap();
    assert_eq!(resumed.started_at, 2);
    assert!(resumed.memory.is_some());
    assert_eq!(resumed.losses, straight.losses[2..]);
    assert_eq!(
        weights(&resumed.lora.unwrap()),
        weights(&straight.lora.unwrap())
    );
}

#[test]
fn a_later_step_that_needs_more_raises_the_headroom_and_plans_again() {
    let _device = DEVICE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    const MORE: u64 = 20_000_000;
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let resident = run(&with_budget(dirs[0].path(), 3, None), Resume::Auto).unwrap();

    // How many readings two steps take, every weight resident after the first.
    let readings = Arc::new(AtomicU64::new(0));
    let counted = readings.clone();
    let counting = Arc::new(move |weights| {
        counted.fetch_add(1, Ordering::SeqCst);
        Some(weights + BESIDE)
    });
    let roomy = with_budget(dirs[1].path(), 2, Some(BESIDE + 1_000_000_000));
    let all = probed_by(&roomy, Resume::Auto, counting)
        .unwrap()
        .memory
        .unwrap();
    assert_eq!(all.streamed_weights, 0);
    let two_steps = readings.load(Ordering::SeqCst);

    // The same two steps (every weight still fits), then a third that needs 20 MB more: the
    // plan makes room for it, and only half of the weights' bytes stay resident.
    let count = AtomicU64::new(0);
    let growing = Arc::new(move |weights| {
        let extra = if count.fetch_add(1, Ordering::SeqCst) < two_steps {
            0
        } else {
            MORE
        };
        Some(weights + BESIDE + extra)
    });
    let budget = BESIDE + MORE + all.resident_bytes / 2;
    let grown = probed_by(
        &with_budget(dirs[2].path(), 3, Some(budget)),
        Resume::Auto,
        growing,
    )
    .unwrap();
    let planned = grown.memory.unwrap();
    assert_eq!(planned.activation_headroom, BESIDE + MORE);
    assert!(planned.streamed_weights > 0, "{planned:?}");
    assert!(
        planned.resident_bytes + planned.ring_bytes + planned.activation_headroom <= budget,
        "{planned:?}"
    );
    assert_eq!(grown.losses, resident.losses);
}
