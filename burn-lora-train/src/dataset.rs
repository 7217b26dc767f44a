//! Captioned images, aspect-ratio buckets, and the order in which samples are seen.
//!
//! - A dataset folder holds images (`png`, `jpg`, `jpeg`, `webp`, any case; not recursive) and
//!   same-stem caption files (`photo.png` + `photo.txt`). As in ai-toolkit, an image without a
//!   caption file trains with an empty caption; a warning names how many and which.
//! - Each image is trained at every resolution of its dataset: one [`Item`] per image and
//!   resolution, in the bucket whose aspect ratio is nearest to the image's ([`bucket_for`]).
//!   As in ai-toolkit, an image is never upscaled: one smaller than the resolution uses the
//!   buckets of its own size (rounded down to a multiple of 16).
//! - An epoch shows each item `repeats` times. Its order is a function of the seed and the epoch
//!   number alone, so a [`DataPosition`] (epoch, batch) is all that resuming needs. Batches hold
//!   items of one bucket; the last batch of a bucket in an epoch may be smaller.
//! - Scanning reads image headers only (size and EXIF orientation); [`Item::load_pixels`]
//!   decodes, resizes and crops through burn-diffusion's `load_image`, the same code the VAE
//!   parity fixtures check.

use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use burn_diffusion::pipeline::load_image;
use image::{ImageDecoder, ImageReader, metadata::Orientation};
use serde::{Deserialize, Serialize};

use crate::config::DatasetPlan;
use crate::rng::{Rng, derive, unit};

/// Extensions of image files (compared without case).
pub const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "webp"];

/// The most elongated bucket allowed (long side over short side).
pub const MAX_ASPECT: f64 = 4.0;

/// Tags that separate the random streams derived from the seed.
const SHUFFLE_TAG: u64 = 0x5348_5546;
const DROPOUT_TAG: u64 = 0x4452_4f50;

/// A problem with the training images.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// A folder or caption file could not be read.
    #[error("reading {path}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// An image header could not be read.
    #[error("reading the header of image {path}")]
    Image {
        /// The image file.
        path: PathBuf,
        /// The cause.
        source: image::ImageError,
    },
    /// An image could not be loaded (the error names the file).
    #[error(transparent)]
    Load(burn_diffusion::LoadError),
    /// A dataset folder holds no image.
    #[error("{folder} holds no image (expected files ending in .png, .jpg, .jpeg or .webp)")]
    Empty {
        /// The folder.
        folder: PathBuf,
    },
    /// An image is smaller than the smallest bucket (16 × 16 pixels).
    #[error("{path} is {width}x{height}, smaller than the smallest bucket (16x16)")]
    TooSmall {
        /// The image file.
        path: PathBuf,
        /// Its width.
        width: u32,
        /// Its height.
        height: u32,
    },
}

/// A training size: width and height in pixels, multiples of 16.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Bucket {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
}

/// The buckets of `resolution` (a multiple of 16): widths `resolution + k·step`, each with the
/// tallest height (a multiple of 16) that keeps the area at most `resolution²`, and aspect
/// ratios up to 4:1 either way. The step is 64 pixels (kohya's `bucket_reso_steps`) from
/// resolution 512 up, `resolution / 8` rounded down to a multiple of 16 below (at least 16).
/// The square `resolution × resolution` is always included.
pub fn buckets(resolution: usize) -> Vec<Bucket> {
    assert!(
        resolution >= 16 && resolution.is_multiple_of(16),
        "resolution {resolution} is not a positive multiple of 16"
    );
    let area = resolution * resolution;
    let step = (resolution / 8 / 16 * 16).clamp(16, 64);
    let mut out = Vec::new();
    let mut width = resolution % step;
    if width == 0 {
        width = step;
    }
    while width <= area / 16 {
        let height = area / width / 16 * 16;
        let aspect = width.max(height) as f64 / width.min(height).max(1) as f64;
        if height >= 16 && aspect <= MAX_ASPECT {
            out.push(Bucket { width, height });
        }
        width += step;
    }
    out
}

