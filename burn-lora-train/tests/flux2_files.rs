//! FLUX.2 from files, as users keep them: burn-diffusion's parity fixtures (a BFL transformer
//! file and the BFL-layout VAE, made by diffusers' own code), a single-file Mistral text decoder
//! deep enough for FLUX.2-dev's stacked states (layers 10, 20, 30; random weights written here
//! in ComfyUI's key layout) and the Mistral fixture's tokenizer train together with the weights
//! streamed as FP8 from host memory; a component that does not fit is named before anything
//! trains.

mod common;

use std::path::{Path, PathBuf};

use burn_lora_train::config::TrainPlan;
use burn_lora_train::train::Resume;
use common::run;

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../burn-diffusion/tests/fixtures")
        .join(path)
}

/// A 30-layer Mistral-shaped decoder (width 32, 2 query heads of 128 sharing one key-value
/// head, as ComfyUI's files have no q/k norms and heads of 128) with small random f32 weights,
/// as one `.safetensors` file under `model.` keys.
fn deep_decoder(dir: &Path) -> PathBuf {
    let (hidden, heads, head, ffn, vocab) = (32, 2, 128, 64, 512);
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ];
    for i in 0..30 {
        let p = format!("model.layers.{i}");
        shapes.extend([
            (format!("{p}.input_layernorm.weight"), vec![hidden]),
            (format!("{p}.post_attention_layernorm.weight"), vec![hidden]),
            (
                format!("{p}.self_attn.q_proj.weight"),
                vec![heads * head, hidden],
            ),
            (format!("{p}.self_attn.k_proj.weight"), vec![head, hidden]),
            (format!("{p}.self_attn.v_proj.weight"), vec![head, hidden]),
            (
                format!("{p}.self_attn.o_proj.weight"),
                vec![hidden, heads * head],
            ),
            (format!("{p}.mlp.gate_proj.weight"), vec![ffn, hidden]),
            (format!("{p}.mlp.up_proj.weight"), vec![ffn, hidden]),
            (format!("{p}.mlp.down_proj.weight"), vec![hidden, ffn]),
        ]);
    }
    let mut state = 7u32;
    let bytes: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            (0..n)
                .flat_map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    let unit = (state >> 8) as f32 / (1u32 << 24) as f32;
                    let value = if name.ends_with("norm.weight") {
                        1.0
                    } else {
                        (unit - 0.5) * 0.2
                    };
                    value.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views: Vec<(&str, safetensors::tensor::TensorView)> = shapes
        .iter()
        .zip(&bytes)
        .map(|((name, shape), data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data);
            (name.as_str(), view.unwrap())
        })
        .collect();
    let file = dir.join("mistral_deep.safetensors");
    safetensors::serialize_to_file(views, None, &file).unwrap();
    file
}

/// A plan of `steps` steps on the tiny example's images, from the fixtures' transformer and
/// tokenizer, the VAE `vae` and the text decoder `text`, with `model` settings added.
fn plan(dir: &Path, vae: &str, text: &Path, model: &str, steps: u64) -> TrainPlan {
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/images");
    let yaml = format!(
        "name: files\nnetwork: {{linear: 2, include: [double_blocks, single_blocks]}}\n\
         model:\n  arch: flux2\n  path: {transformer}\n  vae: {vae}\n  text_encoder: {text}\n  \
         tokenizers: {tokenizers}\n  dtype: f32\n{model}\
         train: {{steps: {steps}, optimizer: adamw}}\n\
         datasets:\n  - folder_path: {images}\n    resolution: [64]\n    cache_latents_to_disk: false\n",
        transformer = fixture("flux2/dev/flux2-bfl.safetensors").display(),
        vae = fixture(vae).display(),
        text = text.display(),
        tokenizers = fixture("flux2_text/mistral").display(),
        images = images.display(),
    );
    let file = dir.join("files.yaml");
    std::fs::write(&file, yaml).unwrap();
    let mut plan = TrainPlan::load(&file).unwrap();
    plan.output_dir = dir.join("output");
    plan
}

#[test]
fn the_fixture_files_train_streamed_as_fp8() {
    let dir = tempfile::tempdir().unwrap();
    let streamed = "  quantize: e5m2\n  offload: {vram_budget_gb: 0}\n";
    let text = deep_decoder(dir.path());
    let plan = plan(
        dir.path(),
        "vae_flux2/flux2-vae.safetensors",
        &text,
        streamed,
        2,
    );
    let summary = run(&plan, Resume::Auto).unwrap();
    assert_eq!(summary.losses.len(), 2);
    assert!(summary.losses.iter().all(|l| l.is_finite() && *l > 0.0));
    assert!(summary.lora.unwrap().is_file());
}

#[test]
fn a_vae_of_another_width_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = deep_decoder(dir.path());
    let plan = plan(dir.path(), "vae_flux/ae.safetensors", &text, "", 1);
    let error = run(&plan, Resume::Auto).unwrap_err().to_string();
    assert!(
        error.contains("ae.safetensors")
            && error.contains("gives 16 values per token, the transformer reads 128"),
        "{error}"
    );
}

#[test]
fn a_text_decoder_too_shallow_for_flux2_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let text = fixture("flux2_text/mistral/text_encoder");
    let plan = plan(dir.path(), "vae_flux2/flux2-vae.safetensors", &text, "", 1);
    let error = run(&plan, Resume::Auto).unwrap_err().to_string();
    assert!(
        error.contains("text_encoder")
            && error.contains("has 4 layers; FLUX.2 reads the hidden states [10, 20, 30]"),
        "{error}"
    );
}
