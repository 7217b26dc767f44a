//! Latent and caption caches: written beside the images, read back instead of encoding, keyed
//! by what the values depend on, rebuilt when unreadable.

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{DType, TensorData};
use burn_lora_train::cache::{CACHE_FOLDER, Prepared, prepare};
use burn_lora_train::config::TrainPlan;
use burn_lora_train::dataset::Dataset;
use burn_lora_train::family::{Family, Flux1};

/// The tiny example with its images copied to `dir` and the disk cache on.
fn cached_plan(dir: &Path) -> TrainPlan {
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/images");
    for entry in std::fs::read_dir(images).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/tiny/config.yaml");
    let mut plan = TrainPlan::load(&config).unwrap();
    plan.datasets[0].folder = dir.to_path_buf();
    plan.datasets[0].cache_to_disk = true;
    plan
}

/// The random encoders of the tiny model draw from the backend's generator, which is global
/// to the process: tests that build them take turns.
static ENCODERS: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(plan: &TrainPlan) -> Prepared {
    let _turn = ENCODERS.lock().unwrap_or_else(|e| e.into_inner());
    let dataset = Dataset::scan(&plan.datasets, burn_lora_train::dataset::PIXEL_MULTIPLE).unwrap();
    let family = Flux1::new(plan).unwrap();
    prepare::<_, Flex>(&family, plan, &dataset, &Default::default()).unwrap()
}

fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir.join(CACHE_FOLDER))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}

fn zeros_like(data: &TensorData) -> TensorData {
    TensorData::zeros::<f32, _>(data.shape.clone())
}

#[test]
fn a_valid_cache_is_read_instead_of_encoding() {
    let dir = tempfile::tempdir().unwrap();
    let plan = cached_plan(dir.path());
    let first = run(&plan);
    let files = cache_files(dir.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let n = first.images.len();
    assert_eq!(n, 6);

    // Replace the cached latents with zeros: a second run must return them as they are.
    let mut tensors = safetensors_tensors(&files[0]);
    for (name, data) in &mut tensors {
        if name.starts_with("latent.") {
            *data = zeros_like(data);
        }
    }
    write_safetensors(&files[0], &tensors);
    let second = run(&plan);
    for (latent, original) in second.images.iter().zip(&first.images) {
        assert_eq!(latent["latent"], zeros_like(&original["latent"]));
    }
    assert_eq!(second.captions, first.captions);
    assert_eq!(second.empty, first.empty);
}

#[test]
fn a_changed_caption_gets_a_new_cache_and_a_damaged_one_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let plan = cached_plan(dir.path());
    let first = run(&plan);

    std::fs::write(dir.path().join("stripes.txt"), "zebra stripes\n").unwrap();
    let changed = run(&plan);
    assert_eq!(cache_files(dir.path()).len(), 2);
    assert_eq!(changed.images, first.images);
    assert_ne!(changed.captions, first.captions);

    // Cut the newest file short: the next run warns, encodes again and rewrites it.
    let files = cache_files(dir.path());
    let newest = files
        .iter()
        .max_by_key(|f| std::fs::metadata(f).unwrap().modified().unwrap())
        .unwrap();
    let bytes = std::fs::read(newest).unwrap();
    std::fs::write(newest, &bytes[..bytes.len() / 2]).unwrap();
    let rebuilt = run(&plan);
    assert_eq!(rebuilt.images, changed.images);
    assert_eq!(rebuilt.captions, changed.captions);
    assert_eq!(std::fs::read(newest).unwrap(), bytes);
}

/// The tensors of a cache file (all f32 in the tiny model).
fn safetensors_tensors(path: &Path) -> Vec<(String, TensorData)> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let data = TensorData::from_bytes_vec(
                view.data().to_vec(),
                view.shape().to_vec(),
                burn::tensor::DType::F32,
            );
            (name, data)
        })
        .collect()
}

fn write_safetensors(path: &Path, tensors: &[(String, TensorData)]) {
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, data)| {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                data.shape.to_vec(),
                data.as_bytes(),
            )
            .unwrap();
            (name.as_str(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn a_cache_holding_a_non_finite_value_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let plan = cached_plan(dir.path());
    let first = run(&plan);
    let files = cache_files(dir.path());
    let bytes = std::fs::read(&files[0]).unwrap();
    let mut tensors = safetensors_tensors(&files[0]);
    let (_, states) = tensors
        .iter_mut()
        .find(|(name, _)| name == "states.2")
        .unwrap();
    let mut values = states.to_vec::<f32>().unwrap();
    values[7] = f32::NAN;
    *states = TensorData::new(values, states.shape.clone());
    write_safetensors(&files[0], &tensors);

    let rebuilt = run(&plan);
    assert_eq!(rebuilt.captions, first.captions);
    assert_eq!(rebuilt.images, first.images);
    assert_eq!(std::fs::read(&files[0]).unwrap(), bytes);
}

/// With a bf16 model the VAE still runs in f32 (Burn's CUDA convolution gives NaN in bf16 for
/// its first layer): the latents are the f32 model's, rounded to bf16 once. A bf16 VAE would be
/// further off than that rounding.
#[test]
fn a_bf16_model_encodes_with_the_f32_vae_and_keeps_bf16_latents() {
    let f32_dir = tempfile::tempdir().unwrap();
    let full = run(&cached_plan(f32_dir.path()));
    let dir = tempfile::tempdir().unwrap();
    let mut plan = cached_plan(dir.path());
    plan.model.dtype = DType::BF16;
    let prepared = run(&plan);
    let finite = |data: &TensorData| data.iter::<f32>().all(f32::is_finite);
    for (image, full) in prepared.images.iter().zip(&full.images) {
        let (latent, full) = (&image["latent"], &full["latent"]);
        assert_eq!(latent.dtype, DType::BF16);
        assert!(finite(latent));
        for (got, want) in latent.iter::<f32>().zip(full.iter::<f32>()) {
            // One bf16 rounding: at most half a unit in the last of its 8 significant bits.
            assert!(
                (got - want).abs() <= want.abs() / 256.0 + 1e-30,
                "{got} is not {want} rounded to bf16"
            );
        }
    }
    for caption in prepared.captions.iter().chain([&prepared.empty]) {
        assert!(finite(&caption["pooled"]) && finite(&caption["states"]));
    }
}
