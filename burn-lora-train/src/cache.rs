//! Latents and caption embeddings, computed once before training and, for datasets with
//! `cache_latents_to_disk`, kept beside the images for the next run.
//!
//! A dataset's cache is one safetensors file, `<folder>/_burnlora_cache/<hash>.safetensors`,
//! with `latent.<k>`, `pooled.<k>` and `states.<k>` for its k-th item (the VAE latent,
//! normalized, `[channels, h, w]`; CLIP's pooled vector; T5's hidden states) and
//! `pooled.empty` / `states.empty` for the empty caption. The hash covers everything the
//! values depend on: the model (source, dtype, seed of a random one), the caption lengths, and
//! each item's image file (name, size, modification time), bucket and caption. A file whose
//! hash differs is simply not looked at: a changed setting gets a new file; a file that fails
//! to read, or holds a non-finite value, is rebuilt with a warning. Files are written
//! atomically. An encoder that turns an image or a caption into non-finite values stops the
//! run with an error naming both, before anything is cached or trained.
//!
//! The VAE is loaded only when some dataset has no valid cache, encodes what is missing and is
//! dropped; then the text encoders, likewise; the transformer is loaded after both.

use burn_kernels::Kernels;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Instant, UNIX_EPOCH};

use burn::tensor::{DType, Tensor, TensorData};
use burn_diffusion::pipeline::{encode_clip_pooled, encode_t5};
use burn_offload::{Offload, StreamTarget, WeightStream};

use crate::checkpoint::{read_tensors, write_tensors};
use crate::config::{TrainPlan, fnv1a64};
use crate::dataset::{Dataset, DatasetError};
use crate::models;
use crate::train::TrainError;

/// Name of the cache folder inside a dataset folder.
pub const CACHE_FOLDER: &str = "_burnlora_cache";

/// Images encoded by the VAE per batch (of one bucket).
const VAE_BATCH: usize = 4;
/// Captions encoded per batch.
const TEXT_BATCH: usize = 8;

/// A caption's encodings: pooled CLIP vector `[vec_in_dim]`, T5 states `[tokens, context]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Caption {
    /// CLIP's pooled output.
    pub pooled: TensorData,
    /// T5's last hidden state.
    pub states: TensorData,
}

/// What training reads instead of images and captions.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// Normalized latent of each item of the dataset, `[channels, h, w]`.
    pub latents: Vec<TensorData>,
    /// Encodings of each item's caption.
    pub captions: Vec<Caption>,
    /// Encodings of the empty caption (caption dropout).
    pub empty: Caption,
}

/// One dataset's share of the items and its cache file.
struct Part {
    items: Vec<usize>,
    file: Option<PathBuf>,
}

