//! `burnlora train examples/tiny/config.yaml` built for Burn's wgpu backend (in CI through
//! Mesa's lavapipe, a Vulkan driver on the CPU): `Autodiff<Offload<Wgpu>>` trains the same model
//! on the same noise as the CPU (the tiny models and the noise are drawn on the CPU), so the
//! losses in its `loss.csv` are the CPU run's recorded ones (`fixtures/golden/tiny_flux1.json`)
//! up to the rounding of another f32 implementation: within 1e-3, relative.
#![cfg(feature = "wgpu")]

use std::path::Path;
use std::process::Command;

#[test]
fn burnlora_trains_the_tiny_example_on_wgpu_with_the_cpu_losses() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_burnlora"))
        .args(["train", "examples/tiny/config.yaml"])
        .current_dir(root.join(".."))
        .env("BURNLORA_TRAIN__STEPS", "3")
        .env("BURNLORA_LOGGING__LOG_EVERY", "1")
        .env("BURNLORA_OUTPUT_DIR", out.path())
        .status()
        .unwrap();
    assert!(status.success(), "burnlora train failed: {status}");
    let run = out.path().join("tiny_lora");
    assert!(run.join("tiny_lora_000000003.safetensors").is_file());

    let csv = std::fs::read_to_string(run.join("loss.csv")).unwrap();
    let losses: Vec<f64> = csv
        .lines()
        .filter_map(|line| line.split(',').nth(1)?.parse().ok())
        .collect();
    let record: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/golden/tiny_flux1.json")).unwrap(),
    )
    .unwrap();
    let cpu: Vec<f64> = record["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|bits| f64::from_bits(u64::from_str_radix(bits.as_str().unwrap(), 16).unwrap()))
        .collect();
    assert_eq!(losses.len(), cpu.len(), "{csv}");
    for (step, (wgpu, cpu)) in losses.iter().zip(&cpu).enumerate() {
        assert!(
            (wgpu - cpu).abs() <= 1e-3 * cpu.abs(),
            "step {}: wgpu loss {wgpu}, CPU loss {cpu}",
            step + 1
        );
    }
}
