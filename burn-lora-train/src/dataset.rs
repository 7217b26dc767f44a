//! Captioned images and video clips, aspect-ratio buckets, and the order in which samples are
//! seen.
//!
//! - A dataset folder holds sources, each with a same-stem caption file (`photo.png` +
//!   `photo.txt`): images (`png`, `jpg`, `jpeg`, `webp`, any case), videos (`mp4`, `webm`,
//!   `mov`, `mkv`, any case) and frame folders (a sub-folder of images, one clip, its frames in
//!   the order of the last number in their names; its caption is `<folder>.txt` beside it).
//!   Nothing deeper is read. As in ai-toolkit, a source without a caption file trains with an
//!   empty caption; a warning names how many and which.
//! - Each source is trained at every resolution and frame count of its dataset: one [`Item`]
//!   per source, resolution, frame count and clip start ([`FrameExtraction`]), in the bucket
//!   whose aspect ratio is nearest to the source's ([`bucket_for`]) with that frame count. As in
//!   ai-toolkit, a source is never upscaled: one smaller than the resolution uses the buckets of
//!   its own size (rounded down to a multiple of 16). As in musubi-tuner, a source shorter
//!   than a frame count gives no clip of that count (a warning names it); an image is one
//!   frame, so it trains only when the frame counts include 1.
//! - An epoch shows each item `repeats` times. Its order is a function of the seed and the epoch
//!   number alone, so a [`DataPosition`] (epoch, batch) is all that resuming needs. Batches hold
//!   items of one bucket (width, height and frames); the last batch of a bucket in an epoch may
//!   be smaller.
//! - Scanning reads image headers (size and EXIF orientation) and, through FFmpeg's `ffprobe`,
//!   video headers; a video that `ffprobe` cannot read is reported and left out.
//!   [`Item::load_pixels`] and [`Item::load_clip`] decode (videos through the `ffmpeg`
//!   program), resize and crop every frame through burn-diffusion's `fit_image`, the code that
//!   `load_image` uses and the VAE parity fixtures check.

use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use burn_diffusion::pipeline::{fit_image, load_image};
use image::{ImageDecoder, ImageReader, metadata::Orientation};
use serde::{Deserialize, Serialize};

use crate::config::DatasetPlan;
use crate::rng::{Rng, derive, unit};
use crate::video;

/// Extensions of image files (compared without case).
pub const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "webp"];

/// Extensions of video files (compared without case).
pub const VIDEO_EXTENSIONS: &[&str] = &["mp4", "webm", "mov", "mkv"];

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
    /// A dataset folder holds no readable image, video or frame folder.
    #[error(
        "{folder} holds no readable image, video or frame folder (expected files ending in \
         .png, .jpg, .jpeg, .webp, .mp4, .webm, .mov or .mkv, or folders of images)"
    )]
    Empty {
        /// The folder.
        folder: PathBuf,
    },
    /// No source of a dataset folder is as long as any of the frame counts asked.
    #[error("{folder}: no image, video or frame folder has {frames:?} frames (`frames`)")]
    NoClip {
        /// The folder.
        folder: PathBuf,
        /// The frame counts asked.
        frames: Vec<usize>,
    },
    /// An FFmpeg program is not installed.
    #[error("reading {path} needs the `{program}` program: install FFmpeg (`apt install ffmpeg`)")]
    NoFfmpeg {
        /// `ffmpeg` or `ffprobe`.
        program: &'static str,
        /// The video.
        path: PathBuf,
    },
    /// FFmpeg cannot read a video.
    #[error("FFmpeg cannot read {path}: {message}")]
    Ffmpeg {
        /// The video.
        path: PathBuf,
        /// FFmpeg's last message.
        message: String,
    },
    /// A video or frame folder holds fewer frames than its clip needs (it changed since the
    /// scan).
    #[error("{path} gives {found} frames from the clip's start, fewer than its {frames}")]
    ShortClip {
        /// The video or frame folder.
        path: PathBuf,
        /// The frames it gives.
        found: usize,
        /// The frames of the clip.
        frames: usize,
    },
    /// [`Item::load_pixels`] was asked for a clip of several frames.
    #[error("{path}: a clip of {frames} frames is not an image")]
    NotAnImage {
        /// The video or frame folder.
        path: PathBuf,
        /// The frames of the clip.
        frames: usize,
    },
    /// An image is smaller than the smallest bucket.
    #[error("{path} is {width}x{height}, smaller than the smallest bucket ({side}x{side})")]
    TooSmall {
        /// The image file.
        path: PathBuf,
        /// Its width.
        width: u32,
        /// Its height.
        height: u32,
        /// The side of the smallest bucket, in pixels.
        side: usize,
    },
}

