//! Videos through FFmpeg's command-line programs: `ffprobe` reads a video's size, length and
//! frame rate from its headers, `ffmpeg` decodes frames to raw 8-bit RGB on its standard output.
//! No FFmpeg library is linked; the programs are looked up on `PATH` when a video is met.

use std::io::ErrorKind;
use std::path::Path;
use std::process::{Command, Output};

use image::RgbImage;

use crate::dataset::DatasetError;

/// What `ffprobe` says of a video's first video stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct VideoInfo {
    /// Width and height of the decoded frames (after the rotation that FFmpeg applies).
    pub size: (u32, u32),
    /// Frames at the source's rate.
    pub frames: usize,
    /// The source's frames per second.
    pub fps: f64,
}

impl VideoInfo {
    /// Frames after resampling to `fps` (`None`: the source's rate). FFmpeg's `fps` filter
    /// shows, at each time `k / fps`, the source frame on screen then; counted are the times
    /// up to the last source frame's start, `⌊(frames − 1) · fps / source fps⌋ + 1`.
    pub fn frames_at(&self, fps: Option<f64>) -> usize {
        match (fps, self.frames) {
            (Some(fps), n) if n > 0 => {
                ((n - 1) as f64 * fps / self.fps + 1e-9).floor() as usize + 1
            }
            _ => self.frames,
        }
    }
}

/// Runs `program` with the arguments `before`, `path` and `after`; a missing program or a
/// failed run is an error naming `path`.
fn run(
    program: &'static str,
    before: &[&str],
    path: &Path,
    after: &[&str],
) -> Result<Output, DatasetError> {
    let output = Command::new(program)
        .args(before)
        .arg(path)
        .args(after)
        .output()
        .map_err(|source| match source.kind() {
            ErrorKind::NotFound => DatasetError::NoFfmpeg {
                program,
                path: path.to_path_buf(),
            },
            _ => DatasetError::Io {
                path: path.to_path_buf(),
                source,
            },
        })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(DatasetError::Ffmpeg {
            path: path.to_path_buf(),
            message: stderr.trim().lines().last().unwrap_or("no message").into(),
        });
    }
    Ok(output)
}

/// The first video stream of `path` as `ffprobe` describes it in JSON; with `count`, its
/// packets are counted too (which reads the whole file, decoding nothing).
fn ffprobe(path: &Path, count: bool) -> Result<serde_json::Value, DatasetError> {
    let mut args = vec!["-v", "error", "-select_streams", "v:0"];
    if count {
        args.push("-count_packets");
    }
    args.extend([
        "-show_entries",
        "stream=width,height,avg_frame_rate,r_frame_rate,nb_frames,nb_read_packets:\
         stream_tags=rotate:stream_side_data=rotation",
        "-of",
        "json",
        "-i",
    ]);
    let output = run("ffprobe", &args, path, &[])?;
    let stream = serde_json::from_slice::<serde_json::Value>(&output.stdout)
        .ok()
        .map(|mut json| json["streams"][0].take())
        .filter(|stream| !stream.is_null());
    stream.ok_or_else(|| DatasetError::Ffmpeg {
        path: path.to_path_buf(),
        message: "ffprobe finds no video stream".into(),
    })
}

