//! Training images: decoded (PNG, JPEG, WebP) with their EXIF orientation applied, resized to
//! cover a bucket and center-cropped to it, in the VAE's `[-1, 1]` range.

use std::path::Path;

use burn::tensor::TensorData;
use image::imageops::{self, FilterType};
use image::{DynamicImage, ImageDecoder, ImageReader, RgbImage};

use crate::error::LoadError;

/// The image at `path` as VAE input: resized with a triangle (bilinear, antialiased) filter so
/// that it covers `width × height` while keeping its aspect ratio, the center of that size cut
/// out, and its 8-bit RGB values `v` mapped to `2 · v / 255 - 1`.
///
/// # Shapes
/// - output: `[3, height, width]`, f32
pub fn load_image(path: &Path, width: usize, height: usize) -> Result<TensorData, LoadError> {
    Ok(fit_image(&decode(path)?, width, height))
}

/// A decoded RGB image (a video frame, say) as VAE input, exactly as [`load_image`] makes one
/// from a file: resized to cover `width × height`, center-cropped, mapped to `[-1, 1]`.
///
/// # Shapes
/// - output: `[3, height, width]`, f32
pub fn fit_image(image: &RgbImage, width: usize, height: usize) -> TensorData {
    to_model_range(&fit_to_bucket(image, width, height))
}

/// Decodes an image and applies its EXIF orientation.
fn decode(path: &Path) -> Result<RgbImage, LoadError> {
    let io_error = |source| LoadError::Io {
        file: path.to_path_buf(),
        source,
    };
    let image_error = |source| LoadError::Image {
        file: path.to_path_buf(),
        source,
    };
    let reader = ImageReader::open(path)
        .and_then(|r| r.with_guessed_format())
        .map_err(io_error)?;
    let mut decoder = reader.into_decoder().map_err(image_error)?;
    let orientation = decoder.orientation().map_err(image_error)?;
    let mut image = DynamicImage::from_decoder(decoder).map_err(image_error)?;
    image.apply_orientation(orientation);
    Ok(image.into_rgb8())
}

/// How [`load_image`] fits an image of `image_width × image_height` pixels (after EXIF
/// orientation) to a bucket of `width × height`: the size it is resized to and the top-left
/// corner of the cut-out in the resized image. SDXL's micro-conditioning records these
/// (`crops_coords_top_left` is `(top, left)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketFit {
    /// Width after resizing (at least the bucket's).
    pub resized_width: u32,
    /// Height after resizing (at least the bucket's).
    pub resized_height: u32,
    /// First row of the cut-out.
    pub top: u32,
    /// First column of the cut-out.
    pub left: u32,
}

impl BucketFit {
    /// The smallest size that covers `width × height` with the image's aspect ratio (sides
    /// rounded, never below the bucket's), and its centered cut-out.
    pub fn new(image_width: u32, image_height: u32, width: usize, height: usize) -> Self {
        let (w, h) = (image_width as f64, image_height as f64);
        let scale = (width as f64 / w).max(height as f64 / h);
        let resized_width = ((w * scale).round() as u32).max(width as u32);
        let resized_height = ((h * scale).round() as u32).max(height as u32);
        Self {
            resized_width,
            resized_height,
            top: (resized_height - height as u32) / 2,
            left: (resized_width - width as u32) / 2,
        }
    }
}

/// Scales `image` to the smallest size that covers `width × height` and cuts out its center
/// ([`BucketFit`]).
fn fit_to_bucket(image: &RgbImage, width: usize, height: usize) -> RgbImage {
    let fit = BucketFit::new(image.width(), image.height(), width, height);
    let resized = if (fit.resized_width, fit.resized_height) == image.dimensions() {
        image.clone()
    } else {
        imageops::resize(
            image,
            fit.resized_width,
            fit.resized_height,
            FilterType::Triangle,
        )
    };
    imageops::crop_imm(&resized, fit.left, fit.top, width as u32, height as u32).to_image()
}

/// `[3, height, width]` planes of `2 · v / 255 - 1`.
fn to_model_range(image: &RgbImage) -> TensorData {
    let (w, h) = (image.width() as usize, image.height() as usize);
    let mut planes = vec![0f32; 3 * h * w];
    for (x, y, pixel) in image.enumerate_pixels() {
        for (c, v) in pixel.0.iter().enumerate() {
            planes[(c * h + y as usize) * w + x as usize] = 2.0 * (*v as f32 / 255.0) - 1.0;
        }
    }
    TensorData::new(planes, [3, h, w])
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::Rgb;

    #[test]
    fn a_wide_image_loses_its_sides() {
        // 40×10: left quarter black, right quarter white, the middle another colour; a 20×10
        // bucket needs no resize and keeps the middle 20 columns.
        let image = RgbImage::from_fn(40, 10, |x, _| match x {
            0..10 => Rgb([0, 0, 0]),
            30..40 => Rgb([255, 255, 255]),
            _ => Rgb([128, 64, 255]),
        });
        let out = fit_to_bucket(&image, 20, 10);
        assert_eq!(out.dimensions(), (20, 10));
        assert!(out.pixels().all(|p| *p == Rgb([128, 64, 255])));
    }

    #[test]
    fn a_small_image_is_scaled_up_to_cover() {
        let image = RgbImage::from_pixel(4, 8, Rgb([10, 20, 30]));
        let out = fit_to_bucket(&image, 16, 16);
        assert_eq!(out.dimensions(), (16, 16));
        assert!(out.pixels().all(|p| *p == Rgb([10, 20, 30])));
    }

    #[test]
    fn pixels_map_to_the_unit_range_channel_first() {
        let image = RgbImage::from_fn(2, 1, |x, _| {
            if x == 0 {
                Rgb([0, 255, 51])
            } else {
                Rgb([255, 0, 102])
            }
        });
        let data = to_model_range(&image);
        assert_eq!(data.shape.to_vec(), [3, 1, 2]);
        let values = data.to_vec::<f32>().unwrap();
        let expected = [-1.0, 1.0, 1.0, -1.0, -0.6, -0.2];
        for (v, e) in values.iter().zip(expected) {
            assert!((v - e).abs() < 1e-6, "{values:?}");
        }
    }

    #[test]
    fn a_missing_file_names_it() {
        let error = load_image(Path::new("no/such/image.png"), 8, 8).unwrap_err();
        assert!(error.to_string().contains("no/such/image.png"), "{error}");
    }
}
