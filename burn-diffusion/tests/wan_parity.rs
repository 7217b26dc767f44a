//! The Wan transformer against diffusers' `WanTransformer3DModel`: a fixture made by
//! `tests/fixtures/make_wan_fixtures.py` from a tiny random model of Wan 2.1's structure, as a
//! diffusers folder and as a single file under Wan's original names.

use std::path::Path;

use burn::backend::Flex;
use burn::tensor::{FloatDType, Tensor, TensorData};
use burn_diffusion::wan::{WanCheckpoint, WanConfig, WanInput, WanTransformer3D};

type B = Flex;

mod common;

use common::{F32_TOLERANCE, assert_within, read};

fn tensor<const D: usize>(file: &Path, key: &str) -> Tensor<B, D> {
    let (values, shape) = read(file, key);
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

/// The tiny model's configuration.
fn tiny() -> WanConfig {
    WanConfig {
        num_attention_heads: 2,
        attention_head_dim: 12,
        in_channels: 4,
        out_channels: 4,
        text_dim: 8,
        freq_dim: 16,
        ffn_dim: 32,
        num_layers: 2,
        rope_max_seq_len: 32,
        ..WanConfig::wan21_14b()
    }
}

fn assert_matches_diffusers(model: &WanTransformer3D<B>) {
    let io = common::fixture("wan/io.safetensors");
    let output = model.forward(WanInput {
        hidden_states: tensor(&io, "hidden_states"),
        timestep: tensor(&io, "timestep"),
        encoder_hidden_states: tensor(&io, "encoder_hidden_states"),
    });
    assert_eq!(output.dims(), [2, 4, 3, 4, 6]);
    assert_within(output.into_data(), &io, "output", F32_TOLERANCE);
}

#[test]
fn the_transformer_matches_diffusers() {
    let folder = common::fixture("wan");
    let model = WanTransformer3D::<B>::load(&folder, &Default::default(), FloatDType::F32).unwrap();
    assert_eq!(model.config(), &tiny());
    assert_eq!(model.config().rope_axes(), [4, 4, 4]);
    assert_matches_diffusers(&model);
}

/// The original names (which diffusers' own converter turns into the folder's) load to the
/// same model.
#[test]
fn a_single_file_under_the_original_names_loads_the_same_model() {
    let file = common::fixture("wan/original.safetensors");
    let model = WanCheckpoint::open_file(&file, Some(tiny()))
        .unwrap()
        .load::<B>(&Default::default(), FloatDType::F32)
        .unwrap();
    assert_matches_diffusers(&model);
}

/// Without a configuration, the file's shapes give every size but the heads, which are Wan's
/// 128 wide: the tiny model's width of 24 is refused by name.
#[test]
fn a_single_file_of_another_head_width_is_refused() {
    let file = common::fixture("wan/original.safetensors");
    let error = WanTransformer3D::<B>::load(&file, &Default::default(), FloatDType::F32)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("width 24 is not a multiple of Wan's heads of 128"),
        "{error}"
    );
    assert!(error.contains("original.safetensors"), "{error}");
}

#[test]
fn the_presets_split_heads_of_128_as_wan_does() {
    assert_eq!(WanConfig::wan21_14b().rope_axes(), [44, 42, 42]);
    assert_eq!(WanConfig::wan21_14b().inner_dim(), 5120);
    assert_eq!(WanConfig::wan21_1_3b().inner_dim(), 1536);
}

/// A latent whose sides the patches do not tile is refused by name, before any pass.
#[test]
fn a_latent_the_patches_do_not_tile_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let zeros = |shape: &[usize]| vec![0u8; 4 * shape.iter().product::<usize>()];
    let tensors = [
        ("hidden_states", vec![1, 4, 3, 5, 6]),
        ("timestep", vec![1]),
        ("encoder_hidden_states", vec![1, 5, 8]),
    ];
    let data: Vec<Vec<u8>> = tensors.iter().map(|(_, shape)| zeros(shape)).collect();
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&data)
        .map(|((name, shape), bytes)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap();
            (*name, view)
        })
        .collect();
    let inputs = dir.path().join("inputs.safetensors");
    safetensors::serialize_to_file(views, None, &inputs).unwrap();
    let error = burn_diffusion::wan::forward_file::<B>(
        &common::fixture("wan"),
        &inputs,
        &dir.path().join("out.safetensors"),
        FloatDType::F32,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        error.contains("multiples of the patch size [1, 2, 2]"),
        "{error}"
    );
    assert!(error.contains("inputs.safetensors"), "{error}");
}
