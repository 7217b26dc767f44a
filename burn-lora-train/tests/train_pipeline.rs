//! `burnlora train` on FLUX.1 files: a tiny pipeline written by diffusers itself
//! (`tests/fixtures/make_pipeline.py`; its tokenizers are the tiny example's). Every component
//! loads from the pipeline folder under its diffusers names, or from its own folder or single
//! file; streaming the frozen weights from host memory through burn-offload trains exactly what
//! the resident run trains.

mod common;

use std::path::{Path, PathBuf};

use burn_lora_train::config::{Arch, ModelFiles, ModelSource, TrainPlan};
use burn_lora_train::train::{Resume, TrainSummary};

fn pipeline() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny_pipeline")
}

/// The tiny example's run, 3 steps, on the fixture's `files`.
fn run(files: ModelFiles, streamed: bool) -> TrainSummary {
    let output = tempfile::tempdir().unwrap();
    let mut plan: TrainPlan = common::plan(output.path(), 3);
    plan.model.tokenizers = plan.file.parent().unwrap().to_path_buf();
    plan.model.source = ModelSource::Files(files);
    if streamed {
        plan.model.vram_budget_bytes = Some(0);
    }
    let mut summary = common::run(&plan, Resume::Auto).unwrap();
    let lora = summary.lora.take().unwrap();
    let kept = output.keep().join("lora.safetensors");
    std::fs::copy(&lora, &kept).unwrap();
    summary.lora = Some(kept);
    summary
}

#[test]
fn the_pipeline_trains_the_same_from_its_folder_its_parts_and_streamed() {
    let folder = pipeline();
    let components = Arch::Flux1.components();
    let resident = run(ModelFiles::pipeline(&folder, components), false);
    let streamed = run(ModelFiles::pipeline(&folder, components), true);
    let parts = components
        .iter()
        .fold(ModelFiles::pipeline(&folder, components), |files, c| {
            files.with(c, folder.join(c))
        });
    let parts = run(parts, false);

    assert_eq!(resident.step, 3);
    assert!(
        resident.losses.iter().all(|l| l.is_finite()),
        "{:?}",
        resident.losses
    );
    let weights = |s: &TrainSummary| common::weights(s.lora.as_ref().unwrap());
    let expected = weights(&resident);
    // LoRA on the double and single blocks of a one-double, one-single-block model.
    assert!(
        expected.len() >= 2 * 8,
        "{} adapter tensors",
        expected.len()
    );
    let names: Vec<&str> = expected.iter().map(|(name, _, _)| name.as_str()).collect();
    assert!(
        names.iter().any(|n| n.contains("single_blocks")),
        "{names:?}"
    );
    for (label, other) in [("streamed", &streamed), ("parts", &parts)] {
        assert_eq!(other.losses, resident.losses, "{label}");
        assert_eq!(weights(other), expected, "{label}");
    }
}

#[test]
fn a_vae_that_yields_nan_stops_the_run_naming_it_and_the_image() {
    // The pipeline's VAE with one encoder bias set to NaN.
    let folder = pipeline();
    let vae = tempfile::tempdir().unwrap();
    std::fs::copy(
        folder.join("vae/config.json"),
        vae.path().join("config.json"),
    )
    .unwrap();
    let weights = "diffusion_pytorch_model.safetensors";
    let bytes = std::fs::read(folder.join("vae").join(weights)).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<u8>, Vec<usize>, safetensors::Dtype)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let mut data = view.data().to_vec();
            if name == "encoder.conv_in.bias" {
                assert_eq!(view.dtype(), safetensors::Dtype::F32);
                data = f32::NAN.to_le_bytes().repeat(data.len() / 4);
            }
            (name, data, view.shape().to_vec(), view.dtype())
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, data, shape, dtype)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
            (name.as_str(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &vae.path().join(weights)).unwrap();

    let output = tempfile::tempdir().unwrap();
    let mut plan: TrainPlan = common::plan(output.path(), 3);
    plan.model.tokenizers = plan.file.parent().unwrap().to_path_buf();
    plan.model.source = ModelSource::Files(
        ModelFiles::pipeline(&folder, Arch::Flux1.components())
            .with("vae", vae.path().to_path_buf()),
    );
    let error = common::run(&plan, Resume::Auto).unwrap_err().to_string();
    assert!(
        error.starts_with("the VAE produced non-finite values for "),
        "{error}"
    );
    assert!(error.contains("examples/tiny/images/"), "{error}");
}
