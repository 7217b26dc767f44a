//! FLUX.2's text encoders against the Python references (diffusers 0.42.1, transformers 5.24.0):
//! the prompt tokenization, the decoders' hidden states and the pipelines' stacked
//! `prompt_embeds`, for a tiny Mistral 3 and a tiny Qwen3 made by
//! `tests/fixtures/make_flux2_text_fixtures.py`.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use burn_diffusion::LoadError;
use burn_diffusion::pipeline::encode_flux2_text;
use burn_diffusion::text_decoder::{TextDecoder, TextDecoderConfig};
use burn_diffusion::tokenize::{FLUX2_TEXT_LENGTH, PromptTokenizer};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

type B = Flex;

mod common;

use common::{BF16_TOLERANCE, F32_TOLERANCE};

/// The hidden states the fixtures stack (FLUX.2's three, scaled to four layers).
const LAYERS: [usize; 3] = [1, 2, 3];
/// The prompt length of the fixtures' embeddings.
const LENGTH: usize = 96;

fn fixture(path: &str) -> PathBuf {
    common::fixture("flux2_text").join(path)
}

fn expected() -> PathBuf {
    fixture("expected.safetensors")
}

/// An i64 tensor of the reference file as an Int tensor.
fn read_ints(key: &str) -> Tensor<B, 2, Int> {
    Tensor::from_data(common::read_i64(&expected(), key), &Default::default())
}