/// The bucket for an image of `width × height` pixels trained at `resolution`: among the
/// buckets of `min(resolution, the image's own resolution)`, the one whose aspect ratio is
/// nearest (in log scale; ties go to the larger area). `None` when the image is smaller than
/// 16 × 16 in area.
pub fn bucket_for(width: u32, height: u32, resolution: usize) -> Option<Bucket> {
    let own = ((f64::from(width) * f64::from(height)).sqrt() as usize) / 16 * 16;
    let resolution = resolution.min(own);
    if resolution < 16 {
        return None;
    }
    let target = (f64::from(width) / f64::from(height)).ln();
    buckets(resolution).into_iter().min_by(|a, b| {
        let distance = |b: &Bucket| ((b.width as f64 / b.height as f64).ln() - target).abs();
        distance(a)
            .total_cmp(&distance(b))
            .then((b.width * b.height).cmp(&(a.width * a.height)))
    })
}

/// One image at one resolution.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// The image file.
    pub image: PathBuf,
    /// The caption (empty when the image has no caption file).
    pub caption: String,
    /// The image's width and height after EXIF orientation, before resizing.
    pub size: (u32, u32),
    /// The size it is trained at.
    pub bucket: Bucket,
    /// Index of its dataset in the configuration.
    pub dataset: usize,
}

impl Item {
    /// The image as VAE input: oriented by its EXIF tag, resized to cover the bucket,
    /// center-cropped to it, RGB in [-1, 1], shape `[3, height, width]`
    /// ([`burn_diffusion::pipeline::load_image`]).
    pub fn load_pixels(&self) -> Result<TensorData, DatasetError> {
        load_image(&self.image, self.bucket.width, self.bucket.height).map_err(DatasetError::Load)
    }
}

/// Width and height after EXIF orientation, read from the header only.
fn oriented_size(path: &Path) -> Result<(u32, u32), DatasetError> {
    let image_error = |source| DatasetError::Image {
        path: path.to_path_buf(),
        source,
    };
    let io_error = |source| DatasetError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut decoder = ImageReader::open(path)
        .map_err(io_error)?
        .with_guessed_format()
        .map_err(io_error)?
        .into_decoder()
        .map_err(image_error)?;
    let (w, h) = decoder.dimensions();
    let swapped = matches!(
        decoder.orientation().map_err(image_error)?,
        Orientation::Rotate90
            | Orientation::Rotate270
            | Orientation::Rotate90FlipH
            | Orientation::Rotate270FlipH
    );
    Ok(if swapped { (h, w) } else { (w, h) })
}

/// Every item of the configured datasets, with their repeats and caption dropout.
#[derive(Clone, Debug)]
pub struct Dataset {
    items: Vec<Item>,
    /// `repeats` and `caption_dropout` of each configured dataset.
    settings: Vec<(usize, f64)>,
}

/// One sample of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Index into [`Dataset::items`].
    pub item: usize,
    /// Train this sample with the empty caption (caption dropout).
    pub drop_caption: bool,
}

/// Samples of one bucket, trained together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// The size of every sample.
    pub bucket: Bucket,
    /// The samples (at most the batch size).
    pub samples: Vec<Sample>,
}

/// Where the data stream stands: the next batch is batch `batch` of epoch `epoch`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// Epoch, from 0.
    pub epoch: u64,
    /// Batch within the epoch, from 0.
    pub batch: usize,
}

