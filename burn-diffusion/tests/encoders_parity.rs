//! The VAE, the text encoders, their tokenizers, FLUX input preparation and image loading
//! against the Python references (diffusers 0.42.1, transformers 5.24.0, PIL): fixtures made by
//! `tests/fixtures/make_encoder_fixtures.py` from tiny random models.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use burn_diffusion::clip::ClipTextModel;
use burn_diffusion::pipeline::{
    encode_clip_pooled, encode_t5, image_ids, load_image, pack_latents, text_ids, unpack_latents,
};
use burn_diffusion::t5::{T5Config, T5Encoder};
use burn_diffusion::tokenize::{CLIP_LENGTH, CaptionTokenizer, T5_LENGTH_DEV, T5_LENGTH_SCHNELL};
use burn_diffusion::vae::{AutoencoderKl, VaeCheckpoint, VaeConfig, VaeLayout};
use burn_quant::Checkpoint;

type B = Flex;

/// CLIP from the fixture folder `name`, in f32 on the CPU.
fn load_clip(name: &str) -> Result<ClipTextModel<B>, burn_diffusion::LoadError> {
    ClipTextModel::<B>::load(&fixture(name), &Default::default(), FloatDType::F32, None)
}

mod common;

use common::{BF16_TOLERANCE, F32_TOLERANCE, assert_within, read};

/// An i64 tensor of a fixture file as an Int tensor.
fn read_ids(file: &Path, key: &str) -> Tensor<B, 2, Int> {
    Tensor::from_data(common::read_i64(file, key), &Default::default())
}

