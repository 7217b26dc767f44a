//! `train.gradients: host` on the tiny example: each adapter gradient is copied to host memory
//! as the backward produces it and summed there, and the run gives the same losses and
//! adapters, bit for bit, as the gradients summed by the autodiff graph: with `adamw` and
//! `adamw8bit`, two micro-batches per step, clipping, and block checkpointing (whose
//! recomputed blocks send the gradients). A run resumed from a checkpoint that the host path
//! wrote equals the uninterrupted one. (Its own test binary: the device's random generator is
//! global to the process.)

mod common;

use std::path::Path;

use burn_lora_train::config::TrainPlan;
use burn_lora_train::train::Resume;
use common::{run, weights};

fn placed(output: &Path, steps: u64, optimizer: &str, gradients: &str) -> TrainPlan {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/config.yaml");
    let set = |key: &str, value: &str| (format!("BURNLORA_{key}"), value.to_string());
    let mut plan = TrainPlan::load_with_env(
        &file,
        [
            // Rank 16: the MLP adapters (16 × 256 values) get 8-bit moments under `adamw8bit`.
            set("NETWORK__LINEAR", "16"),
            set("TRAIN__OPTIMIZER", optimizer),
            set("TRAIN__OPTIMIZER_STATE", "host"),
            set("TRAIN__GRADIENTS", gradients),
            set("TRAIN__MAX_GRAD_NORM", "0.05"),
            set("TRAIN__GRADIENT_ACCUMULATION_STEPS", "2"),
            set("TRAIN__GRADIENT_CHECKPOINTING", "true"),
        ],
    )
    .unwrap();
    plan.output_dir = output.to_path_buf();
    plan.train.steps = steps;
    plan
}

#[test]
fn gradients_summed_in_host_memory_train_and_resume_as_in_the_graph() {
    for optimizer in ["adamw", "adamw8bit"] {
        let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
        let graph = run(
            &placed(dirs[0].path(), 4, optimizer, "device"),
            Resume::Auto,
        )
        .unwrap();
        let host = run(&placed(dirs[1].path(), 4, optimizer, "host"), Resume::Auto).unwrap();
        assert_eq!(host.losses, graph.losses, "{optimizer}");
        let graph = graph.lora.unwrap();
        assert_eq!(weights(&host.lora.unwrap()), weights(&graph), "{optimizer}");

        // Two steps with the gradients in host memory, then a resumed run to the fourth.
        let first = placed(dirs[2].path(), 2, optimizer, "host");
        run(&first, Resume::Auto).unwrap();
        let mut second = first.clone();
        second.train.steps = 4;
        let resumed = run(&second, Resume::Required).unwrap();
        assert_eq!(resumed.started_at, 2);
        assert_eq!(
            weights(&resumed.lora.unwrap()),
            weights(&graph),
            "{optimizer}"
        );
    }
}