impl Dataset {
    /// Lists the images and captions of every dataset and assigns their buckets. Reads image
    /// headers only.
    pub fn scan(plans: &[DatasetPlan]) -> Result<Self, DatasetError> {
        let mut items = Vec::new();
        for (index, plan) in plans.iter().enumerate() {
            let images = list_images(&plan.folder)?;
            let mut uncaptioned = Vec::new();
            for image in images {
                let caption_path = image.with_extension(&plan.caption_ext);
                let caption = match std::fs::read_to_string(&caption_path) {
                    Ok(text) => text.trim().to_string(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        uncaptioned.push(image.clone());
                        String::new()
                    }
                    Err(source) => {
                        return Err(DatasetError::Io {
                            path: caption_path,
                            source,
                        });
                    }
                };
                let (width, height) = oriented_size(&image)?;
                for &resolution in &plan.resolutions {
                    let bucket = bucket_for(width, height, resolution).ok_or_else(|| {
                        DatasetError::TooSmall {
                            path: image.clone(),
                            width,
                            height,
                        }
                    })?;
                    items.push(Item {
                        image: image.clone(),
                        caption: caption.clone(),
                        size: (width, height),
                        bucket,
                        dataset: index,
                    });
                }
            }
            if let Some(first) = uncaptioned.first() {
                tracing::warn!(
                    "{} of the images in {} have no .{} caption file and train with an empty \
                     caption (first: {})",
                    uncaptioned.len(),
                    plan.folder.display(),
                    plan.caption_ext,
                    first.display()
                );
            }
        }
        Ok(Self {
            items,
            settings: plans
                .iter()
                .map(|p| (p.repeats, p.caption_dropout))
                .collect(),
        })
    }

    /// Every item, in folder order (datasets in configuration order, files sorted by name,
    /// resolutions in configuration order).
    pub fn items(&self) -> &[Item] {
        &self.items
    }

    /// Samples per epoch (items times their repeats).
    pub fn epoch_len(&self) -> usize {
        self.items
            .iter()
            .map(|item| self.settings[item.dataset].0)
            .sum()
    }

