//! `train.optimizer_state: host` on the tiny example: the same losses and adapters, bit for
//! bit, as the state on the device, and a run resumes with the state moved from one to the
//! other. (Its own test binary: the device's random generator is global to the process.)

mod common;

use burn_lora_train::config::{OptimizerState, TrainPlan, TrainSettings};
use burn_lora_train::train::Resume;
use common::{plan, run, weights};

fn placed(output: &std::path::Path, steps: u64, state: OptimizerState) -> TrainPlan {
    let mut plan = plan(output, steps);
    plan.train.optimizer_state = state;
    plan.train.max_grad_norm = Some(0.5);
    plan
}

#[test]
fn a_state_in_host_memory_trains_and_resumes_as_on_the_device() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let device = run(
        &placed(dirs[0].path(), 6, OptimizerState::Device),
        Resume::Auto,
    )
    .unwrap();
    let host = run(
        &placed(dirs[1].path(), 6, OptimizerState::Host),
        Resume::Auto,
    )
    .unwrap();
    assert_eq!(host.losses, device.losses);
    let (device, host) = (device.lora.unwrap(), host.lora.unwrap());
    assert_eq!(weights(&host), weights(&device));

    // Three steps with the state on the host, three more with it on the device.
    let first = placed(dirs[2].path(), 3, OptimizerState::Host);
    run(&first, Resume::Auto).unwrap();
    let second = TrainPlan {
        train: TrainSettings {
            steps: 6,
            optimizer_state: OptimizerState::Device,
            ..first.train.clone()
        },
        ..first
    };
    let resumed = run(&second, Resume::Required).unwrap();
    assert_eq!(resumed.started_at, 3);
    assert_eq!(weights(&resumed.lora.unwrap()), weights(&device));
}
