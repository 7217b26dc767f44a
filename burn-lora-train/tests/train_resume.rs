//! Exact resume of `burnlora train` on the tiny example: 5 steps, then 5 more from the
//! checkpoint, end with the same adapters, bit for bit, as 10 steps straight, the straight run
//! keeping the recomputed blocks' inputs on the device and the other in host memory. (Its own test
//! binary: the device's random generator is global to the process, so no other run may draw
//! from it meanwhile.)

mod common;

use burn_diffusion::Checkpointing;
use burn_lora_train::config::{TrainPlan, TrainSettings};
use burn_lora_train::train::Resume;
use common::{plan, run, weights};

#[test]
fn five_steps_resumed_for_five_more_equal_ten_straight() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut straight = plan(a.path(), 10);
    straight.train.gradient_checkpointing = Checkpointing::Blocks;
    let straight = run(&straight, Resume::Auto).unwrap();

    let mut first = plan(b.path(), 5);
    first.train.gradient_checkpointing = Checkpointing::BlocksOnHost;
    run(&first, Resume::Auto).unwrap();
    let second = TrainPlan {
        train: TrainSettings {
            steps: 10,
            ..first.train.clone()
        },
        ..first
    };
    let resumed = run(&second, Resume::Required).unwrap();

    assert_eq!(resumed.started_at, 5);
    assert_eq!(resumed.losses, straight.losses[5..]);
    let (straight, resumed) = (straight.lora.unwrap(), resumed.lora.unwrap());
    assert_eq!(weights(&straight), weights(&resumed));
}