/// A training size: width and height in pixels, multiples of 16, and frames (1 for an image).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Bucket {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Frames (4k + 1; 1 for an image; 1 when absent from serialized data).
    #[serde(default = "one_frame")]
    pub frames: usize,
}

fn one_frame() -> usize {
    1
}

/// Where the clips of a source longer than the frame count start (musubi-tuner's
/// `frame_extraction`, with `frame_sample` as [`Uniform::samples`](FrameExtraction::Uniform)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameExtraction {
    /// One clip per frame count: the first frames.
    Head,
    /// `samples` clips per frame count, their starts spread evenly from the first frame to the
    /// last start that leaves room for the clip.
    Uniform {
        /// Clips per source and frame count (at least 1).
        samples: usize,
    },
}

impl FrameExtraction {
    /// The start frames of the clips of `frames` frames in a source of `length` frames (at
    /// least `frames`): `[0]` for `Head` and for one sample, else `⌊k · (length − frames) /
    /// (samples − 1)⌋` for k = 0 … samples − 1 (musubi-tuner's `np.linspace(0, length −
    /// frames, samples, dtype=int)`), repeated starts dropped.
    pub fn starts(self, length: usize, frames: usize) -> Vec<usize> {
        let room = length - frames;
        let mut starts: Vec<usize> = match self {
            Self::Uniform { samples } if samples > 1 => {
                (0..samples).map(|k| k * room / (samples - 1)).collect()
            }
            _ => vec![0],
        };
        starts.dedup();
        starts
    }
}

/// What an item's frames come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceKind {
    /// An image file: one frame.
    Image,
    /// A video file, decoded by FFmpeg.
    Video,
    /// A folder of images, one per frame.
    FrameFolder,
}

/// Which frames of its source an item is; the frame count is its bucket's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Clip {
    /// The kind of source.
    pub kind: SourceKind,
    /// Index of the first frame (0 for an image), counted at `fps` when set.
    pub start: usize,
    /// Frames per second the video is resampled to before cutting; `None` for its own rate,
    /// and always for images and frame folders.
    pub fps: Option<f64>,
}

/// The side of a bucket is a multiple of this many pixels, unless the model asks for more
/// (`Family::pixel_multiple`).
pub const PIXEL_MULTIPLE: usize = 16;

/// The buckets of `resolution` (rounded down to a multiple of `multiple`, a multiple of 16):
/// widths `resolution + k·step`, each with the tallest height (a multiple of `multiple`) that
/// keeps the area at most `resolution²`, and aspect ratios up to 4:1 either way. The step is 64
/// pixels (kohya's `bucket_reso_steps`) from resolution 512 up, `resolution / 8` rounded down to
/// a multiple of `multiple` below (at least `multiple`), and never less than `multiple`. The
/// square `resolution × resolution` is always included.
pub fn buckets(resolution: usize, multiple: usize) -> Vec<Bucket> {
    assert!(
        multiple.is_multiple_of(PIXEL_MULTIPLE) && resolution >= multiple,
        "resolution {resolution} in multiples of {multiple}"
    );
    let resolution = resolution / multiple * multiple;
    let area = resolution * resolution;
    let step = (resolution / 8 / multiple * multiple).clamp(multiple, 64.max(multiple));
    let mut out = Vec::new();
    let mut width = resolution % step;
    if width == 0 {
        width = step;
    }
    while width <= area / multiple {
        let height = area / width / multiple * multiple;
        let aspect = width.max(height) as f64 / width.min(height).max(1) as f64;
        if height >= multiple && aspect <= MAX_ASPECT {
            out.push(Bucket {
                width,
                height,
                frames: 1,
            });
        }
        width += step;
    }
    out
}

