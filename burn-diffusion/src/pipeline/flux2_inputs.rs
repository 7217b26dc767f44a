//! FLUX.2's transformer inputs from normalized latents: the pixels of a patchified latent as
//! tokens and back, and the four-axis position ids `(t, h, w, l)` of image and text tokens, as
//! diffusers' `Flux2Pipeline` makes them. (Patchifying and normalizing is
//! [`AutoencoderKl::encode_latents`](crate::vae::AutoencoderKl::encode_latents).)

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/pipeline_flux2.py (_pack_latents, _unpack_latents_with_ids, _prepare_latent_ids, _prepare_text_ids)

use burn::tensor::{Tensor, TensorData};
use burn_kernels::Kernels;

/// Each pixel of a normalized latent as one token of its channels.
///
/// # Shapes
/// - `latents`: `[batch, channels, height, width]`
/// - output: `[batch, height · width, channels]`, tokens in row-major order
pub fn pack_flux2_latents<B: Kernels>(latents: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, c, h, w] = latents.dims();
    latents.reshape([b, c, h * w]).swap_dims(1, 2)
}

/// The inverse of [`pack_flux2_latents`] for a latent of `height × width` (tokens in the order
/// of [`flux2_image_ids`], as the pipeline's scatter by ids puts them).
///
/// # Shapes
/// - `tokens`: `[batch, height · width, channels]`
/// - output: `[batch, channels, height, width]`
///
/// # Panics
/// If the token count is not `height · width`.
pub fn unpack_flux2_latents<B: Kernels>(
    tokens: Tensor<B, 3>,
    height: usize,
    width: usize,
) -> Tensor<B, 4> {
    let [b, n, c] = tokens.dims();
    assert_eq!(
        n,
        height * width,
        "{n} tokens are not a {height}×{width} latent"
    );
    tokens.swap_dims(1, 2).reshape([b, c, height, width])
}

/// The position ids of the tokens of a `height × width` latent: `(0, row, column, 0)` for each
/// pixel in row-major order, in i64 (`_prepare_latent_ids`, one batch element).
///
/// # Shapes
/// - output: `[height · width, 4]`
pub fn flux2_image_ids(height: usize, width: usize) -> TensorData {
    let ids: Vec<i64> = (0..height as i64)
        .flat_map(|r| (0..width as i64).flat_map(move |c| [0, r, c, 0]))
        .collect();
    TensorData::new(ids, [height * width, 4])
}

/// The position ids of `tokens` text tokens: `(0, 0, 0, index)`, in i64 (`_prepare_text_ids`,
/// one batch element).
///
/// # Shapes
/// - output: `[tokens, 4]`
pub fn flux2_text_ids(tokens: usize) -> TensorData {
    let ids: Vec<i64> = (0..tokens as i64).flat_map(|l| [0, 0, 0, l]).collect();
    TensorData::new(ids, [tokens, 4])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Int;

    #[test]
    fn a_token_is_one_pixel_across_channels() {
        let device = Default::default();
        // 1 batch, 2 channels, 2×3 latent: values encode (channel, row, column).
        let latents = Tensor::<Flex, 1, Int>::arange(0..12, &device)
            .float()
            .reshape([1, 2, 2, 3]);
        let packed = pack_flux2_latents(latents.clone());
        assert_eq!(packed.dims(), [1, 6, 2]);
        let values = packed.clone().into_data().to_vec::<f32>().unwrap();
        // Token 4 is row 1, column 1.
        assert_eq!(&values[8..10], [4.0, 10.0]);
        unpack_flux2_latents(packed, 2, 3)
            .into_data()
            .assert_eq(&latents.into_data(), true);
    }

    #[test]
    fn ids_count_rows_then_columns_and_text_positions() {
        let ids = flux2_image_ids(2, 3).to_vec::<i64>().unwrap();
        assert_eq!(&ids[4 * 4..4 * 5], [0, 1, 1, 0]);
        let text = flux2_text_ids(3).to_vec::<i64>().unwrap();
        assert_eq!(text, [0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2]);
    }
}
