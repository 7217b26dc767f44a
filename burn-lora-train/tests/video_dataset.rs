//! Video clips and frame folders in a dataset, against the fixtures that
//! `tests/fixtures/video/make_video_fixtures.sh` writes: ten 48×32 frames whose pixel at column
//! x and row y of frame k is RGB (20 + 20·k, 5·x, 7·y), as PNG files (`frames/1.png` …
//! `frames/10.png`), as a lossless 8 fps video (`clip.mkv`), the first three as `short.mp4`,
//! and a file that is no video (`broken.mp4`). These tests run FFmpeg's programs: CI installs
//! them.

use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use burn_lora_train::config::DatasetPlan;
use burn_lora_train::dataset::{
    Bucket, Clip, Dataset, DatasetError, FrameExtraction, Item, PIXEL_MULTIPLE, SourceKind,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video")
}

fn plan(frames: Vec<usize>, fps: Option<f64>, extraction: FrameExtraction) -> DatasetPlan {
    DatasetPlan {
        folder: fixtures(),
        caption_ext: "txt".into(),
        resolutions: vec![32],
        repeats: 1,
        caption_dropout: 0.0,
        cache_to_disk: false,
        frames,
        fps,
        extraction,
    }
}

fn name(item: &Item) -> String {
    item.image
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// Asserts that `clip` (`[3, n, 32, 32]`) holds the source frames `expected`: at 32×32 the
/// 48×32 frames are not resized, only their middle 32 columns kept, so pixel (x, y) of frame k
/// is (20 + 20·k, 5·(x + 8), 7·y), within one step of 8 bits.
fn assert_frames(clip: &TensorData, expected: &[usize], what: &str) {
    let n = expected.len();
    assert_eq!(clip.shape.to_vec(), [3, n, 32, 32], "{what}");
    let values = clip.to_vec::<f32>().unwrap();
    for (f, &k) in expected.iter().enumerate() {
        for y in 0..32 {
            for x in 0..32 {
                let rgb = [20 + 20 * k, 5 * (x + 8), 7 * y];
                for (c, v) in rgb.into_iter().enumerate() {
                    let got = values[((c * n + f) * 32 + y) * 32 + x];
                    let want = 2.0 * v as f32 / 255.0 - 1.0;
                    assert!(
                        (got - want).abs() <= 2.0 / 255.0 + 1e-6,
                        "{what}: frame {f} (source frame {k}), channel {c} at ({x}, {y}): \
                         {got} instead of {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn head_clips_of_the_video_and_the_frame_folder_are_the_source_frames() {
    let dataset = Dataset::scan(
        &[plan(vec![9], None, FrameExtraction::Head)],
        PIXEL_MULTIPLE,
    )
    .unwrap();
    let items = dataset.items();
    let summary: Vec<(String, SourceKind, usize, Bucket)> = items
        .iter()
        .map(|i| (name(i), i.clip.kind, i.clip.start, i.bucket))
        .collect();
    let bucket = Bucket {
        width: 32,
        height: 32,
        frames: 9,
    };
    // short.mp4 has 3 frames (fewer than 9) and broken.mp4 is no video: both left out.
    assert_eq!(
        summary,
        [
            ("clip.mkv".into(), SourceKind::Video, 0, bucket),
            ("frames".into(), SourceKind::FrameFolder, 0, bucket),
        ]
    );
    assert_eq!(items[0].caption, "a gradient that turns red");
    assert_eq!(items[1].caption, "the same gradient, frame by frame");
    assert_eq!(items[0].size, (48, 32));
    assert_eq!(items[1].size, (48, 32));
    let video = items[0].load_clip().unwrap();
    let folder = items[1].load_clip().unwrap();
    let first_nine: Vec<usize> = (0..9).collect();
    assert_frames(&video, &first_nine, "clip.mkv");
    assert_frames(&folder, &first_nine, "frames/");
    assert_eq!(video, folder, "the lossless video equals its frames");
}

#[test]
fn uniform_clips_start_evenly_from_the_first_to_the_last_possible_frame() {
    let extraction = FrameExtraction::Uniform { samples: 3 };
    let dataset = Dataset::scan(&[plan(vec![5], None, extraction)], PIXEL_MULTIPLE).unwrap();
    // Ten frames, clips of five: starts ⌊k · 5 / 2⌋ = 0, 2, 5.
    let starts: Vec<(String, usize)> = dataset
        .items()
        .iter()
        .map(|i| (name(i), i.clip.start))
        .collect();
    assert_eq!(
        starts,
        [
            ("clip.mkv".into(), 0),
            ("clip.mkv".into(), 2),
            ("clip.mkv".into(), 5),
            ("frames".into(), 0),
            ("frames".into(), 2),
            ("frames".into(), 5),
        ]
    );
    for item in dataset.items() {
        let start = item.clip.start;
        let expected: Vec<usize> = (start..start + 5).collect();
        let what = format!("{} from {start}", name(item));
        assert_frames(&item.load_clip().unwrap(), &expected, &what);
    }
}

#[test]
fn resampling_shows_the_source_frame_at_each_new_time() {
    // At 16 fps each 8 fps frame shows twice, and the three frames of short.mp4 become five;
    // at 4 fps every other frame shows. A frame folder has no rate and is not resampled.
    for (fps, expected, names) in [
        (
            16.0,
            [0, 0, 1, 1, 2],
            &["clip.mkv", "frames", "short.mp4"][..],
        ),
        (4.0, [0, 2, 4, 6, 8], &["clip.mkv", "frames"][..]),
    ] {
        let dataset = Dataset::scan(
            &[plan(vec![5], Some(fps), FrameExtraction::Head)],
            PIXEL_MULTIPLE,
        )
        .unwrap();
        let items = dataset.items();
        assert_eq!(
            items.iter().map(name).collect::<Vec<_>>(),
            names,
            "{fps} fps"
        );
        for item in items {
            let what = format!("{} at {fps} fps", name(item));
            let clip = item.load_clip().unwrap();
            if item.clip.kind == SourceKind::FrameFolder {
                assert_eq!(item.clip.fps, None);
                assert_frames(&clip, &[0, 1, 2, 3, 4], &what);
            } else {
                assert_eq!(
                    item.clip,
                    Clip {
                        kind: SourceKind::Video,
                        start: 0,
                        fps: Some(fps),
                    }
                );
                assert_frames(&clip, &expected, &what);
            }
        }
    }
    // At 4 fps the ten frames are five: the second uniform clip of five starts at 0 too.
    let uniform = FrameExtraction::Uniform { samples: 2 };
    let dataset = Dataset::scan(&[plan(vec![5], Some(4.0), uniform)], PIXEL_MULTIPLE).unwrap();
    let video: Vec<usize> = dataset
        .items()
        .iter()
        .filter(|i| i.clip.kind == SourceKind::Video)
        .map(|i| i.clip.start)
        .collect();
    assert_eq!(video, [0]);
}

#[test]
fn one_frame_clips_train_as_images_and_buckets_group_by_frames() {
    let dataset = Dataset::scan(
        &[plan(vec![1, 5], None, FrameExtraction::Head)],
        PIXEL_MULTIPLE,
    )
    .unwrap();
    let summary: Vec<(String, usize)> = dataset
        .items()
        .iter()
        .map(|i| (name(i), i.bucket.frames))
        .collect();
    assert_eq!(
        summary,
        [
            ("clip.mkv".into(), 1),
            ("clip.mkv".into(), 5),
            ("frames".into(), 1),
            ("frames".into(), 5),
            ("short.mp4".into(), 1),
        ]
    );
    for item in dataset.items() {
        let pixels = item.load_pixels();
        if item.bucket.frames == 1 {
            let pixels = pixels.unwrap();
            assert_eq!(pixels.shape.to_vec(), [3, 32, 32]);
            let clip = TensorData::new(pixels.to_vec::<f32>().unwrap(), [3, 1, 32, 32]);
            assert_frames(&clip, &[0], &name(item));
        } else {
            let error = pixels.unwrap_err();
            assert!(matches!(error, DatasetError::NotAnImage { frames: 5, .. }));
            assert!(error.to_string().contains("clip.mkv") || error.to_string().contains("frames"));
        }
    }
    for batch in dataset.epoch(7, 0, 8) {
        for sample in &batch.samples {
            assert_eq!(dataset.items()[sample.item].bucket, batch.bucket);
        }
    }
    let batches: Vec<usize> = dataset
        .epoch(7, 0, 8)
        .iter()
        .map(|b| b.bucket.frames)
        .collect();
    assert_eq!(
        batches.len(),
        2,
        "one batch of 1-frame clips, one of 5-frame clips"
    );
    assert!(batches.contains(&1) && batches.contains(&5));
}

#[test]
fn an_unreadable_video_names_itself_and_a_folder_of_them_is_empty() {
    let broken = fixtures().join("broken.mp4");
    let item = Item {
        image: broken.clone(),
        caption: String::new(),
        size: (48, 32),
        bucket: Bucket {
            width: 32,
            height: 32,
            frames: 1,
        },
        dataset: 0,
        clip: Clip {
            kind: SourceKind::Video,
            start: 0,
            fps: None,
        },
    };
    let error = item.load_clip().unwrap_err();
    assert!(matches!(error, DatasetError::Ffmpeg { .. }), "{error}");
    assert!(error.to_string().contains("broken.mp4"), "{error}");

    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(&broken, dir.path().join("broken.MP4")).unwrap();
    let mut only_broken = plan(vec![1], None, FrameExtraction::Head);
    only_broken.folder = dir.path().to_path_buf();
    let error = Dataset::scan(&[only_broken], PIXEL_MULTIPLE).unwrap_err();
    assert!(matches!(error, DatasetError::Empty { .. }), "{error}");
}

#[test]
fn images_need_a_frame_count_of_one() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixtures().join("frames/1.png"),
        dir.path().join("still.png"),
    )
    .unwrap();
    let mut images = plan(vec![5], None, FrameExtraction::Head);
    images.folder = dir.path().to_path_buf();
    let error = Dataset::scan(std::slice::from_ref(&images), PIXEL_MULTIPLE).unwrap_err();
    assert!(matches!(error, DatasetError::NoClip { .. }), "{error}");
    images.frames = vec![5, 1];
    let dataset = Dataset::scan(&[images], PIXEL_MULTIPLE).unwrap();
    assert_eq!(dataset.items().len(), 1);
    assert_eq!(dataset.items()[0].clip.kind, SourceKind::Image);
    assert_frames(&dataset.items()[0].load_clip().unwrap(), &[0], "still.png");
}
