//! What the denoiser reads instead of images and captions, computed once before training and,
//! for datasets with `cache_latents_to_disk`, kept beside the images for the next run.
//!
//! The encodings are the family's named tensors ([`Encoded`], names from its [`Schema`]). A
//! dataset's cache is one safetensors file, `<folder>/_burnlora_cache/<hash>.safetensors`, with
//! `<name>.<k>` for each of the k-th item's image and caption encodings (for FLUX.1 `latent.<k>`,
//! `pooled.<k>`, `states.<k>`) and `<name>.empty` for the empty caption's. The hash covers
//! everything the values depend on: the family and its model (source, dtype, the VAE's dtype,
//! seed of a random one, what the family adds), and each item's image file (name, size,
//! modification time), bucket and caption. A file whose hash differs is simply not looked at: a
//! changed setting gets a new file; a file that fails to read, or holds a non-finite value, is
//! rebuilt with a warning.
//! Files are written atomically. An encoder that turns an image or a caption into non-finite
//! values stops the run with an error naming both, before anything is cached or trained.
//!
//! The image encoder is loaded only when some dataset has no valid cache, encodes what is
//! missing and is dropped; then the text encoders, likewise; the denoiser is loaded after both.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Instant, UNIX_EPOCH};

use burn::tensor::{FloatDType, TensorData};
use burn_offload::StreamTarget;

use crate::checkpoint::{read_tensors, write_tensors};
use crate::config::{ModelSource, TrainPlan, fnv1a64};
use crate::dataset::{Dataset, DatasetError, SourceKind};
use crate::error::TrainError;
use crate::family::{Encoded, Family, Schema, finite};
use crate::report::Heartbeat;

/// Name of the cache folder inside a dataset folder.
pub const CACHE_FOLDER: &str = "_burnlora_cache";

/// What training reads instead of images and captions.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// Each item's image encodings.
    pub images: Vec<Encoded>,
    /// Each item's caption encodings.
    pub captions: Vec<Encoded>,
    /// The empty caption's encodings (caption dropout).
    pub empty: Encoded,
}

/// One dataset's share of the items and its cache file.
struct Part {
    items: Vec<usize>,
    file: Option<PathBuf>,
}

/// The encodings of every item of `dataset` for `family`, from the caches where valid, else
/// computed on `device` (and cached when the dataset asks for it).
pub fn prepare<F: Family, B: StreamTarget>(
    family: &F,
    plan: &TrainPlan,
    dataset: &Dataset,
    device: &B::Device,
) -> Result<Prepared, TrainError> {
    let schema = family.schema();
    let n = dataset.items().len();
    let mut images: Vec<Option<Encoded>> = vec![None; n];
    let mut captions: Vec<Option<Encoded>> = vec![None; n];
    let mut empty = None;
    let mut parts = Vec::new();
    for (index, settings) in plan.datasets.iter().enumerate() {
        let items: Vec<usize> = (0..n)
            .filter(|&i| dataset.items()[i].dataset == index)
            .collect();
        let file = settings
            .cache_to_disk
            .then(|| cache_file(family, plan, dataset, &settings.folder, &items))
            .transpose()?;
        if let Some(file) = file.as_deref().filter(|f| f.is_file()) {
            match read_part(file, &schema, items.len()) {
                Ok((part_images, part_captions, part_empty)) => {
                    tracing::info!("{}: cached encodings", file.display());
                    for ((&i, image), caption) in items.iter().zip(part_images).zip(part_captions) {
                        images[i] = Some(image);
                        captions[i] = Some(caption);
                    }
                    empty = Some(part_empty);
                    continue;
                }
                Err(e) => tracing::warn!("{}: {e}; rebuilding the cache", file.display()),
            }
        }
        parts.push(Part { items, file });
    }

    let missing: Vec<usize> = parts.iter().flat_map(|p| p.items.iter().copied()).collect();
    if !missing.is_empty() || empty.is_none() {
        if !missing.is_empty() {
            let start = Instant::now();
            let heartbeat = Heartbeat::start(format!("encoding {} images", missing.len()));
            let encoded = family.encode_images::<B>(plan, dataset, &missing, device)?;
            drop(heartbeat);
            for (&i, image) in missing.iter().zip(encoded) {
                images[i] = Some(image);
            }
            tracing::info!(
                "encoded {} images in {:.1} s",
                missing.len(),
                start.elapsed().as_secs_f64()
            );
        }
        let texts: Vec<&str> = missing
            .iter()
            .map(|&i| dataset.items()[i].caption.as_str())
            .chain([""])
            .collect();
        let start = Instant::now();
        let heartbeat = Heartbeat::start(format!("encoding {} captions", texts.len()));
        let mut encoded = family.encode_captions::<B>(plan, &texts, device)?;
        drop(heartbeat);
        tracing::info!(
            "encoded {} captions in {:.1} s",
            texts.len(),
            start.elapsed().as_secs_f64()
        );
        empty = encoded.pop();
        for (&i, caption) in missing.iter().zip(encoded) {
            captions[i] = Some(caption);
        }
    }
    let empty = empty.expect("the empty caption is encoded or cached");
    for part in parts {
        if let Some(file) = part.file {
            write_part(&file, &part.items, &images, &captions, &empty)?;
            tracing::info!("wrote {}", file.display());
        }
    }
    Ok(Prepared {
        images: images.into_iter().map(|l| l.expect("encoded")).collect(),
        captions: captions.into_iter().map(|c| c.expect("encoded")).collect(),
        empty,
    })
}

