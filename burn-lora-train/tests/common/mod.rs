//! The tiny example's configuration, a training run on the CPU, and LoRA files as bits.
// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Mutex;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn_lora::{AdapterSet, Role};
use burn_lora_train::config::TrainPlan;
use burn_lora_train::report::StopFlag;
use burn_lora_train::train::{Resume, TrainError, TrainSummary, train};

/// The example configuration with `steps` steps, writing its run folder under `output`.
pub fn plan(output: &Path, steps: u64) -> TrainPlan {
    example_plan("config.yaml", output, steps)
}

/// The configuration `examples/tiny/<file>` with `steps` steps, writing under `output`.
pub fn example_plan(file: &str, output: &Path, steps: u64) -> TrainPlan {
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/tiny")
        .join(file);
    let mut plan = TrainPlan::load(&file).unwrap();
    plan.output_dir = output.to_path_buf();
    plan.train.steps = steps;
    plan
}

/// Taken by every run: Burn's random generator is one per process, and each run seeds it, so
/// two runs at once in one test binary would draw from each other's sequences.
pub static TURN: Mutex<()> = Mutex::new(());

/// `plan` trained on the CPU, on one CPU device per replica (`train.devices`), one run at a
/// time within the test binary.
pub fn run(plan: &TrainPlan, resume: Resume) -> Result<TrainSummary, TrainError> {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let cpus = vec![FlexDevice; plan.train.devices];
    on_large_stack(|| train::<Flex>(plan, resume, &StopFlag::default(), &cpus))
}

/// `f` on a thread with a 16 MiB stack, as a program's main thread has room for: in debug
/// builds the model code's frames outgrow the 2 MiB of a test's thread.
pub fn on_large_stack<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .stack_size(16 << 20)
            .spawn_scoped(scope, f)
            .expect("spawning a test's thread")
            .join()
            .unwrap_or_else(|payload| std::panic::resume_unwind(payload))
    })
}

/// Every adapter tensor of a LoRA file as f32 bits, by name and role.
pub fn weights(path: &Path) -> Vec<(String, Role, Vec<u32>)> {
    let set: AdapterSet = burn_lora::load(path).unwrap();
    set.iter()
        .flat_map(|(name, adapter)| {
            adapter.tensors().into_iter().map(move |(role, data)| {
                let bits = data
                    .clone()
                    .convert::<f32>()
                    .to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                (name.to_string(), role, bits)
            })
        })
        .collect()
}
