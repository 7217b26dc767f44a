//! A process killed (SIGKILL) while it writes checkpoints never leaves one that resume takes for
//! valid but is not: whatever `resume` returns holds exactly what was saved at its step.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use burn::tensor::{DType, TensorData};
use burn_lora_train::checkpoint::{RunDir, StateTensor, TrainingState};
use burn_lora_train::dataset::DataPosition;

/// Set in the child process: the run folder to write checkpoints into until killed.
const WRITER_ENV: &str = "KILL_TEST_WRITER_DIR";

/// Values per optimizer tensor: 16 MB, so that a kill often lands inside a write.
const VALUES: usize = 4 << 20;

fn state(step: u64) -> TrainingState {
    TrainingState {
        step,
        data: DataPosition::default(),
        rng: [step; 4],
        config_fingerprint: String::new(),
        extra: serde_json::Value::Null,
        optimizer_steps: step,
        optimizer: vec![StateTensor::lazy(
            "layer.m".into(),
            DType::F32,
            vec![VALUES],
            move || TensorData::new(vec![step as f32; VALUES], [VALUES]),
        )],
    }
}

/// The child: resumes after the newest checkpoint, then saves checkpoints of the following
/// steps (LoRA file: 8 MB of the step's byte) until killed.
fn write_until_killed(dir: &Path) -> ! {
    let run = RunDir::create(dir, "demo").unwrap();
    let first = run.resume().unwrap().map_or(1, |(c, _)| c.step + 1);
    for step in first.. {
        run.save(&state(step), 2, |path: &Path| {
            std::fs::write(path, vec![step as u8; 8 << 20])
        })
        .unwrap();
    }
    unreachable!("the parent kills this process")
}

#[test]
fn a_killed_writer_leaves_only_valid_or_rejected_checkpoints() {
    if let Some(dir) = std::env::var_os(WRITER_ENV) {
        write_until_killed(Path::new(&dir));
    }
    let dir = tempfile::tempdir().unwrap();
    for round in 0..4u64 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "a_killed_writer_leaves_only_valid_or_rejected_checkpoints",
                "--nocapture",
            ])
            .env(WRITER_ENV, dir.path())
            .spawn()
            .unwrap();
        // Kill at a different point of the write cycle each round, once a checkpoint exists.
        let start = Instant::now();
        let complete = |name: &str| name.starts_with("state_") && name.ends_with(".safetensors");
        while std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .all(|e| !complete(&e.file_name().to_string_lossy()))
        {
            assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(37 * round + 11));
        child.kill().unwrap();
        child.wait().unwrap();

        let run = RunDir::create(dir.path(), "demo").unwrap();
        let (checkpoint, loaded) = run.resume().unwrap().expect("a valid checkpoint");
        let values: Vec<f32> = loaded.optimizer[0].values().to_vec().unwrap();
        assert_eq!(values.len(), VALUES);
        assert!(values.iter().all(|&v| v == loaded.step as f32));
        assert_eq!(loaded.rng, [loaded.step; 4]);
        let lora = std::fs::read(&checkpoint.lora).unwrap();
        assert_eq!(lora.len(), 8 << 20);
        assert!(lora.iter().all(|&b| b == loaded.step as u8));
        // No temporary file survives the reopening.
        assert!(
            std::fs::read_dir(dir.path()).unwrap().all(|e| !e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".tmp"))
        );
    }
}
