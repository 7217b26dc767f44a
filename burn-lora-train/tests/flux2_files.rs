//! A FLUX.2 run from files whose components do not belong together stops before it trains,
//! naming the file: here a VAE whose patchified latents are wider than the transformer's input.

mod common;

use burn_lora_train::config::TrainPlan;
use burn_lora_train::train::Resume;
use common::run;

#[test]
fn a_vae_of_another_width_is_named() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../burn-diffusion/tests/fixtures");
    let images = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/images");
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "name: files\nnetwork: {{linear: 2}}\n\
         model:\n  arch: flux2\n  path: {transformer}\n  vae: {vae}\n  text_encoder: {text}\n  tokenizers: {tokenizers}\n  dtype: f32\n\
         train: {{steps: 1}}\n\
         datasets:\n  - folder_path: {images}\n    resolution: [64]\n    cache_latents_to_disk: false\n",
        transformer = fixtures.join("flux2/dev/flux2-bfl.safetensors").display(),
        vae = fixtures.join("vae_flux2/flux2-vae.safetensors").display(),
        text = fixtures.join("flux2_text/mistral/text_encoder").display(),
        tokenizers = fixtures.join("flux2_text/mistral").display(),
        images = images.display(),
    );
    let file = dir.path().join("files.yaml");
    std::fs::write(&file, yaml).unwrap();
    let mut plan = TrainPlan::load(&file).unwrap();
    plan.output_dir = dir.path().join("output");
    let error = run(&plan, Resume::Auto).unwrap_err().to_string();
    assert!(
        error.contains("flux2-vae.safetensors")
            && error.contains("gives 128 values per token, the transformer reads 16"),
        "{error}"
    );
}