/// The cache file of the dataset in `folder` whose items are `items`.
fn cache_file<F: Family>(
    family: &F,
    plan: &TrainPlan,
    dataset: &Dataset,
    folder: &Path,
    items: &[usize],
) -> Result<PathBuf, TrainError> {
    let mut key = format!(
        "burnlora cache v2\nmodel {} {:?} {:?} seed {}\n{}",
        plan.model.arch.name(),
        plan.model.source,
        plan.model.dtype,
        plan.train.seed,
        family.cache_key(plan)
    );
    if plan.model.vae_dtype != FloatDType::F32 {
        // Only when not the default, so that the caches made before the setting stay valid.
        key.push_str(&format!("vae {:?}\n", plan.model.vae_dtype));
    }
    if let ModelSource::Random(_) = plan.model.source {
        // Random encoders that stream are made from the run's seed in host memory, the others
        // by the device's generator: different weights, different encodings.
        let streams = crate::models::offload_config(plan).is_some();
        key.push_str(&format!("random encoders streamed {streams}\n"));
    }
    for &i in items {
        let item = &dataset.items()[i];
        let meta = std::fs::metadata(&item.image).map_err(|source| DatasetError::Io {
            path: item.image.clone(),
            source,
        })?;
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos());
        key.push_str(&format!(
            "{} {} {modified} {}x{} {:?}\n",
            item.image.display(),
            meta.len(),
            item.bucket.width,
            item.bucket.height,
            item.caption
        ));
        if item.clip.kind != SourceKind::Image {
            // Image keys stay as they were; a clip adds which frames it is.
            key.push_str(&format!(
                "clip {:?} of {} frames\n",
                item.clip, item.bucket.frames
            ));
        }
    }
    let name = format!("{:016x}.safetensors", fnv1a64(key.as_bytes()));
    Ok(folder.join(CACHE_FOLDER).join(name))
}

/// Reads a dataset's cache file of `n` items.
fn read_part(
    file: &Path,
    schema: &Schema,
    n: usize,
) -> Result<(Vec<Encoded>, Vec<Encoded>, Encoded), String> {
    let (tensors, _) = read_tensors(file).map_err(|e| e.to_string())?;
    let mut tensors: HashMap<String, TensorData> = tensors.into_iter().collect();
    let mut take = |names: &[&str], k: &str| -> Result<Encoded, String> {
        names
            .iter()
            .map(|name| {
                let key = format!("{name}.{k}");
                match tensors.remove(&key) {
                    Some(data) if finite(&data) => Ok((name.to_string(), data)),
                    Some(_) => Err(format!("non-finite values in `{key}`")),
                    None => Err(format!("no tensor `{key}`")),
                }
            })
            .collect()
    };
    let mut images = Vec::with_capacity(n);
    let mut captions = Vec::with_capacity(n);
    for k in 0..n {
        images.push(take(schema.image, &k.to_string())?);
        captions.push(take(schema.caption, &k.to_string())?);
    }
    let empty = take(schema.caption, "empty")?;
    Ok((images, captions, empty))
}

/// Writes a dataset's cache file.
fn write_part(
    file: &Path,
    items: &[usize],
    images: &[Option<Encoded>],
    captions: &[Option<Encoded>],
    empty: &Encoded,
) -> Result<(), TrainError> {
    let folder = file.parent().expect("cache files live in a folder");
    std::fs::create_dir_all(folder).map_err(|source| DatasetError::Io {
        path: folder.to_path_buf(),
        source,
    })?;
    let mut named: Vec<(String, &TensorData)> = Vec::new();
    for (k, &i) in items.iter().enumerate() {
        let image = images[i].as_ref().expect("encoded");
        let caption = captions[i].as_ref().expect("encoded");
        for (name, data) in image.iter().chain(caption) {
            named.push((format!("{name}.{k}"), data));
        }
    }
    for (name, data) in empty {
        named.push((format!("{name}.empty"), data));
    }
    let tensors: Vec<(&str, &TensorData)> = named.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    write_tensors(file, &tensors, HashMap::new())?;
    Ok(())
}
