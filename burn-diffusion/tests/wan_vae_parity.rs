//! Wan 2.1's video VAE against diffusers' `AutoencoderKLWan`: a fixture made by
//! `tests/fixtures/make_wan_vae_fixtures.py` from a tiny random VAE of Wan 2.1's structure (time
//! halved twice, so that chunks and caches are exercised), as a diffusers folder and as a single
//! file under Wan's original names.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_diffusion::LoadError;
use burn_diffusion::wan::{WanVae, WanVaeConfig};

type B = Flex;

mod common;

use common::{F32_TOLERANCE, assert_within, read};

fn io() -> PathBuf {
    common::fixture("wan_vae/io.safetensors")
}

fn tensor(file: &Path, key: &str) -> Tensor<B, 5> {
    let (values, shape) = read(file, key);
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn folder_vae() -> WanVae<B> {
    let folder = common::fixture("wan_vae");
    WanVae::load(&folder, &Default::default(), FloatDType::F32).unwrap()
}

fn assert_encodes_as_diffusers(vae: &WanVae<B>) {
    let io = io();
    let mean = vae.encode(tensor(&io, "video"));
    assert_eq!(mean.dims(), [1, 4, 3, 4, 4]);
    assert_within(mean.into_data(), &io, "mean", F32_TOLERANCE);
    let image_mean = vae.encode(tensor(&io, "image"));
    assert_within(image_mean.into_data(), &io, "image_mean", F32_TOLERANCE);
    let normalized = vae.encode_latents(tensor(&io, "video"));
    assert_within(normalized.into_data(), &io, "normalized", F32_TOLERANCE);
}

fn assert_decodes_as_diffusers(vae: &WanVae<B>) {
    let io = io();
    let denormalized = vae.denormalize(tensor(&io, "latents"));
    assert_within(
        denormalized.clone().into_data(),
        &io,
        "denormalized",
        F32_TOLERANCE,
    );
    let decoded = vae.decode(denormalized);
    assert_eq!(decoded.dims(), [1, 3, 9, 32, 32]);
    assert_within(decoded.into_data(), &io, "decoded", F32_TOLERANCE);
    let decoded = vae.decode_latents(tensor(&io, "latents"));
    assert_within(decoded.into_data(), &io, "decoded", F32_TOLERANCE);
    let image = vae.decode_latents(tensor(&io, "image_latents"));
    assert_eq!(image.dims(), [1, 3, 1, 32, 32]);
    assert_within(image.into_data(), &io, "image_decoded", F32_TOLERANCE);
}

#[test]
fn the_folder_encodes_as_diffusers() {
    assert_encodes_as_diffusers(&folder_vae());
}

#[test]
fn the_folder_decodes_as_diffusers() {
    assert_decodes_as_diffusers(&folder_vae());
}

/// The original names (which diffusers' own converter turns into the folder's) load to the
/// same VAE.
#[test]
fn a_single_file_under_the_original_names_encodes_and_decodes_the_same() {
    let config = WanVaeConfig::from_json(&common::fixture("wan_vae/vae/config.json")).unwrap();
    let file = common::fixture("wan_vae/original.safetensors");
    let vae =
        WanVae::<B>::load_original(&file, config, &Default::default(), FloatDType::F32).unwrap();
    assert_encodes_as_diffusers(&vae);
    assert_decodes_as_diffusers(&vae);
}

/// Without a configuration a single file is Wan 2.1's full-size VAE: every tensor of the tiny
/// file finds its parameter, and every one is reported at once as mis-shaped, under the file's
/// names, with the file.
#[test]
fn a_single_file_of_another_shape_is_refused_naming_every_tensor() {
    let file = common::fixture("wan_vae/original.safetensors");
    let error = WanVae::<B>::load(&file, &Default::default(), FloatDType::F32).unwrap_err();
    assert!(
        error.to_string().contains("original.safetensors"),
        "{error}"
    );
    let LoadError::Keys { report, .. } = error else {
        panic!("expected a key report, got {error}");
    };
    assert!(report.missing.is_empty(), "{:?}", report.missing);
    assert!(report.unexpected.is_empty(), "{:?}", report.unexpected);
    assert_eq!(report.mismatched.len(), 193);
    let shortcut = report
        .mismatched
        .iter()
        .find(|m| m.key == "decoder.upsamples.4.shortcut.weight")
        .expect("the decoder's one shortcut");
    assert_eq!(shortcut.expected, [384, 192, 1, 1, 1]);
}

#[test]
#[should_panic(expected = "Wan's VAE encodes 4k + 1 frames, got 8")]
fn a_clip_of_other_than_4k_plus_1_frames_is_refused() {
    let video = Tensor::<B, 5>::zeros([1, 3, 8, 16, 16], &Default::default());
    folder_vae().encode(video);
}

#[test]
fn the_preset_is_wan_2_1s() {
    let config = WanVaeConfig::wan21();
    assert_eq!((config.base_dim, config.z_dim), (96, 16));
    assert_eq!(config.latents_mean.len(), 16);
    assert_eq!(config.latents_std.len(), 16);
}