/// The 1-frame bucket for an image of `width × height` pixels trained at `resolution`, with
/// sides in multiples of `multiple`: among the buckets of `min(resolution, the image's own
/// resolution)`, the one whose aspect ratio is nearest (in log scale; ties go to the larger
/// area). `None` when the image is smaller than `multiple × multiple` in area.
pub fn bucket_for(width: u32, height: u32, resolution: usize, multiple: usize) -> Option<Bucket> {
    let own = ((f64::from(width) * f64::from(height)).sqrt() as usize) / multiple * multiple;
    let resolution = resolution.min(own);
    if resolution < multiple {
        return None;
    }
    let target = (f64::from(width) / f64::from(height)).ln();
    buckets(resolution, multiple).into_iter().min_by(|a, b| {
        let distance = |b: &Bucket| ((b.width as f64 / b.height as f64).ln() - target).abs();
        distance(a)
            .total_cmp(&distance(b))
            .then((b.width * b.height).cmp(&(a.width * a.height)))
    })
}

/// One clip (an image is a clip of one frame) at one resolution.
#[derive(Clone, Debug, PartialEq)]
pub struct Item {
    /// The image file, video file or frame folder.
    pub image: PathBuf,
    /// The caption (empty when the source has no caption file).
    pub caption: String,
    /// The source's width and height after EXIF orientation (images, frames) or rotation
    /// (videos), before resizing; a frame folder's is its first frame's.
    pub size: (u32, u32),
    /// The size and frame count it is trained at.
    pub bucket: Bucket,
    /// Index of its dataset in the configuration.
    pub dataset: usize,
    /// Which frames of the source it is.
    pub clip: Clip,
}

impl Item {
    /// The image, or the single frame of a 1-frame clip, as VAE input: oriented by its EXIF
    /// tag, resized to cover the bucket, center-cropped to it, RGB in [-1, 1], shape
    /// `[3, height, width]` ([`burn_diffusion::pipeline::load_image`]). A clip of more frames
    /// is [`DatasetError::NotAnImage`].
    pub fn load_pixels(&self) -> Result<TensorData, DatasetError> {
        match (self.clip.kind, self.bucket.frames) {
            (SourceKind::Image, _) => {
                load_image(&self.image, self.bucket.width, self.bucket.height)
                    .map_err(DatasetError::Load)
            }
            (_, 1) => Ok(self.frames()?.remove(0)),
            (_, frames) => Err(DatasetError::NotAnImage {
                path: self.image.clone(),
                frames,
            }),
        }
    }

    /// The clip as VAE input: each frame fitted to the bucket exactly as
    /// [`load_pixels`](Self::load_pixels) fits an image, RGB in [-1, 1], shape
    /// `[3, frames, height, width]` (an image gives one frame). Videos are decoded by the
    /// `ffmpeg` program, resampled to the clip's `fps` first when it has one.
    pub fn load_clip(&self) -> Result<TensorData, DatasetError> {
        let frames = self.frames()?;
        let Bucket { width, height, .. } = self.bucket;
        let plane = width * height;
        let mut out = vec![0f32; 3 * frames.len() * plane];
        for (f, frame) in frames.iter().enumerate() {
            let values = frame.as_slice::<f32>().expect("fitted frames are f32");
            for c in 0..3 {
                out[(c * frames.len() + f) * plane..][..plane]
                    .copy_from_slice(&values[c * plane..][..plane]);
            }
        }
        Ok(TensorData::new(out, [3, frames.len(), height, width]))
    }

