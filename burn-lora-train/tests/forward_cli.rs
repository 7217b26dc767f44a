//! `burnlora forward` as a user runs it, on burn-diffusion's parity fixtures: it recognises a
//! FLUX.1, FLUX.2, SDXL or Wan checkpoint from its files and writes diffusers' output.

use std::path::{Path, PathBuf};
use std::process::Command;

use burn_quant::{Checkpoint, FloatBytes, FloatDtype};

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../burn-diffusion/tests/fixtures")
        .join(path)
}

fn read(file: &Path, key: &str) -> Vec<f32> {
    let files = Checkpoint::open(file).unwrap();
    let entry = files.get(key).unwrap();
    let dtype = FloatDtype::from_safetensors(entry.dtype).unwrap();
    FloatBytes::new(dtype, entry.data).unwrap().to_f32_vec()
}

#[test]
fn forward_runs_either_family_from_its_files() {
    let dir = tempfile::tempdir().unwrap();
    for case in [
        "flux/guidance",
        "flux2/dev",
        "flux2/klein/flux2-bfl.safetensors",
    ] {
        let model = fixture(case);
        let folder = if model.is_dir() {
            model.clone()
        } else {
            model.parent().unwrap().to_path_buf()
        };
        let output = dir.path().join("out.safetensors");
        let out = Command::new(env!("CARGO_BIN_EXE_burnlora"))
            .arg("forward")
            .arg("--model")
            .arg(&model)
            .arg("--inputs")
            .arg(folder.join("inputs_0.safetensors"))
            .arg("--output")
            .arg(&output)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (found, expected) = (
            read(&output, "output"),
            read(&folder.join("output_0.safetensors"), "output"),
        );
        assert_eq!(found.len(), expected.len(), "{case}");
        let diff: f64 = found
            .iter()
            .zip(&expected)
            .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
            .sum();
        let norm: f64 = expected.iter().map(|b| (*b as f64).powi(2)).sum();
        let error = (diff / norm).sqrt();
        assert!(error <= 1e-5, "{case}: relative error {error:.2e}");
    }
}

/// Runs `burnlora forward` on `model` with the inputs of a parity fixture's io file (every
/// tensor but `output`, `inputs` of them) and checks the result against its `output`.
fn assert_forward_matches_io(model: &Path, io: &Path, inputs: usize) {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(io).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tensors: Vec<(String, safetensors::tensor::TensorView)> = file
        .iter()
        .filter(|(name, _)| *name != "output")
        .map(|(name, view)| (name.to_string(), view))
        .collect();
    assert_eq!(tensors.len(), inputs);
    let input_file = dir.path().join("inputs.safetensors");
    safetensors::serialize_to_file(tensors, None, &input_file).unwrap();
    let output = dir.path().join("out.safetensors");
    let out = Command::new(env!("CARGO_BIN_EXE_burnlora"))
        .arg("forward")
        .arg("--model")
        .arg(model)
        .arg("--inputs")
        .arg(&input_file)
        .arg("--output")
        .arg(&output)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        model.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let (found, expected) = (read(&output, "output"), read(io, "output"));
    assert_eq!(found.len(), expected.len());
    let diff: f64 = found
        .iter()
        .zip(&expected)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let norm: f64 = expected.iter().map(|b| (*b as f64).powi(2)).sum();
    let error = (diff / norm).sqrt();
    assert!(
        error <= 1e-5,
        "{}: relative error {error:.2e}",
        model.display()
    );
}

/// The SDXL UNet of burn-diffusion's parity fixture, from its diffusers folder, on the inputs of
/// its io file under diffusers' argument names (`added_cond_kwargs` flattened).
#[test]
fn forward_runs_the_sdxl_unet_under_diffusers_argument_names() {
    assert_forward_matches_io(&fixture("sdxl"), &fixture("sdxl/io.safetensors"), 5);
}

/// The Wan transformer of burn-diffusion's parity fixture, from its diffusers folder, on the
/// inputs of its io file under diffusers' argument names.
#[test]
fn forward_runs_the_wan_transformer_under_diffusers_argument_names() {
    assert_forward_matches_io(&fixture("wan"), &fixture("wan/io.safetensors"), 3);
}
