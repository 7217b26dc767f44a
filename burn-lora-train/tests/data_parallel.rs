//! Data-parallel training on the CPU: two replicas on two CPU devices (Flex has one device
//! kind with one device, which both replicas use), each in its own thread, their gradients
//! averaged through burn-collective, must train what one device trains with the same global
//! batch (two accumulated micro-batches per step), and resume exactly.

mod common;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn_lora_train::config::TrainPlan;
use burn_lora_train::report::StopFlag;
use burn_lora_train::train::{Resume, TrainError, TrainSummary, devices, train};
use common::{example_plan, run, weights};

/// The tiny FLUX.1 example for `steps` steps of two micro-batches each: accumulated on one
/// device, or one on each of two.
fn plan(output: &std::path::Path, steps: u64, devices: usize) -> TrainPlan {
    let mut plan = example_plan("config.yaml", output, steps);
    plan.train.batch_size = 1;
    plan.train.devices = devices;
    plan.train.gradient_accumulation_steps = 2 / devices;
    plan
}

/// The largest difference between two LoRA files' tensors, relative to the largest value.
fn largest_difference(a: &std::path::Path, b: &std::path::Path) -> f32 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    let mut largest = (0.0f32, 0.0f32);
    for ((name, role, x), (name_b, role_b, y)) in a.iter().zip(&b) {
        assert_eq!((name, role), (name_b, role_b));
        for (&x, &y) in x.iter().zip(y) {
            let (x, y) = (f32::from_bits(x), f32::from_bits(y));
            largest = (largest.0.max((x - y).abs()), largest.1.max(x.abs()));
        }
    }
    largest.0 / largest.1
}

/// Equal losses, and adapters within f32 rounding of each other.
fn assert_trained_alike(one: &TrainSummary, two: &TrainSummary) {
    assert_eq!(one.losses.len(), two.losses.len());
    for (a, b) in one.losses.iter().zip(&two.losses) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "losses {a} and {b}");
    }
    let lora = |s: &TrainSummary| s.lora.clone().unwrap();
    let difference = largest_difference(&lora(one), &lora(two));
    assert!(
        difference <= 1e-5,
        "adapters differ by {difference} (relative)"
    );
}

#[test]
fn two_replicas_train_what_one_device_trains_with_the_same_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let one = run(&plan(&dir.path().join("one"), 3, 1), Resume::Auto).unwrap();
    let two = run(&plan(&dir.path().join("two"), 3, 2), Resume::Auto).unwrap();
    assert_eq!(one.losses.len(), 3);
    assert_trained_alike(&one, &two);
    // The adapters moved: a test of equal files that never trained would prove nothing.
    assert!(one.losses[0] != one.losses[2]);
}

#[test]
fn two_replicas_streaming_one_host_copy_train_what_one_device_trains() {
    let dir = tempfile::tempdir().unwrap();
    let streamed = |name: &str, devices: usize| {
        let mut plan = plan(&dir.path().join(name), 2, devices);
        plan.model.vram_budget_bytes = Some(0);
        run(&plan, Resume::Auto).unwrap()
    };
    let (one, two) = (streamed("one", 1), streamed("two", 2));
    assert_trained_alike(&one, &two);
}

#[test]
fn two_replicas_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let straight = run(&plan(&dir.path().join("straight"), 4, 2), Resume::Auto).unwrap();
    let resumed_dir = dir.path().join("resumed");
    run(&plan(&resumed_dir, 2, 2), Resume::Auto).unwrap();
    let resumed = run(&plan(&resumed_dir, 4, 2), Resume::Required).unwrap();
    assert_eq!(resumed.started_at, 2);
    assert_eq!(resumed.losses, straight.losses[2..]);
    assert_eq!(
        weights(&resumed.lora.unwrap()),
        weights(&straight.lora.unwrap())
    );
}

#[test]
fn more_devices_than_there_are_is_an_error_naming_the_setting() {
    let error = devices::<Flex>(2).unwrap_err();
    assert!(matches!(
        error,
        TrainError::Devices {
            configured: 2,
            found: 1
        }
    ));
    assert!(
        error.to_string().contains("`train.devices` is 2"),
        "{error}"
    );
    let dir = tempfile::tempdir().unwrap();
    let three = plan(dir.path(), 1, 2);
    let three = TrainPlan {
        train: burn_lora_train::config::TrainSettings {
            devices: 3,
            ..three.train.clone()
        },
        ..three
    };
    let two_cpus = [FlexDevice, FlexDevice];
    let error = train::<Flex>(&three, Resume::Auto, &StopFlag::default(), &two_cpus).unwrap_err();
    assert!(matches!(
        error,
        TrainError::Devices {
            configured: 3,
            found: 2
        }
    ));
}
