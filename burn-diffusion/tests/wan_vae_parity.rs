//! Wan's video VAE against diffusers' `AutoencoderKLWan`: fixtures made by
//! `tests/fixtures/make_wan_vae_fixtures.py` from tiny random VAEs of Wan 2.1's structure (time
//! halved twice, so that chunks and caches are exercised), as a diffusers folder and as a single
//! file under Wan's original names, and of Wan 2.2's (residual levels, 2×2 patches, a decoder
//! of its own width), as a diffusers folder.

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

#[test]
fn the_preset_is_wan_2_2s() {
    let config = WanVaeConfig::wan22();
    assert_eq!((config.base_dim, config.decoder_base_dim), (160, Some(256)));
    assert_eq!((config.z_dim, config.spatial_compression()), (48, 16));
    assert_eq!(config.latents_mean.len(), 48);
    assert_eq!(config.latents_std.len(), 48);
    assert_eq!(WanVaeConfig::wan21().spatial_compression(), 8);
}

/// Wan2.2-TI2V-5B-Diffusers' `vae/config.json`, as diffusers writes it from its converter's
/// values, is the preset.
#[test]
fn the_ti2v_5b_config_reads_as_the_wan_2_2_preset() {
    let file = common::fixture("wan_vae22/ti2v_5b/config.json");
    assert_eq!(
        WanVaeConfig::from_json(&file).unwrap(),
        WanVaeConfig::wan22()
    );
}

fn io22() -> PathBuf {
    common::fixture("wan_vae22/io.safetensors")
}

fn folder_vae22() -> WanVae<B> {
    let folder = common::fixture("wan_vae22");
    WanVae::load(&folder, &Default::default(), FloatDType::F32).unwrap()
}

#[test]
fn wan_2_2s_folder_encodes_as_diffusers() {
    let vae = folder_vae22();
    let io = io22();
    let mean = vae.encode(tensor(&io, "video"));
    assert_eq!(mean.dims(), [1, 8, 2, 2, 3]);
    assert_within(mean.into_data(), &io, "mean", F32_TOLERANCE);
    let latents = vae.encode_latents(tensor(&io, "video"));
    assert_within(latents.into_data(), &io, "latents", F32_TOLERANCE);
}

#[test]
fn wan_2_2s_folder_decodes_as_diffusers() {
    let vae = folder_vae22();
    let io = io22();
    let decoded = vae.decode_latents(tensor(&io, "latents"));
    assert_eq!(decoded.dims(), [1, 3, 5, 32, 48]);
    assert_within(decoded.into_data(), &io, "decoded", F32_TOLERANCE);
}

#[test]
#[should_panic(expected = "this Wan VAE encodes heights and widths divisible by 16, got 32×40")]
fn wan_2_2_refuses_a_clip_its_shortcuts_cannot_fold() {
    let video = Tensor::<B, 5>::zeros([1, 3, 1, 32, 40], &Default::default());
    folder_vae22().encode(video);
}

/// A folder's shape comes from its `config.json`; a single file's from the encoder's first
/// convolution: 2 × 2 patches of RGB (12 channels) are Wan 2.2's.
#[test]
fn the_shape_of_a_vae_is_read_without_loading_it() {
    let folder22 = common::fixture("wan_vae22");
    let tiny22 = WanVaeConfig::of(&folder22).unwrap();
    assert_eq!((tiny22.z_dim, tiny22.patch_size), (8, Some(2)));
    let file22 = common::fixture("wan_vae22/vae/diffusion_pytorch_model.safetensors");
    assert_eq!(WanVaeConfig::of(&file22).unwrap(), WanVaeConfig::wan22());
    let original21 = common::fixture("wan_vae/original.safetensors");
    assert_eq!(
        WanVaeConfig::of(&original21).unwrap(),
        WanVaeConfig::wan21()
    );
}
