//! The umT5 encoder (Wan's text encoder: T5 v1.1 with a relative position bias in every layer)
//! against transformers' `UMT5EncoderModel`, with and without an attention mask: fixtures made
//! by `tests/fixtures/make_umt5_fixtures.py` from a tiny random model; and Wan's caption
//! encoding against its pipeline's.

use std::path::Path;

use burn::backend::Flex;
use burn::tensor::{FloatDType, Int, Tensor};
use burn_diffusion::pipeline::encode_wan_prompt;
use burn_diffusion::t5::{T5Config, T5Encoder};
use burn_diffusion::tokenize::CaptionTokenizer;

type B = Flex;

mod common;

use common::{F32_TOLERANCE, assert_within};

fn read_ids(file: &Path, key: &str) -> Tensor<B, 2, Int> {
    Tensor::from_data(common::read_i64(file, key), &Default::default())
}

fn encoder() -> T5Encoder<B> {
    let folder = common::fixture("umt5/text_encoder");
    T5Encoder::load(&folder, &Default::default(), FloatDType::F32).unwrap()
}

#[test]
fn the_config_holds_a_position_bias_in_every_layer() {
    let config = encoder().config().clone();
    let expected = T5Config {
        vocab_size: 96,
        d_model: 16,
        d_kv: 4,
        d_ff: 40,
        num_layers: 3,
        num_heads: 4,
        relative_attention_num_buckets: 8,
        relative_attention_max_distance: 20,
        layer_norm_epsilon: 1e-6,
        position_bias_per_layer: true,
    };
    assert_eq!(config, expected);
    assert!(
        encoder()
            .block
            .iter()
            .all(|block| block.self_attention.relative_attention_bias.is_some())
    );
}

#[test]
fn masked_encoding_matches_transformers() {
    let io = common::fixture("umt5/io.safetensors");
    let out = encoder().forward_masked(read_ids(&io, "input_ids"), read_ids(&io, "attention_mask"));
    assert_within(out.into_data(), &io, "last_hidden_state", F32_TOLERANCE);
}

#[test]
fn unmasked_encoding_matches_transformers() {
    let io = common::fixture("umt5/io.safetensors");
    let out = encoder().forward(read_ids(&io, "input_ids"));
    assert_within(
        out.into_data(),
        &io,
        "last_hidden_state_unmasked",
        F32_TOLERANCE,
    );
}

/// A single file (as ComfyUI's `umt5_xxl_*.safetensors`) is recognised as umT5 by the bias in
/// its second layer; the maximum distance, which no tensor records, is umT5-XXL's 128.
#[test]
fn a_single_file_is_read_as_umt5() {
    let file = common::fixture("umt5/text_encoder/model.safetensors");
    let encoder = T5Encoder::<B>::load(&file, &Default::default(), FloatDType::F32).unwrap();
    let config = encoder.config();
    assert!(config.position_bias_per_layer);
    assert_eq!(
        (config.num_layers, config.num_heads, config.d_kv),
        (3, 4, 4)
    );
    assert_eq!(config.relative_attention_max_distance, 128);
}

/// Wan's caption encoding equals its pipeline's (`WanPipeline._get_t5_prompt_embeds`): the
/// padding masked out, each caption cut to its own tokens; the pipeline's zero rows after them
/// are what the trainer pads with.
#[test]
fn wan_prompts_match_the_pipeline() {
    let captions = [
        "a red cube on a wooden table",
        "hi",
        "  two   cats,\tasleep in the sun  ",
    ];
    let tokenizer_folder =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/tokenizer_2");
    let tokenizer = CaptionTokenizer::t5(&tokenizer_folder, 16).unwrap();
    let folder = common::fixture("umt5/wan_prompt/text_encoder");
    let encoder = T5Encoder::<B>::load(&folder, &Default::default(), FloatDType::F32).unwrap();
    let states = encode_wan_prompt(&tokenizer, encoder, &captions, 2).unwrap();
    let lengths: Vec<usize> = states.iter().map(|s| s.shape[0]).collect();
    assert_eq!(lengths, [15, 3, 13]);
    let padded = states
        .into_iter()
        .map(|s| {
            let s = Tensor::<B, 2>::from_data(s, &Default::default());
            let [tokens, width] = s.dims();
            Tensor::cat(
                vec![s, Tensor::zeros([16 - tokens, width], &Default::default())],
                0,
            )
        })
        .collect();
    let file = common::fixture("umt5/wan_prompt/prompt_embeds.safetensors");
    assert_within(
        Tensor::stack::<3>(padded, 0).into_data(),
        &file,
        "prompt_embeds",
        F32_TOLERANCE,
    );
}
