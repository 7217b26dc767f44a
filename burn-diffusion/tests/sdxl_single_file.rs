//! SDXL's original (SGM) single file against diffusers' own converters: the UNet's tensor names
//! and both text encoders, from fixtures made by
//! `tests/fixtures/make_sdxl_keys_fixtures.py` (diffusers 0.42.1, transformers 5.24.0).

use std::collections::BTreeSet;
use std::path::PathBuf;

use burn::backend::Flex;
use burn::tensor::{FloatDType, Int, Tensor};
use burn_diffusion::clip::{ClipActivation, ClipTextModel, SgmTextEncoder};
use burn_diffusion::sdxl::{UNetLayout, unet_modules};
use serde_json::Value;

mod common;

use common::{F32_TOLERANCE, assert_within, fixture};

type B = Flex;

fn folder(path: &str) -> PathBuf {
    fixture(&format!("sdxl_single_file/{path}"))
}

/// The UNet layout of a diffusers UNet config (the fields the fixture's configs set).
fn layout_of(config: &Value) -> UNetLayout {
    let numbers = |field: &str| -> Vec<usize> {
        config[field]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect()
    };
    let layers = numbers("transformer_layers_per_block");
    let transformer_depth = config["down_block_types"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&layers)
        .map(|(kind, &depth)| {
            let cross = kind.as_str().unwrap().starts_with("CrossAttn");
            if cross { depth } else { 0 }
        })
        .collect();
    UNetLayout {
        block_out_channels: numbers("block_out_channels"),
        layers_per_block: config["layers_per_block"].as_u64().unwrap() as usize,
        transformer_depth,
        mid_depth: *layers.last().unwrap(),
    }
}

/// The UNet table expands to exactly the key pairs diffusers' `convert_ldm_unet_checkpoint`
/// maps: every tensor of diffusers' UNet, from every SGM key, nothing else.
#[test]
fn unet_names_are_diffusers_converters() {
    let text = std::fs::read_to_string(folder("unet_keys.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    for name in ["sdxl", "tiny"] {
        let case = &fixture[name];
        let layout = layout_of(&case["config"]);
        if name == "sdxl" {
            assert_eq!(layout, UNetLayout::sdxl());
        }
        let expected: BTreeSet<(String, String)> = case["keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|pair| {
                let pair = pair.as_array().unwrap();
                let key = |i: usize| pair[i].as_str().unwrap().to_string();
                (key(0), key(1))
            })
            .collect();
        let modules = unet_modules(&layout);
        let actual: Vec<(String, String)> = modules.iter().flat_map(|m| m.param_keys()).collect();
        let unique: BTreeSet<(String, String)> = actual.iter().cloned().collect();
        assert_eq!(unique.len(), actual.len(), "{name}: a pair twice");
        let extra: Vec<_> = unique.difference(&expected).collect();
        let missing: Vec<_> = expected.difference(&unique).collect();
        assert!(
            extra.is_empty() && missing.is_empty(),
            "{name}: not diffusers' pairs\n  extra: {extra:?}\n  missing: {missing:?}"
        );
        println!(
            "{name}: {} tensors in {} modules",
            actual.len(),
            modules.len()
        );
    }
}

/// Both text encoders of an SGM file give transformers' outputs: the penultimate hidden
/// states SDXL conditions on, the pooled state, and bigG's projected `text_embeds`.
#[test]
fn sgm_text_encoders_match_transformers() {
    let (file, io) = (folder("text.safetensors"), folder("text_io.safetensors"));
    let device = Default::default();
    let ids: Tensor<B, 2, Int> = Tensor::from_data(common::read_i64(&io, "input_ids"), &device);
    for (encoder, name, activation) in [
        (SgmTextEncoder::ClipL, "clip_l", ClipActivation::QuickGelu),
        (SgmTextEncoder::BigG, "big_g", ClipActivation::Gelu),
    ] {
        let model = ClipTextModel::<B>::load_sgm(&file, encoder, &device, FloatDType::F32, None)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let config = model.config();
        assert_eq!(
            (
                config.hidden_size,
                config.num_hidden_layers,
                config.hidden_act
            ),
            (64, 2, activation),
            "{name}"
        );
        let out = model.forward(ids.clone());
        let penultimate = out.hidden_states[out.hidden_states.len() - 2].clone();
        let check =
            |data, key: &str| assert_within(data, &io, &format!("{name}.{key}"), F32_TOLERANCE);
        check(penultimate.into_data(), "penultimate");
        check(out.pooled.into_data(), "pooled");
        match encoder {
            SgmTextEncoder::ClipL => assert!(out.text_embeds.is_none()),
            SgmTextEncoder::BigG => check(out.text_embeds.unwrap().into_data(), "text_embeds"),
        }
    }
}

/// A file without the encoder's tensors is an error naming the file and a missing tensor.
#[test]
fn an_sgm_file_without_the_encoder_is_an_error_naming_it() {
    let file = fixture("vae_flux/ae.safetensors");
    let error = ClipTextModel::<B>::load_sgm(
        &file,
        SgmTextEncoder::BigG,
        &Default::default(),
        FloatDType::F32,
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        error.contains("ae.safetensors") && error.contains("embeddings.token_embedding.weight"),
        "{error}"
    );
}