    /// Each frame of the clip, `[3, height, width]` in [-1, 1].
    fn frames(&self) -> Result<Vec<TensorData>, DatasetError> {
        let Bucket {
            width,
            height,
            frames,
        } = self.bucket;
        let load = |path: &Path| load_image(path, width, height).map_err(DatasetError::Load);
        match self.clip.kind {
            SourceKind::Image => Ok(vec![load(&self.image)?]),
            SourceKind::FrameFolder => {
                let files = frame_files(&self.image)?;
                let start = self.clip.start;
                let clip =
                    files
                        .get(start..start + frames)
                        .ok_or_else(|| DatasetError::ShortClip {
                            path: self.image.clone(),
                            found: files.len().saturating_sub(start),
                            frames,
                        })?;
                clip.iter().map(|file| load(file)).collect()
            }
            SourceKind::Video => {
                let decoded = video::decode(
                    &self.image,
                    self.size,
                    self.clip.start,
                    frames,
                    self.clip.fps,
                )?;
                Ok(decoded
                    .iter()
                    .map(|frame| fit_image(frame, width, height))
                    .collect())
            }
        }
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
    /// Lists the sources and captions of every dataset, cuts clips and assigns their buckets
    /// (sides in multiples of `multiple` pixels, [`PIXEL_MULTIPLE`] or more). Reads image
    /// headers and, with `ffprobe`, video headers only; a video that `ffprobe` cannot read is
    /// reported (`tracing::error!`) and left out.
    pub fn scan(plans: &[DatasetPlan], multiple: usize) -> Result<Self, DatasetError> {
        let mut items = Vec::new();
        for (index, plan) in plans.iter().enumerate() {
            let first = items.len();
            let mut readable = 0;
            let mut uncaptioned = Vec::new();
            let mut unused_images = Vec::new();
            for (kind, source) in list_sources(&plan.folder)? {
                let (size, length, fps) = match kind {
                    SourceKind::Image => (oriented_size(&source)?, 1, None),
                    SourceKind::FrameFolder => {
                        let files = frame_files(&source)?;
                        (oriented_size(&files[0])?, files.len(), None)
                    }
                    SourceKind::Video => match video::probe(&source) {
                        Ok(info) => (info.size, info.frames_at(plan.fps), plan.fps),
                        Err(e @ DatasetError::NoFfmpeg { .. }) => return Err(e),
                        Err(e) => {
                            tracing::error!("{e}; the video is left out");
                            continue;
                        }
                    },
                };
                readable += 1;
                let (counts, short): (Vec<usize>, Vec<usize>) =
                    plan.frames.iter().partition(|&&n| n <= length);
                if kind == SourceKind::Image {
                    if counts.is_empty() {
                        unused_images.push(source.clone());
                    }
                } else if let Some(&n) = short.first() {
                    let rate = fps.map_or(String::new(), |fps| format!(" at {fps} fps"));
                    tracing::warn!(
                        "{} has {length} frames{rate}, fewer than {n}: it gives no clip of \
                         {short:?} frames",
                        source.display()
                    );
                }
                if counts.is_empty() {
                    continue;
                }
                let caption_path = caption_path(&source, kind, &plan.caption_ext);
                let caption = match std::fs::read_to_string(&caption_path) {
                    Ok(text) => text.trim().to_string(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        uncaptioned.push(source.clone());
                        String::new()
                    }
                    Err(source) => {
                        return Err(DatasetError::Io {
                            path: caption_path,
                            source,
                        });
                    }
                };
                let (width, height) = size;
                for &resolution in &plan.resolutions {
                    let bucket =
                        bucket_for(width, height, resolution, multiple).ok_or_else(|| {
                            DatasetError::TooSmall {
                                path: source.clone(),
                                width,
                                height,
                                side: multiple,
                            }
                        })?;
                    for &frames in &counts {
                        for start in plan.extraction.starts(length, frames) {
                            items.push(Item {
                                image: source.clone(),
                                caption: caption.clone(),
                                size,
                                bucket: Bucket { frames, ..bucket },
                                dataset: index,
                                clip: Clip { kind, start, fps },
                            });
                        }
                    }
                }
            }
            if let Some(first) = uncaptioned.first() {
                tracing::warn!(
                    "{} of the sources in {} have no .{} caption file and train with an empty \
                     caption (first: {})",
                    uncaptioned.len(),
                    plan.folder.display(),
                    plan.caption_ext,
                    first.display()
                );
            }
            if let Some(first) = unused_images.first() {
                tracing::warn!(
                    "{} images in {} are left out: an image is one frame and `frames` ({:?}) \
                     lists no 1 (first: {})",
                    unused_images.len(),
                    plan.folder.display(),
                    plan.frames,
                    first.display()
                );
            }
            if items.len() == first {
                let folder = plan.folder.clone();
                return Err(if readable == 0 {
                    DatasetError::Empty { folder }
                } else {
                    DatasetError::NoClip {
                        folder,
                        frames: plan.frames.clone(),
                    }
                });
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

    /// Every item, in folder order (datasets in configuration order, sources sorted by name,
    /// then resolutions and frame counts in configuration order, then clip starts).
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

/// Whether `path` ends in one of `extensions` (without case).
fn has_extension(path: &Path, extensions: &[&str]) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| extensions.iter().any(|x| x.eq_ignore_ascii_case(e)))
}

/// The entries of `folder`.
fn read_folder(folder: &Path) -> Result<Vec<PathBuf>, DatasetError> {
    let io_error = |source| DatasetError::Io {
        path: folder.to_path_buf(),
        source,
    };
    std::fs::read_dir(folder)
        .map_err(io_error)?
        .map(|entry| entry.map(|e| e.path()).map_err(io_error))
        .collect()
}

/// The images, videos and frame folders (sub-folders holding images, not hidden) of
/// `folder`, sorted by name; [`DatasetError::Empty`] when there is none.
fn list_sources(folder: &Path) -> Result<Vec<(SourceKind, PathBuf)>, DatasetError> {
    let mut sources = Vec::new();
    for path in read_folder(folder)? {
        if path.is_file() {
            if has_extension(&path, IMAGE_EXTENSIONS) {
                sources.push((SourceKind::Image, path));
            } else if has_extension(&path, VIDEO_EXTENSIONS) {
                sources.push((SourceKind::Video, path));
            }
        } else if path.is_dir()
            && !path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
            && !frame_files(&path)?.is_empty()
        {
            sources.push((SourceKind::FrameFolder, path));
        }
    }
    if sources.is_empty() {
        return Err(DatasetError::Empty {
            folder: folder.to_path_buf(),
        });
    }
    sources.sort_by(|a, b| a.1.cmp(&b.1));
    Ok(sources)
}

/// The image files of a frame folder in frame order: by the last number in their names (files
/// without one after those with one), then by name.
fn frame_files(folder: &Path) -> Result<Vec<PathBuf>, DatasetError> {
    let mut files: Vec<PathBuf> = read_folder(folder)?
        .into_iter()
        .filter(|p| has_extension(p, IMAGE_EXTENSIONS) && p.is_file())
        .collect();
    let number = |path: &PathBuf| -> Option<u128> {
        let stem = path.file_stem()?.to_str()?;
        let end = stem.rfind(|c: char| c.is_ascii_digit())? + 1;
        let begin = stem[..end]
            .rfind(|c: char| !c.is_ascii_digit())
            .map_or(0, |i| i + 1);
        stem[begin..end].parse().ok()
    };
    files.sort_by_cached_key(|p| (number(p).is_none(), number(p), p.clone()));
    Ok(files)
}

/// The caption file of a source: same stem with `ext` for files, `<folder>.<ext>` beside a
/// frame folder.
fn caption_path(source: &Path, kind: SourceKind, ext: &str) -> PathBuf {
    match kind {
        SourceKind::FrameFolder => {
            let mut path = source.as_os_str().to_owned();
            path.push(".");
            path.push(ext);
            path.into()
        }
        _ => source.with_extension(ext),
    }
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
            frames: vec![1],
            fps: None,
            extraction: FrameExtraction::Head,
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
            let list = buckets(resolution, PIXEL_MULTIPLE);
            let area = resolution * resolution;
            assert!(list.contains(&Bucket {
                width: resolution,
                height: resolution,
                frames: 1,
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
    fn buckets_of_32_pixels_round_the_resolution_down() {
        let list = buckets(528, 32);
        assert!(list.contains(&Bucket {
            width: 512,
            height: 512,
            frames: 1,
        }));
        assert!(list.iter().all(|b| b.width % 32 == 0 && b.height % 32 == 0));
        // Wan 2.2 TI2V-5B at 640: a 16:9 clip gets a bucket whose sides its VAE (16x) and
        // patches (2x) divide.
        let clip = bucket_for(1280, 720, 640, 32).unwrap();
        assert_eq!((clip.width, clip.height), (832, 480));
        assert_eq!(bucket_for(20, 20, 640, 32), None);
    }

    #[test]
    fn a_16_by_9_image_goes_to_the_nearest_aspect_bucket() {
        // At 512 the widths near 16:9 (1.778) are 640x400 (1.6), 704x368 (1.913) and 768x336
        // (2.286); in log scale 1.913 is the nearest (0.073 against 0.105 for 1.6).
        assert_eq!(
            bucket_for(1920, 1080, 512, PIXEL_MULTIPLE),
            Some(Bucket {
                width: 704,
                height: 368,
                frames: 1,
            })
        );
        assert_eq!(
            bucket_for(1080, 1920, 512, PIXEL_MULTIPLE).map(|b| b.width < b.height),
            Some(true)
        );
        assert_eq!(
            bucket_for(1000, 1000, 512, PIXEL_MULTIPLE),
            Some(Bucket {
                width: 512,
                height: 512,
                frames: 1,
            })
        );
    }

    #[test]
    fn small_images_are_not_upscaled() {
        // 300x300 has its own resolution 288 (300 rounded down to a multiple of 16).
        assert_eq!(
            bucket_for(300, 300, 1024, PIXEL_MULTIPLE),
            Some(Bucket {
                width: 288,
                height: 288,
                frames: 1,
            })
        );
        assert_eq!(bucket_for(10, 10, 512, PIXEL_MULTIPLE), None);
    }

    #[test]
    fn scan_reads_captions_and_makes_one_item_per_resolution() {
        let dir = tempfile::tempdir().unwrap();
        save_png(&dir.path().join("b.png"), 64, 32, |_, _| [0, 0, 0]);
        save_png(&dir.path().join("a.PNG"), 32, 32, |_, _| [0, 0, 0]);
        std::fs::write(dir.path().join("a.txt"), "  a red cube \n").unwrap();
        std::fs::write(dir.path().join("notes.md"), "not an image").unwrap();
        let dataset =
            Dataset::scan(&[plan(dir.path(), vec![32, 16], 1, 0.0)], PIXEL_MULTIPLE).unwrap();
        let summary: Vec<(String, &str, Bucket)> = dataset
            .items()
            .iter()
            .map(|i| {
                let name = i.image.file_name().unwrap().to_string_lossy().into_owned();
                (name, i.caption.as_str(), i.bucket)
            })
            .collect();
        let b = |width, height| Bucket {
            width,
            height,
            frames: 1,
        };
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
    fn a_bucket_serialized_without_frames_is_one_frame() {
        let bucket: Bucket = serde_json::from_str(r#"{"width":48,"height":16}"#).unwrap();
        assert_eq!(
            bucket,
            Bucket {
                width: 48,
                height: 16,
                frames: 1
            }
        );
    }

    #[test]
    fn uniform_starts_spread_from_the_first_to_the_last_possible_frame() {
        let uniform = |samples| FrameExtraction::Uniform { samples };
        assert_eq!(FrameExtraction::Head.starts(100, 33), [0]);
        assert_eq!(uniform(1).starts(100, 33), [0]);
        // np.linspace(0, 67, 4, dtype=int) = [0, 22, 44, 67].
        assert_eq!(uniform(4).starts(100, 33), [0, 22, 44, 67]);
        assert_eq!(uniform(3).starts(33, 33), [0]);
        assert_eq!(uniform(5).starts(10, 8), [0, 1, 2]);
    }

    #[test]
    fn an_empty_folder_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let err =
            Dataset::scan(&[plan(dir.path(), vec![512], 1, 0.0)], PIXEL_MULTIPLE).unwrap_err();
        assert!(err.to_string().contains(&dir.path().display().to_string()));
    }

    fn dataset_of(n: usize, repeats: usize, dropout: f64) -> Dataset {
        let bucket = |i: usize| Bucket {
            width: 16 * (1 + i % 2),
            height: 16,
            frames: 1,
        };
        Dataset {
            items: (0..n)
                .map(|i| Item {
                    image: format!("{i}.png").into(),
                    caption: String::new(),
                    size: (16, 16),
                    bucket: bucket(i),
                    dataset: 0,
                    clip: Clip {
                        kind: SourceKind::Image,
                        start: 0,
                        fps: None,
                    },
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