/// Latents and caption encodings of every item of `dataset`, from the caches where valid,
/// else computed on `device` (and cached when the dataset asks for it).
pub fn prepare<B: StreamTarget>(
    plan: &TrainPlan,
    dataset: &Dataset,
    device: &B::Device,
) -> Result<Prepared, TrainError> {
    let n = dataset.items().len();
    let mut latents: Vec<Option<TensorData>> = vec![None; n];
    let mut captions: Vec<Option<Caption>> = vec![None; n];
    let mut empty = None;
    let mut parts = Vec::new();
    for (index, settings) in plan.datasets.iter().enumerate() {
        let items: Vec<usize> = (0..n)
            .filter(|&i| dataset.items()[i].dataset == index)
            .collect();
        let file = settings
            .cache_to_disk
            .then(|| cache_file(plan, dataset, &settings.folder, &items))
            .transpose()?;
        if let Some(file) = file.as_deref().filter(|f| f.is_file()) {
            match read_part(file, items.len()) {
                Ok((part_latents, part_captions, part_empty)) => {
                    tracing::info!("{}: cached latents and captions", file.display());
                    for ((&i, latent), caption) in items.iter().zip(part_latents).zip(part_captions)
                    {
                        latents[i] = Some(latent);
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
        encode_latents::<B>(plan, dataset, &missing, &mut latents, device)?;
        let texts: Vec<&str> = missing
            .iter()
            .map(|&i| dataset.items()[i].caption.as_str())
            .chain([""])
            .collect();
        let mut encoded = encode_captions::<B>(plan, &texts, device)?;
        empty = encoded.pop();
        for (&i, caption) in missing.iter().zip(encoded) {
            captions[i] = Some(caption);
        }
    }
    let empty = empty.expect("the empty caption is encoded or cached");
    for part in parts {
        if let Some(file) = part.file {
            write_part(&file, &part.items, &latents, &captions, &empty)?;
            tracing::info!("wrote {}", file.display());
        }
    }
    Ok(Prepared {
        latents: latents.into_iter().map(|l| l.expect("encoded")).collect(),
        captions: captions.into_iter().map(|c| c.expect("encoded")).collect(),
        empty,
    })
}

/// The cache file of the dataset in `folder` whose items are `items`.
fn cache_file(
    plan: &TrainPlan,
    dataset: &Dataset,
    folder: &Path,
    items: &[usize],
) -> Result<PathBuf, TrainError> {
    let mut key = format!(
        "burnlora cache v1\nmodel {:?} {:?} seed {}\ntokenizers {}\n",
        plan.model.source,
        plan.model.dtype,
        plan.train.seed,
        plan.model.tokenizers.display()
    );
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
    }
    let name = format!("{:016x}.safetensors", fnv1a64(key.as_bytes()));
    Ok(folder.join(CACHE_FOLDER).join(name))
}

/// Encodes the images of `items` with the VAE (loaded here and dropped before returning).
fn encode_latents<B: Kernels>(
    plan: &TrainPlan,
    dataset: &Dataset,
    items: &[usize],
    latents: &mut [Option<TensorData>],
    device: &B::Device,
) -> Result<(), TrainError> {
    if items.is_empty() {
        return Ok(());
    }
    let start = Instant::now();
    let vae = models::vae::<B>(plan, device)?;
    let mut by_bucket: HashMap<_, Vec<usize>> = HashMap::new();
    for &i in items {
        by_bucket
            .entry(dataset.items()[i].bucket)
            .or_default()
            .push(i);
    }
    let mut buckets: Vec<_> = by_bucket.into_iter().collect();
    buckets.sort_by_key(|(b, _)| (b.width, b.height));
    for (_, members) in buckets {
        for chunk in members.chunks(VAE_BATCH) {
            let pixels = chunk
                .iter()
                .map(|&i| {
                    let data = dataset.items()[i].load_pixels()?;
                    Ok(Tensor::<B, 3>::from_data(data, device))
                })
                .collect::<Result<Vec<_>, DatasetError>>()?;
            // The VAE runs in f32 (`models::vae`); the latents are kept in the model's dtype.
            let images = Tensor::stack(pixels, 0).cast(DType::F32);
            let encoded = vae
                .normalize_latents(vae.encode(images).mode())
                .cast(plan.model.dtype);
            for (&i, latent) in chunk.iter().zip(encoded.iter_dim(0)) {
                let latent = latent.squeeze_dim::<3>(0).into_data();
                if !finite(&latent) {
                    return Err(TrainError::NonFiniteEncoding {
                        encoder: "the VAE",
                        input: dataset.items()[i].image.display().to_string(),
                    });
                }
                latents[i] = Some(latent);
            }
        }
    }
    drop(vae);
    B::memory_cleanup(device);
    tracing::info!(
        "encoded {} images in {:.1} s",
        items.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Encodes `texts` with CLIP and T5 (loaded here and dropped before returning). When the
/// transformer streams its weights, T5 streams too, within the same budget.
fn encode_captions<B: StreamTarget>(
    plan: &TrainPlan,
    texts: &[&str],
    device: &B::Device,
) -> Result<Vec<Caption>, TrainError> {
    let start = Instant::now();
    let stream = models::offload_config(plan)
        .map(|config| WeightStream::<Offload<B>>::new(device, config))
        .transpose()?;
    let encoders = models::text_encoders::<B>(plan, device, stream.as_ref())?;
    let pooled = encode_clip_pooled(&encoders.clip_tokenizer, encoders.clip, texts, TEXT_BATCH)?;
    if let Some(stream) = &stream {
        stream.begin_step();
    }
    let states = encode_t5(&encoders.t5_tokenizer, encoders.t5, texts, TEXT_BATCH)?;
    if let Some(stream) = &stream {
        let stats = stream.end_step();
        tracing::info!(
            "T5 streamed {:.2} GB from host memory",
            stats.bytes_uploaded as f64 / 1e9
        );
    }
    tracing::info!(
        "encoded {} captions in {:.1} s",
        texts.len(),
        start.elapsed().as_secs_f64()
    );
    pooled
        .into_iter()
        .zip(states)
        .zip(texts)
        .map(|((pooled, states), text)| {
            let caption = || match text.chars().count() {
                0 => "the empty caption".to_string(),
                1..=60 => format!("the caption \"{text}\""),
                _ => format!(
                    "the caption \"{}…\"",
                    text.chars().take(60).collect::<String>()
                ),
            };
            for (encoder, data) in [("CLIP", &pooled), ("T5", &states)] {
                if !finite(data) {
                    return Err(TrainError::NonFiniteEncoding {
                        encoder,
                        input: caption(),
                    });
                }
            }
            Ok(Caption { pooled, states })
        })
        .collect()
}

/// Whether every value of `data` is finite.
fn finite(data: &TensorData) -> bool {
    data.iter::<f32>().all(f32::is_finite)
}

/// Reads a dataset's cache file of `n` items.
fn read_part(file: &Path, n: usize) -> Result<(Vec<TensorData>, Vec<Caption>, Caption), String> {
    let (tensors, _) = read_tensors(file).map_err(|e| e.to_string())?;
    let mut tensors: HashMap<String, TensorData> = tensors.into_iter().collect();
    let mut take = |key: String| match tensors.remove(&key) {
        Some(data) if finite(&data) => Ok(data),
        Some(_) => Err(format!("non-finite values in `{key}`")),
        None => Err(format!("no tensor `{key}`")),
    };
    let mut latents = Vec::with_capacity(n);
    let mut captions = Vec::with_capacity(n);
    for k in 0..n {
        latents.push(take(format!("latent.{k}"))?);
        captions.push(Caption {
            pooled: take(format!("pooled.{k}"))?,
            states: take(format!("states.{k}"))?,
        });
    }
    let empty = Caption {
        pooled: take("pooled.empty".into())?,
        states: take("states.empty".into())?,
    };
    Ok((latents, captions, empty))
}

/// Writes a dataset's cache file.
fn write_part(
    file: &Path,
    items: &[usize],
    latents: &[Option<TensorData>],
    captions: &[Option<Caption>],
    empty: &Caption,
) -> Result<(), TrainError> {
    let folder = file.parent().expect("cache files live in a folder");
    std::fs::create_dir_all(folder).map_err(|source| DatasetError::Io {
        path: folder.to_path_buf(),
        source,
    })?;
    let mut named: Vec<(String, &TensorData)> = Vec::with_capacity(3 * items.len() + 2);
    for (k, &i) in items.iter().enumerate() {
        let caption = captions[i].as_ref().expect("encoded");
        named.push((format!("latent.{k}"), latents[i].as_ref().expect("encoded")));
        named.push((format!("pooled.{k}"), &caption.pooled));
        named.push((format!("states.{k}"), &caption.states));
    }
    named.push(("pooled.empty".into(), &empty.pooled));
    named.push(("states.empty".into(), &empty.states));
    let tensors: Vec<(&str, &TensorData)> = named.iter().map(|(n, d)| (n.as_str(), *d)).collect();
    write_tensors(file, &tensors, HashMap::new())?;
    Ok(())
}
