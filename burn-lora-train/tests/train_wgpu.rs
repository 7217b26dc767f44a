//! The tiny FLUX.1 run on Burn's wgpu backend (in CI through Mesa's lavapipe, a Vulkan driver
//! on the CPU): `Autodiff<Offload<Wgpu>>` trains the same model on the same noise as the CPU
//! (the tiny models and the noise are drawn on the CPU), so its losses are the CPU run's
//! recorded ones (`fixtures/golden/tiny_flux1.json`) up to the rounding of another f32
//! implementation: within 1e-3, relative.
#![cfg(feature = "wgpu")]

mod common;

use std::path::Path;

use burn::backend::Wgpu;
use burn_lora_train::report::StopFlag;
use burn_lora_train::train::{Resume, train};
use common::plan;

#[test]
fn the_tiny_run_on_wgpu_has_the_cpu_losses() {
    let dir = tempfile::tempdir().unwrap();
    let plan = plan(dir.path(), 3);
    let summary = train::<Wgpu>(
        &plan,
        Resume::Auto,
        &StopFlag::default(),
        &Default::default(),
    )
    .unwrap();
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/tiny_flux1.json");
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let cpu: Vec<f64> = record["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|bits| f64::from_bits(u64::from_str_radix(bits.as_str().unwrap(), 16).unwrap()))
        .collect();
    assert_eq!(summary.losses.len(), cpu.len());
    for (step, (wgpu, cpu)) in summary.losses.iter().zip(&cpu).enumerate() {
        assert!(
            (wgpu - cpu).abs() <= 1e-3 * cpu.abs(),
            "step {}: wgpu loss {wgpu}, CPU loss {cpu}",
            step + 1
        );
    }
    assert!(summary.lora.is_some_and(|lora| lora.is_file()));
}
