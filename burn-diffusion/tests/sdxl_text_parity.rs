//! SDXL's caption encoding against `StableDiffusionXLPipeline.encode_prompt` (diffusers 0.42.1,
//! transformers 5.24.0): fixtures made by `tests/fixtures/make_sdxl_text_fixtures.py` from two
//! tiny random CLIP text encoders (f16 weights) and CLIP tokenizers configured as SDXL's.

use burn::backend::Flex;
use burn::tensor::{FloatDType, TensorData};
use burn_diffusion::clip::ClipTextModel;
use burn_diffusion::pipeline::encode_sdxl_prompt;
use burn_diffusion::tokenize::{CLIP_LENGTH, CaptionTokenizer};

mod common;

use common::{F32_TOLERANCE, assert_within, fixture};

type B = Flex;

/// The fixture captions and the reference ids of `tokenizer` and `tokenizer_2`.
#[derive(serde::Deserialize)]
struct Captions {
    captions: Vec<String>,
    tokenizer: Vec<Vec<u32>>,
    tokenizer_2: Vec<Vec<u32>>,
}

fn captions() -> Captions {
    let text = std::fs::read_to_string(fixture("sdxl_text/captions.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn tokenizers() -> (CaptionTokenizer, CaptionTokenizer) {
    let load = |name: &str| CaptionTokenizer::clip(&fixture(name), CLIP_LENGTH).unwrap();
    (load("sdxl_text/tokenizer"), load("sdxl_text/tokenizer_2"))
}

fn encoders() -> (ClipTextModel<B>, ClipTextModel<B>) {
    let load = |name: &str| {
        ClipTextModel::<B>::load(&fixture(name), &Default::default(), FloatDType::F32, None)
            .unwrap()
    };
    (load("sdxl_text"), load("sdxl_text/text_encoder_2"))
}

/// `rows` stacked into one tensor's data.
fn stacked(rows: Vec<TensorData>) -> TensorData {
    let mut shape = vec![rows.len()];
    shape.extend(rows[0].shape.iter().copied());
    let values = rows
        .into_iter()
        .flat_map(|row| row.to_vec::<f32>().unwrap())
        .collect::<Vec<_>>();
    TensorData::new(values, shape)
}

#[test]
fn both_tokenizers_give_the_pipelines_ids() {
    let reference = captions();
    let (tokenizer, tokenizer_2) = tokenizers();
    let captions: Vec<&str> = reference.captions.iter().map(String::as_str).collect();
    assert_eq!(tokenizer.encode(&captions).unwrap(), reference.tokenizer);
    assert_eq!(
        tokenizer_2.encode(&captions).unwrap(),
        reference.tokenizer_2
    );
    // tokenizer_2 pads with `!` (id 0) where tokenizer pads with `<|endoftext|>`.
    let empty = tokenizer_2.encode(&[""]).unwrap();
    assert_eq!(empty[0][2..], [0; CLIP_LENGTH - 2]);
}

#[test]
fn encode_sdxl_prompt_matches_the_pipeline() {
    let reference = captions();
    let captions: Vec<&str> = reference.captions.iter().map(String::as_str).collect();
    let (tokenizer, tokenizer_2) = tokenizers();
    let (encoder, encoder_2) = encoders();
    let embeds = encode_sdxl_prompt(
        (&tokenizer, &tokenizer_2),
        (&encoder, &encoder_2),
        &captions,
        3,
    )
    .unwrap();
    assert_eq!(embeds.len(), captions.len());
    let (states, pooled): (Vec<TensorData>, Vec<TensorData>) = embeds.into_iter().unzip();
    assert_eq!(states[0].shape.to_vec(), [CLIP_LENGTH, 16 + 24]);
    assert_eq!(pooled[0].shape.to_vec(), [20]);
    let expected = fixture("sdxl_text/expected.safetensors");
    assert_within(stacked(states), &expected, "prompt_embeds", F32_TOLERANCE);
    assert_within(
        stacked(pooled),
        &expected,
        "pooled_prompt_embeds",
        F32_TOLERANCE,
    );
}

#[test]
#[should_panic(expected = "no text projection")]
fn a_second_encoder_without_projection_is_refused() {
    let (tokenizer, tokenizer_2) = tokenizers();
    let (first, _) = encoders();
    let _ = encode_sdxl_prompt((&tokenizer, &tokenizer_2), (&first, &first), &["a cat"], 1);
}