/// Checks `actual` against the reference `key` within `tolerance`.
fn assert_within(actual: TensorData, key: &str, tolerance: f64) {
    common::assert_within(actual, &expected(), key, tolerance);
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

fn captions() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("captions.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn caption_texts(json: &serde_json::Value) -> Vec<String> {
    serde_json::from_value(json["captions"].clone()).unwrap()
}

fn tokenizer(family: &str, length: usize) -> PromptTokenizer {
    let folder = fixture(&format!("{family}/tokenizer"));
    match family {
        "mistral" => PromptTokenizer::mistral(&folder, length).unwrap(),
        _ => PromptTokenizer::qwen3(&folder, length).unwrap(),
    }
}

fn load(path: &Path, dtype: FloatDType) -> TextDecoder<B> {
    TextDecoder::<B>::load(path, &Default::default(), dtype).unwrap()
}

#[test]
fn prompt_tokenizers_give_the_pipelines_ids_and_masks() {
    let json = captions();
    let texts = caption_texts(&json);
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    for family in ["mistral", "qwen3"] {
        for length in [FLUX2_TEXT_LENGTH, LENGTH] {
            let tokens = tokenizer(family, length).encode(&texts).unwrap();
            let reference = &json[family][length.to_string()];
            let ids: Vec<Vec<u32>> =
                serde_json::from_value(reference["input_ids"].clone()).unwrap();
            let mask: Vec<Vec<u32>> =
                serde_json::from_value(reference["attention_mask"].clone()).unwrap();
            for (i, text) in texts.iter().enumerate() {
                assert_eq!(
                    tokens.input_ids[i], ids[i],
                    "{family} {length}: ids of {text:?}"
                );
                assert_eq!(
                    tokens.attention_mask[i], mask[i],
                    "{family} {length}: mask of {text:?}"
                );
            }
        }
    }
}

#[test]
fn mistral_prompt_is_the_chat_template_output() {
    let prompt = tokenizer("mistral", LENGTH).prompt("a [IMG]cat");
    assert!(prompt.starts_with("<s>[SYSTEM_PROMPT]You are an AI that reasons"));
    assert!(prompt.ends_with("without speculation.[/SYSTEM_PROMPT][INST]a cat[/INST]"));
    let prompt = tokenizer("qwen3", LENGTH).prompt("a cat");
    assert_eq!(
        prompt,
        "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
}

/// The pipeline's `prompt_embeds` of every caption, through `encode_flux2_text`.
fn check_prompt_embeds(family: &str, decoder: TextDecoder<B>, key: &str, tolerance: f64) {
    let json = captions();
    let texts = caption_texts(&json);
    let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
    let embeds =
        encode_flux2_text(&tokenizer(family, LENGTH), decoder, &texts, &LAYERS, 2).unwrap();
    assert_within(concat(embeds), key, tolerance);
}

/// The embeddings and the last, normed hidden state of the reference ids.
fn check_ends(family: &str, decoder: &TextDecoder<B>) {
    let ids = read_ints(&format!("{family}_input_ids"));
    let mask = read_ints(&format!("{family}_attention_mask"));
    let last = decoder.config().num_hidden_layers;
    for index in [0, last] {
        let state = decoder.hidden_states(ids.clone(), mask.clone(), &[index]);
        let key = format!("{family}_hidden_states_{index}");
        assert_within(state.into_data(), &key, F32_TOLERANCE);
    }
}

#[test]
fn mistral_from_a_transformers_5_folder_matches_the_pipeline() {
    let decoder = load(&fixture("mistral"), FloatDType::F32);
    let config = decoder.config();
    assert_eq!(
        (config.num_attention_heads, config.num_key_value_heads),
        (2, 1)
    );
    assert_eq!((config.head_dim, config.hidden_size), (128, 32));
    assert!(!config.qk_norm);
    check_ends("mistral", &decoder);
    check_prompt_embeds("mistral", decoder, "mistral_prompt_embeds", F32_TOLERANCE);
}

#[test]
fn mistral_from_comfyui_single_file_matches_the_pipeline() {
    let decoder = load(&fixture("mistral_comfy.safetensors"), FloatDType::F32);
    let from_json =
        TextDecoderConfig::from_json(&fixture("mistral/text_encoder/config.json")).unwrap();
    assert_eq!(decoder.config(), &from_json, "inferred config");
    check_prompt_embeds("mistral", decoder, "mistral_prompt_embeds", F32_TOLERANCE);
}

#[test]
fn qwen3_from_a_folder_and_a_single_file_matches_the_pipeline() {
    let decoder = load(&fixture("qwen3"), FloatDType::F32);
    assert!(decoder.config().qk_norm);
    check_ends("qwen3", &decoder);
    check_prompt_embeds("qwen3", decoder, "qwen3_prompt_embeds", F32_TOLERANCE);

    let single = load(
        &fixture("qwen3/text_encoder/model.safetensors"),
        FloatDType::F32,
    );
    let from_json =
        TextDecoderConfig::from_json(&fixture("qwen3/text_encoder/config.json")).unwrap();
    assert_eq!(single.config(), &from_json, "inferred config");
    check_prompt_embeds("qwen3", single, "qwen3_prompt_embeds", F32_TOLERANCE);
}

#[test]
fn decoders_run_in_bf16() {
    for family in ["mistral", "qwen3"] {
        let decoder = load(&fixture(family), FloatDType::BF16);
        let ids = read_ints(&format!("{family}_input_ids"));
        let mask = read_ints(&format!("{family}_attention_mask"));
        let state = decoder.hidden_states(ids, mask, &LAYERS);
        assert_eq!(state.dtype(), DType::BF16);
        assert_within(
            state.into_data(),
            &format!("{family}_prompt_embeds"),
            BF16_TOLERANCE,
        );
        let key = format!("{family}_prompt_embeds_bf16");
        check_prompt_embeds(family, decoder, &key, BF16_TOLERANCE);
    }
}

/// A copy of ComfyUI's Mistral file with `change` applied to its `(key, tensor)` list.
fn comfy_copy(dir: &Path, change: impl FnOnce(&mut Vec<(String, TensorView<'_>)>)) -> PathBuf {
    let bytes = std::fs::read(fixture("mistral_comfy.safetensors")).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| (name.to_string(), view))
        .collect();
    change(&mut tensors);
    let out = dir.join("broken.safetensors");
    safetensors::serialize_to_file(tensors, None, &out).unwrap();
    out
}

#[test]
fn a_file_cut_after_the_last_stacked_layer_gives_the_same_embeddings() {
    // ComfyUI's pruned Mistral keeps the layers up to the deepest stacked state, without the
    // final norm.
    let dir = tempfile::tempdir().unwrap();
    let cut = comfy_copy(dir.path(), |tensors| {
        tensors.retain(|(name, _)| {
            !name.starts_with("model.layers.3.") && name != "model.norm.weight"
        });
    });
    let decoder = load(&cut, FloatDType::F32);
    assert_eq!(decoder.config().num_hidden_layers, 3);
    assert!(!decoder.config().final_norm);
    check_prompt_embeds("mistral", decoder, "mistral_prompt_embeds", F32_TOLERANCE);
}

#[test]
fn missing_unexpected_and_misshaped_keys_are_named_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let broken = comfy_copy(dir.path(), |tensors| {
        tensors.retain(|(name, _)| name != "model.layers.2.mlp.up_proj.weight");
        for (name, _) in tensors.iter_mut() {
            if name == "model.layers.1.self_attn.o_proj.weight" {
                *name = "model.layers.1.self_attn.out_proj.weight".into();
            }
        }
        let norm = tensors
            .iter()
            .position(|(name, _)| name == "model.layers.0.input_layernorm.weight")
            .unwrap();
        let (name, view) = tensors.remove(norm);
        let data = &view.data()[..view.data().len() / 2];
        let half = TensorView::new(view.dtype(), vec![view.shape()[0] / 2], data).unwrap();
        tensors.push((name, half));
    });
    let error = TextDecoder::<B>::load(&broken, &Default::default(), FloatDType::F32)
        .err()
        .unwrap();
    let LoadError::Keys { report, .. } = &error else {
        panic!("expected a key report, got {error}");
    };
    assert_eq!(
        report.missing,
        [
            "layers.1.self_attn.o_proj.weight",
            "layers.2.mlp.up_proj.weight"
        ]
    );
    assert_eq!(
        report.unexpected,
        ["model.layers.1.self_attn.out_proj.weight"]
    );
    assert_eq!(report.mismatched.len(), 1);
    assert_eq!(
        report.mismatched[0].key,
        "model.layers.0.input_layernorm.weight"
    );
    let text = error.to_string();
    assert!(text.contains("broken.safetensors"), "{text}");
    assert!(text.contains("`layers.2.mlp.up_proj.weight`"), "{text}");
}

#[test]
fn every_linear_weight_can_be_placed_elsewhere() {
    let device = Default::default();
    let mut placed = Vec::new();
    let decoder = TextDecoder::<B>::load_with(
        &fixture("qwen3"),
        &device,
        FloatDType::F32,
        &mut |name, data| {
            placed.push(name.to_string());
            Ok(Tensor::from_data(data, &device))
        },
    )
    .unwrap();
    // Seven projections in each of the four layers; embeddings and norms stay on the device.
    assert_eq!(placed.len(), 4 * 7, "{placed:?}");
    assert!(placed.contains(&"layers.3.mlp.down_proj.weight".to_string()));
    assert!(placed.iter().all(|name| name.ends_with("_proj.weight")));
    check_prompt_embeds("qwen3", decoder, "qwen3_prompt_embeds", F32_TOLERANCE);
}
