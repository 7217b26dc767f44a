//! FLUX.2's VAE and the latent side of its pipeline against diffusers 0.42.1
//! (`AutoencoderKLFlux2`, `Flux2Pipeline`): fixtures made by
//! `tests/fixtures/make_flux2_vae_fixtures.py` from a tiny random model, saved as a diffusers
//! folder and in BFL's single-file layout.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_diffusion::LoadError;
use burn_diffusion::pipeline::{
    flux2_image_ids, flux2_text_ids, pack_flux2_latents, unpack_flux2_latents,
};
use burn_diffusion::vae::{
    AutoencoderKl, LatentBatchNormConfig, VaeCheckpoint, VaeConfig, VaeLayout,
};
use burn_quant::Checkpoint;

type B = Flex;

mod common;

fn fixture(path: &str) -> PathBuf {
    common::fixture("vae_flux2").join(path)
}

fn io() -> PathBuf {
    fixture("io.safetensors")
}

fn tensor<const D: usize>(key: &str) -> Tensor<B, D> {
    let (values, shape) = common::read(&io(), key);
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// An i64 tensor of the io file.
fn read_ids(key: &str) -> TensorData {
    common::read_i64(&io(), key)
}

/// `actual` against the reference `key` within the f32 tolerance.
fn assert_matches(actual: TensorData, key: &str) {
    common::assert_within(actual, &io(), key, common::F32_TOLERANCE);
}

/// The fixture model's configuration: FLUX.2's, with three levels of width 32 and one residual
/// block per level.
fn tiny_flux2() -> VaeConfig {
    VaeConfig {
        block_out_channels: vec![32, 32, 32],
        layers_per_block: 1,
        ..VaeConfig::flux2()
    }
}

fn load(path: &Path, layout: VaeLayout) -> AutoencoderKl<B> {
    let checkpoint = VaeCheckpoint::open(path).unwrap();
    assert_eq!(checkpoint.layout(), layout);
    assert_eq!(checkpoint.config(), &tiny_flux2(), "config");
    checkpoint
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap()
}

/// Encoding, normalization and decoding of `vae` against the pipeline.
fn check_vae(vae: &AutoencoderKl<B>) {
    let image = tensor::<4>("image");
    assert_matches(vae.encode(image.clone()).mode().into_data(), "mode");
    assert_matches(vae.encode_latents(image).into_data(), "normalized");
    assert_matches(
        vae.normalize_latents(tensor("mode")).into_data(),
        "normalized",
    );
    let given = tensor::<4>("given");
    assert_matches(
        vae.denormalize_latents(given.clone()).into_data(),
        "denormalized",
    );
    assert_matches(vae.decode(tensor("denormalized")).into_data(), "decoded");
    assert_matches(vae.decode_latents(given).into_data(), "decoded");
}

#[test]
fn flux2_vae_diffusers_folder_matches_diffusers() {
    check_vae(&load(&fixture("vae"), VaeLayout::Diffusers));
}

#[test]
fn flux2_vae_bfl_single_file_matches_diffusers() {
    check_vae(&load(
        &fixture("flux2-vae.safetensors"),
        VaeLayout::Original,
    ));
}

#[test]
fn flux2_pipeline_folder_finds_its_vae() {
    // A pipeline folder holds the VAE under `vae/`; the fixture folder is one.
    let checkpoint = VaeCheckpoint::open(&fixture("")).unwrap();
    assert_eq!(
        checkpoint.config().batch_norm,
        Some(LatentBatchNormConfig::flux2())
    );
}

#[test]
fn flux2_packing_and_ids_match_the_pipeline() {
    let normalized = tensor::<4>("normalized");
    let [_, _, h, w] = normalized.dims();
    let packed = pack_flux2_latents(normalized);
    assert_matches(packed.clone().into_data(), "packed");
    assert_matches(unpack_flux2_latents(packed, h, w).into_data(), "normalized");
    flux2_image_ids(h, w).assert_eq(&read_ids("latent_ids"), true);
    let text = read_ids("text_ids");
    flux2_text_ids(text.shape[0]).assert_eq(&text, true);
}

/// Copies the BFL fixture without `bn.running_var` and `encoder.quant_conv.bias`.
fn broken_bfl(dir: &Path) -> PathBuf {
    let source = Checkpoint::open(&fixture("flux2-vae.safetensors")).unwrap();
    let tensors: Vec<_> = source
        .tensors()
        .filter(|t| !matches!(t.name, "bn.running_var" | "encoder.quant_conv.bias"))
        .map(|t| {
            let view =
                safetensors::tensor::TensorView::new(t.dtype, t.shape.to_vec(), t.data).unwrap();
            (t.name.to_string(), view)
        })
        .collect();
    let file = dir.join("broken.safetensors");
    safetensors::serialize_to_file(tensors, None, &file).unwrap();
    file
}

#[test]
fn missing_flux2_keys_are_reported_by_name_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let file = broken_bfl(dir.path());
    let error = VaeCheckpoint::open(&file)
        .unwrap()
        .load::<B>(&Default::default(), FloatDType::F32)
        .map(|_| ())
        .unwrap_err();
    let LoadError::Keys { report, .. } = &error else {
        panic!("expected a key report, got {error}");
    };
    assert_eq!(report.missing, ["bn.running_var", "quant_conv.bias"]);
    assert!(report.unexpected.is_empty() && report.mismatched.is_empty());
    let text = error.to_string();
    assert!(
        text.contains("broken.safetensors") && text.contains("`bn.running_var`"),
        "{text}"
    );
}