    /// The batches of `epoch` for `seed`: every item `repeats` times, shuffled, grouped by
    /// bucket in order of appearance; a bucket's remainder forms a smaller batch at the end.
    /// Caption dropout is drawn per sample from the seed, epoch and position.
    pub fn epoch(&self, seed: u64, epoch: u64, batch_size: usize) -> Vec<Batch> {
        assert!(batch_size > 0, "batch size 0");
        let mut order: Vec<usize> = self
            .items
            .iter()
            .enumerate()
            .flat_map(|(i, item)| std::iter::repeat_n(i, self.settings[item.dataset].0))
            .collect();
        Rng::seeded(derive(seed, &[SHUFFLE_TAG, epoch])).shuffle(&mut order);

        let mut open: Vec<(Bucket, Vec<usize>)> = Vec::new();
        let mut grouped: Vec<(Bucket, Vec<usize>)> = Vec::new();
        for i in order {
            let bucket = self.items[i].bucket;
            let slot = match open.iter().position(|(b, _)| *b == bucket) {
                Some(slot) => slot,
                None => {
                    open.push((bucket, Vec::new()));
                    open.len() - 1
                }
            };
            open[slot].1.push(i);
            if open[slot].1.len() == batch_size {
                grouped.push((bucket, std::mem::take(&mut open[slot].1)));
            }
        }
        grouped.extend(open.into_iter().filter(|(_, items)| !items.is_empty()));

        grouped
            .into_iter()
            .enumerate()
            .map(|(b, (bucket, items))| Batch {
                bucket,
                samples: items
                    .into_iter()
                    .enumerate()
                    .map(|(s, item)| {
                        let rate = self.settings[self.items[item].dataset].1;
                        let draw = derive(seed, &[DROPOUT_TAG, epoch, b as u64, s as u64]);
                        Sample {
                            item,
                            drop_caption: unit(draw) < rate,
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    /// An endless stream of batches starting at `position`.
    pub fn batches(&self, seed: u64, batch_size: usize, position: DataPosition) -> Batches<'_> {
        Batches {
            dataset: self,
            seed,
            batch_size,
            position,
            plan: self.epoch(seed, position.epoch, batch_size),
        }
    }
}

/// An endless stream of batches, epoch after epoch; see [`Dataset::batches`].
#[derive(Clone, Debug)]
pub struct Batches<'a> {
    dataset: &'a Dataset,
    seed: u64,
    batch_size: usize,
    position: DataPosition,
    plan: Vec<Batch>,
}

impl Batches<'_> {
    /// The position of the next batch (save it in the training state).
    pub fn position(&self) -> DataPosition {
        self.position
    }
}

impl Iterator for Batches<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        if self.plan.is_empty() {
            return None;
        }
        while self.position.batch >= self.plan.len() {
            self.position = DataPosition {
                epoch: self.position.epoch + 1,
                batch: 0,
            };
            self.plan = self
                .dataset
                .epoch(self.seed, self.position.epoch, self.batch_size);
        }
        let batch = self.plan[self.position.batch].clone();
        self.position.batch += 1;
        Some(batch)
    }
}

/// The image files of `folder`, sorted by name.
fn list_images(folder: &Path) -> Result<Vec<PathBuf>, DatasetError> {
    let io_error = |source| DatasetError::Io {
        path: folder.to_path_buf(),
        source,
    };
    let mut images = Vec::new();
    for entry in std::fs::read_dir(folder).map_err(io_error)? {
        let path = entry.map_err(io_error)?.path();
        let is_image = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| x.eq_ignore_ascii_case(e)));
        if is_image && path.is_file() {
            images.push(path);
        }
    }
    if images.is_empty() {
        return Err(DatasetError::Empty {
            folder: folder.to_path_buf(),
        });
    }
    images.sort();
    Ok(images)
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{Rgb, RgbImage};

    fn plan(folder: &Path, resolutions: Vec<usize>, repeats: usize, dropout: f64) -> DatasetPlan {
        DatasetPlan {
            folder: folder.to_path_buf(),
            caption_ext: "txt".into(),
            resolutions,
            repeats,
            caption_dropout: dropout,
            cache_to_disk: false,
        }
    }

    fn save_png(path: &Path, width: u32, height: u32, f: impl Fn(u32, u32) -> [u8; 3]) {
        RgbImage::from_fn(width, height, |x, y| Rgb(f(x, y)))
            .save(path)
            .unwrap();
    }

    #[test]
    fn buckets_have_equal_area_sides_of_16_and_bounded_aspect() {
        for resolution in [256, 512, 528, 1024] {
            let list = buckets(resolution);
            let area = resolution * resolution;
            assert!(list.contains(&Bucket {
                width: resolution,
                height: resolution
            }));
            for b in &list {
                assert!(b.width % 16 == 0 && b.height % 16 == 0, "{b:?}");
                assert!(b.width * b.height <= area, "{b:?}");
                // Within one row of 16 pixels of the target area.
                assert!(b.width * b.height > area - 16 * b.width, "{b:?}");
                let aspect = b.width.max(b.height) as f64 / b.width.min(b.height) as f64;
                assert!(aspect <= MAX_ASPECT, "{b:?}");
            }
        }
    }

    #[test]
    fn a_16_by_9_image_goes_to_the_nearest_aspect_bucket() {
        // At 512 the widths near 16:9 (1.778) are 640x400 (1.6), 704x368 (1.913) and 768x336
        // (2.286); in log scale 1.913 is the nearest (0.073 against 0.105 for 1.6).
        assert_eq!(
            bucket_for(1920, 1080, 512),
            Some(Bucket {
                width: 704,
                height: 368
            })
        );
        assert_eq!(
            bucket_for(1080, 1920, 512).map(|b| b.width < b.height),
            Some(true)
        );
        assert_eq!(
            bucket_for(1000, 1000, 512),
            Some(Bucket {
                width: 512,
                height: 512
            })
        );
    }

    #[test]
    fn small_images_are_not_upscaled() {
        // 300x300 has its own resolution 288 (300 rounded down to a multiple of 16).
        assert_eq!(
            bucket_for(300, 300, 1024),
            Some(Bucket {
                width: 288,
                height: 288
            })
        );
        assert_eq!(bucket_for(10, 10, 512), None);
    }

    #[test]
    fn scan_reads_captions_and_makes_one_item_per_resolution() {
        let dir = tempfile::tempdir().unwrap();
        save_png(&dir.path().join("b.png"), 64, 32, |_, _| [0, 0, 0]);
        save_png(&dir.path().join("a.PNG"), 32, 32, |_, _| [0, 0, 0]);
        std::fs::write(dir.path().join("a.txt"), "  a red cube \n").unwrap();
        std::fs::write(dir.path().join("notes.md"), "not an image").unwrap();
        let dataset = Dataset::scan(&[plan(dir.path(), vec![32, 16], 1, 0.0)]).unwrap();
        let summary: Vec<(String, &str, Bucket)> = dataset
            .items()
            .iter()
            .map(|i| {
                let name = i.image.file_name().unwrap().to_string_lossy().into_owned();
                (name, i.caption.as_str(), i.bucket)
            })
            .collect();
        let b = |width, height| Bucket { width, height };
        let pixels = dataset.items()[2].load_pixels().unwrap();
        assert_eq!(pixels.shape.to_vec(), vec![3, 16, 48]);
        assert!(pixels.to_vec::<f32>().unwrap().iter().all(|&v| v == -1.0));
        assert_eq!(
            summary,
            vec![
                ("a.PNG".into(), "a red cube", b(32, 32)),
                ("a.PNG".into(), "a red cube", b(16, 16)),
                ("b.png".into(), "", b(48, 16)),
                ("b.png".into(), "", b(16, 16)),
            ]
        );
    }

    #[test]
    fn an_empty_folder_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err = Dataset::scan(&[plan(dir.path(), vec![512], 1, 0.0)]).unwrap_err();
        assert!(err.to_string().contains(&dir.path().display().to_string()));
    }

    fn dataset_of(n: usize, repeats: usize, dropout: f64) -> Dataset {
        let bucket = |i: usize| Bucket {
            width: 16 * (1 + i % 2),
            height: 16,
        };
        Dataset {
            items: (0..n)
                .map(|i| Item {
                    image: format!("{i}.png").into(),
                    caption: String::new(),
                    size: (16, 16),
                    bucket: bucket(i),
                    dataset: 0,
                })
                .collect(),
            settings: vec![(repeats, dropout)],
        }
    }

    #[test]
    fn an_epoch_holds_every_item_repeats_times_in_single_bucket_batches() {
        let dataset = dataset_of(7, 3, 0.0);
        let epoch = dataset.epoch(1, 0, 4);
        let mut seen = vec![0; 7];
        for batch in &epoch {
            assert!(!batch.samples.is_empty() && batch.samples.len() <= 4);
            for s in &batch.samples {
                seen[s.item] += 1;
                assert_eq!(dataset.items()[s.item].bucket, batch.bucket);
            }
        }
        assert_eq!(seen, vec![3; 7]);
        assert_eq!(dataset.epoch_len(), 21);
        // Deterministic for a seed and epoch, different across epochs.
        assert_eq!(dataset.epoch(1, 0, 4), epoch);
        assert_ne!(dataset.epoch(1, 1, 4), epoch);
        assert_ne!(dataset.epoch(2, 0, 4), epoch);
    }

    #[test]
    fn caption_dropout_follows_its_rate() {
        let dataset = dataset_of(10, 100, 0.25);
        let samples: Vec<Sample> = dataset
            .epoch(3, 0, 2)
            .into_iter()
            .flat_map(|b| b.samples)
            .collect();
        let dropped = samples.iter().filter(|s| s.drop_caption).count() as f64;
        let n = samples.len() as f64;
        // Binomial(1000, 0.25): standard deviation 13.7.
        assert!((dropped - 0.25 * n).abs() < 55.0, "{dropped} of {n}");
        let none = dataset_of(10, 10, 0.0).epoch(3, 0, 2);
        assert!(
            none.iter()
                .flat_map(|b| &b.samples)
                .all(|s| !s.drop_caption)
        );
    }

    #[test]
    fn the_stream_resumes_from_a_saved_position() {
        let dataset = dataset_of(5, 2, 0.5);
        let straight: Vec<Batch> = dataset
            .batches(9, 3, DataPosition::default())
            .take(20)
            .collect();
        let mut first = dataset.batches(9, 3, DataPosition::default());
        let mut resumed: Vec<Batch> = first.by_ref().take(8).collect();
        let position = first.position();
        resumed.extend(dataset.batches(9, 3, position).take(12));
        assert_eq!(straight, resumed);
        assert!(position.epoch >= 1, "20 batches span several epochs");
    }
}