/// A whole number that ffprobe writes as a number or a string.
fn number(stream: &serde_json::Value, key: &str) -> Option<u64> {
    match &stream[key] {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

/// Reads the size, frame count and frame rate of the first video stream of `path` with
/// `ffprobe`: from the headers, and by counting packets (nothing is decoded) where the
/// container does not record the frame count (Matroska, WebM).
pub(crate) fn probe(path: &Path) -> Result<VideoInfo, DatasetError> {
    let bad = |what: &str| DatasetError::Ffmpeg {
        path: path.to_path_buf(),
        message: format!("ffprobe reports {what}"),
    };
    let mut stream = ffprobe(path, false)?;
    let recorded = |stream: &serde_json::Value| number(stream, "nb_frames").filter(|&n| n > 0);
    if recorded(&stream).is_none() {
        stream = ffprobe(path, true)?;
    }
    let (Some(width), Some(height)) = (number(&stream, "width"), number(&stream, "height")) else {
        return Err(bad("no frame size"));
    };
    let frames = recorded(&stream)
        .or_else(|| number(&stream, "nb_read_packets"))
        .ok_or_else(|| bad("no frame count"))?;
    let rate = |key: &str| -> Option<f64> {
        let (num, den) = stream[key].as_str()?.split_once('/')?;
        let fps = num.parse::<f64>().ok()? / den.parse::<f64>().ok()?;
        (fps.is_finite() && fps > 0.0).then_some(fps)
    };
    let fps = rate("avg_frame_rate")
        .or_else(|| rate("r_frame_rate"))
        .ok_or_else(|| bad("no frame rate"))?;
    let rotation = stream["side_data_list"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|d| d["rotation"].as_i64())
        .or_else(|| stream["tags"]["rotate"].as_str()?.parse().ok())
        .unwrap_or(0);
    let (width, height) = (width as u32, height as u32);
    Ok(VideoInfo {
        size: if rotation.rem_euclid(180) == 90 {
            (height, width)
        } else {
            (width, height)
        },
        frames: frames as usize,
        fps,
    })
}

/// Decodes `count` frames of `path` from frame `start` on, counted at `fps` when set (the
/// video is resampled by FFmpeg's `fps` filter first), at their own size `size` (as
/// [`probe`] gives it). FFmpeg decodes from the start of the video and stops after the last
/// frame asked: cutting by frame number (`trim`) is exact whatever the timestamps.
pub(crate) fn decode(
    path: &Path,
    size: (u32, u32),
    start: usize,
    count: usize,
    fps: Option<f64>,
) -> Result<Vec<RgbImage>, DatasetError> {
    let mut filters = Vec::new();
    if let Some(fps) = fps {
        filters.push(format!("fps={fps}"));
    }
    if start > 0 {
        filters.push(format!("trim=start_frame={start}"));
    }
    let count_arg = count.to_string();
    let filter_arg = filters.join(",");
    let mut args = vec!["-an", "-sn", "-map", "0:v:0"];
    if !filters.is_empty() {
        args.extend(["-vf", &filter_arg]);
    }
    args.extend([
        "-frames:v",
        &count_arg,
        "-f",
        "rawvideo",
        "-pix_fmt",
        "rgb24",
        "-",
    ]);
    let output = run("ffmpeg", &["-v", "error", "-nostdin", "-i"], path, &args)?;
    let (width, height) = size;
    let frame_bytes = width as usize * height as usize * 3;
    if !output.stdout.len().is_multiple_of(frame_bytes) {
        return Err(DatasetError::Ffmpeg {
            path: path.to_path_buf(),
            message: format!(
                "{} bytes of RGB are not whole frames of {width}x{height}",
                output.stdout.len()
            ),
        });
    }
    let found = output.stdout.len() / frame_bytes;
    if found < count {
        return Err(DatasetError::ShortClip {
            path: path.to_path_buf(),
            found,
            frames: count,
        });
    }
    Ok(output
        .stdout
        .chunks_exact(frame_bytes)
        .map(|bytes| {
            RgbImage::from_raw(width, height, bytes.to_vec()).expect("a whole frame of bytes")
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_program_names_the_video_and_ffmpeg() {
        let error = run("burnlora-no-such-program", &[], Path::new("clip.mp4"), &[]).unwrap_err();
        let text = error.to_string();
        assert!(matches!(error, DatasetError::NoFfmpeg { .. }), "{text}");
        assert!(
            text.contains("clip.mp4") && text.contains("install FFmpeg"),
            "{text}"
        );
    }

    #[test]
    fn resampling_counts_the_times_up_to_the_last_frame() {
        let info = VideoInfo {
            size: (48, 32),
            frames: 10,
            fps: 8.0,
        };
        // The last frame starts at 9/8 s: times k/16 up to it are k = 0 … 18.
        assert_eq!(info.frames_at(Some(16.0)), 19);
        assert_eq!(info.frames_at(Some(4.0)), 5);
        assert_eq!(info.frames_at(Some(8.0)), 10);
        assert_eq!(info.frames_at(None), 10);
        assert_eq!(VideoInfo { frames: 0, ..info }.frames_at(Some(4.0)), 0);
    }
}