fn tensor<const D: usize>(file: &Path, key: &str) -> Tensor<B, D> {
    let (values, shape) = read(file, key);
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

fn fixture(path: &str) -> PathBuf {
    common::fixture(path)
}

/// Checks `actual` against the reference `key` of `file` within the f32 tolerance.
fn assert_matches(actual: TensorData, file: &Path, key: &str) {
    assert_within(actual, file, key, F32_TOLERANCE);
}

fn check_vae(vae: &AutoencoderKl<B>, io: &Path) {
    let latents = vae.encode(tensor(io, "image"));
    assert_matches(latents.mean.into_data(), io, "mean");
    assert_matches(latents.logvar.into_data(), io, "logvar");
    assert_matches(vae.decode(tensor(io, "latent")).into_data(), io, "decoded");
}

#[test]
fn vae_single_file_in_original_layout_matches_diffusers() {
    let checkpoint = VaeCheckpoint::open(&fixture("vae_flux/ae.safetensors")).unwrap();
    assert_eq!(checkpoint.layout(), VaeLayout::Original);
    let expected = VaeConfig {
        block_out_channels: vec![32, 32, 32],
        layers_per_block: 1,
        ..VaeConfig::flux()
    };
    assert_eq!(checkpoint.config(), &expected, "inferred config");
    let vae = checkpoint
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap();
    check_vae(&vae, &fixture("vae_flux/io.safetensors"));
}

#[test]
fn vae_diffusers_folder_matches_diffusers() {
    let checkpoint = VaeCheckpoint::open(&fixture("vae_sdxl")).unwrap();
    assert_eq!(checkpoint.layout(), VaeLayout::Diffusers);
    assert_eq!(checkpoint.config().scaling_factor, 0.13025);
    assert_eq!(checkpoint.config().shift_factor, None);
    let vae = checkpoint
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap();
    check_vae(&vae, &fixture("vae_sdxl/io.safetensors"));
}

#[test]
fn clip_matches_transformers_with_every_hidden_state() {
    let expected = fixture("flux_text/expected.safetensors");
    let model = load_clip("flux_text").unwrap();
    let out = model.forward(read_ids(&expected, "clip_input_ids"));
    assert_matches(
        out.last_hidden_state.into_data(),
        &expected,
        "clip_last_hidden_state",
    );
    assert_matches(out.pooled.into_data(), &expected, "clip_pooled");
    assert_eq!(out.hidden_states.len(), 3);
    for (i, h) in out.hidden_states.into_iter().enumerate() {
        assert_matches(h.into_data(), &expected, &format!("clip_hidden_states_{i}"));
    }
    assert!(out.text_embeds.is_none());
}

#[test]
fn clip_with_projection_matches_transformers() {
    let io = fixture("clip_projection/io.safetensors");
    let model = load_clip("clip_projection").unwrap();
    let out = model.forward(read_ids(&io, "input_ids"));
    assert_matches(out.text_embeds.unwrap().into_data(), &io, "text_embeds");
    assert_matches(out.last_hidden_state.into_data(), &io, "last_hidden_state");
    for (i, h) in out.hidden_states.into_iter().enumerate() {
        assert_matches(h.into_data(), &io, &format!("hidden_states_{i}"));
    }
}

#[test]
fn t5_matches_transformers_from_a_folder_and_a_single_file() {
    let expected = fixture("flux_text/expected.safetensors");
    let ids = read_ids(&expected, "t5_input_ids");
    let device = Default::default();
    let folder = T5Encoder::<B>::load(&fixture("flux_text"), &device, FloatDType::F32).unwrap();
    assert_matches(
        folder.forward(ids.clone()).into_data(),
        &expected,
        "t5_last_hidden_state",
    );

    let file = fixture("flux_text/text_encoder_2/model.safetensors");
    let single = T5Encoder::<B>::load(&file, &device, FloatDType::F32).unwrap();
    let inferred = T5Config::from_json(&fixture("flux_text/text_encoder_2/config.json")).unwrap();
    assert_eq!(single.config(), &inferred, "inferred config");
    assert_matches(
        single.forward(ids).into_data(),
        &expected,
        "t5_last_hidden_state",
    );
}

#[test]
fn vae_and_text_encoders_run_in_bf16() {
    let device = Default::default();
    let bf16 = FloatDType::BF16;
    let io = fixture("vae_flux/io.safetensors");
    let vae = AutoencoderKl::<B>::load(&fixture("vae_flux/ae.safetensors"), &device, bf16).unwrap();
    let latents = vae.encode(tensor::<4>(&io, "image").cast(bf16));
    assert_eq!(latents.mean.dtype(), DType::BF16);
    assert_within(latents.mean.into_data(), &io, "mean", BF16_TOLERANCE);
    let decoded = vae.decode(tensor::<4>(&io, "latent").cast(bf16));
    assert_within(decoded.into_data(), &io, "decoded", BF16_TOLERANCE);

    let expected = fixture("flux_text/expected.safetensors");
    let clip = ClipTextModel::<B>::load(&fixture("flux_text"), &device, bf16, None).unwrap();
    let out = clip.forward(read_ids(&expected, "clip_input_ids"));
    assert_within(
        out.pooled.into_data(),
        &expected,
        "clip_pooled",
        BF16_TOLERANCE,
    );
    let t5 = T5Encoder::<B>::load(&fixture("flux_text"), &device, bf16).unwrap();
    let hidden = t5.forward(read_ids(&expected, "t5_input_ids"));
    assert_eq!(hidden.dtype(), DType::BF16);
    assert_within(
        hidden.into_data(),
        &expected,
        "t5_last_hidden_state",
        BF16_TOLERANCE,
    );
}

#[test]
fn wrong_files_are_refused_by_name() {
    let clip_file = fixture("flux_text/text_encoder/model.safetensors");
    let error = VaeCheckpoint::open(&clip_file).err().unwrap().to_string();
    assert!(
        error.contains("text_encoder/model.safetensors") && error.contains("no VAE tensors"),
        "{error}"
    );
    let error = T5Encoder::<B>::load(&clip_file, &Default::default(), FloatDType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(
        error.contains("encoder.embed_tokens.weight` is missing"),
        "{error}"
    );
    let error = load_clip("images").err().unwrap().to_string();
    assert!(error.contains("fixtures/images"), "{error}");
}

/// The fixture captions and the reference ids of each tokenizer.
fn captions() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("flux_text/captions.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn reference_ids(json: &serde_json::Value, key: &str) -> Vec<Vec<u32>> {
    serde_json::from_value(json[key].clone()).unwrap()
}

#[test]
fn tokenizers_give_the_reference_ids() {
    let json = captions();
    let texts: Vec<String> = serde_json::from_value(json["captions"].clone()).unwrap();
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let check = |tokenizer: CaptionTokenizer, key: &str, folder: &str| {
        let ids = tokenizer.encode(&texts).unwrap();
        let expected = reference_ids(&json, key);
        for ((text, got), want) in texts.iter().zip(&ids).zip(&expected) {
            assert_eq!(got, want, "{folder} ({key}) on {text:?}");
        }
    };
    for folder in ["flux_text/tokenizer", "clip_tokenizer_json"] {
        check(
            CaptionTokenizer::clip(&fixture(folder), CLIP_LENGTH).unwrap(),
            "clip_77",
            folder,
        );
    }
    for folder in ["flux_text/tokenizer_2", "t5_tokenizer_legacy"] {
        for (length, key) in [(T5_LENGTH_DEV, "t5_512"), (T5_LENGTH_SCHNELL, "t5_256")] {
            check(
                CaptionTokenizer::t5(&fixture(folder), length).unwrap(),
                key,
                folder,
            );
        }
    }
}

#[test]
fn flux_prompt_encoding_matches_the_pipeline() {
    let json = captions();
    let texts: Vec<String> = serde_json::from_value(json["captions"].clone()).unwrap();
    // The first four captions went through FluxPipeline.encode_prompt.
    let texts: Vec<&str> = texts.iter().take(4).map(String::as_str).collect();
    let expected = fixture("flux_text/expected.safetensors");
    let pipeline = fixture("flux_text");
    let device = Default::default();
    let tokenizer = CaptionTokenizer::clip(&pipeline.join("tokenizer"), CLIP_LENGTH).unwrap();
    let clip = ClipTextModel::<B>::load(&pipeline, &device, FloatDType::F32, None).unwrap();
    let pooled = encode_clip_pooled(&tokenizer, clip, &texts, 3).unwrap();
    assert_matches(concat(pooled), &expected, "pooled_prompt_embeds");
    for length in [T5_LENGTH_DEV, T5_LENGTH_SCHNELL] {
        let tokenizer = CaptionTokenizer::t5(&pipeline.join("tokenizer_2"), length).unwrap();
        let t5 = T5Encoder::<B>::load(&pipeline, &device, FloatDType::F32).unwrap();
        let embeds = encode_t5(&tokenizer, t5, &texts, 3).unwrap();
        assert_matches(
            concat(embeds),
            &expected,
            &format!("prompt_embeds_{length}"),
        );
        assert_matches(text_ids(length), &expected, &format!("text_ids_{length}"));
    }
}

/// Per-caption results stacked on a new first axis.
fn concat(rows: Vec<TensorData>) -> TensorData {
    let mut shape = vec![rows.len()];
    shape.extend(rows[0].shape.iter().copied());
    let values: Vec<f32> = rows
        .into_iter()
        .flat_map(|r| r.convert::<f32>().to_vec::<f32>().unwrap())
        .collect();
    TensorData::new(values, shape)
}

#[test]
fn flux_latent_packing_and_ids_match_the_pipeline() {
    let file = fixture("flux_inputs.safetensors");
    let vae = VaeConfig {
        block_out_channels: vec![32],
        layers_per_block: 1,
        ..VaeConfig::flux()
    }
    .init::<B>(&Default::default());
    let normalized = vae.normalize_latents(tensor(&file, "latents"));
    assert_matches(normalized.clone().into_data(), &file, "normalized");
    let packed = pack_latents(normalized);
    assert_matches(packed.clone().into_data(), &file, "packed");
    let unpacked = unpack_latents(packed, 6, 10);
    assert_matches(unpacked.clone().into_data(), &file, "unpacked");
    assert_matches(
        vae.denormalize_latents(unpacked).into_data(),
        &file,
        "denormalized",
    );
    assert_matches(image_ids(6, 10), &file, "img_ids");
}

/// A PIL-decoded `[height, width, 3]` u8 array as `[3, height, width]` in `[-1, 1]`.
fn pil_pixels(key: &str) -> Vec<f32> {
    let files = Checkpoint::open(&fixture("images/decoded.safetensors")).unwrap();
    let entry = files.get(key).unwrap();
    let [h, w, _] = entry.shape.try_into().unwrap();
    let mut planes = vec![0f32; 3 * h * w];
    for (i, v) in entry.data.iter().enumerate() {
        let (pixel, c) = (i / 3, i % 3);
        planes[c * h * w + pixel] = 2.0 * (*v as f32 / 255.0) - 1.0;
    }
    planes
}

/// The largest difference between `load_image`'s output and PIL's pixels, in 8-bit levels.
fn worst_level(image: &str, width: usize, height: usize, key: &str) -> f32 {
    let ours = load_image(&fixture(image), width, height).unwrap();
    assert_eq!(ours.shape.to_vec(), [3, height, width]);
    let ours = ours.to_vec::<f32>().unwrap();
    ours.iter()
        .zip(pil_pixels(key))
        .map(|(a, b)| (a - b).abs() * 127.5)
        .fold(0.0, f32::max)
}

#[test]
fn images_decode_and_fit_buckets_like_pil() {
    // Lossless formats decode exactly; JPEG decoders may differ by a level or two.
    assert!(worst_level("images/picture.png", 37, 23, "png") < 1e-3);
    assert!(worst_level("images/picture.webp", 37, 23, "webp") < 1e-3);
    let jpeg = worst_level("images/picture.jpg", 37, 23, "jpg");
    println!("JPEG: {jpeg} levels from PIL");
    assert!(jpeg <= 3.0, "JPEG differs from PIL by {jpeg} levels");
    // Resize to cover 16×12 and crop the center: PIL's bilinear filter and the triangle filter
    // round differently.
    let bucket = worst_level("images/picture.png", 16, 12, "bucket_16x12");
    println!("bucket: {bucket} levels from PIL");
    assert!(bucket <= 2.0, "bucket differs from PIL by {bucket} levels");
}
