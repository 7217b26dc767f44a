//! FLUX.1's transformer inputs from VAE latents: 2×2 packing of a latent into tokens and back,
//! and the position ids of image and text tokens, as diffusers' `FluxPipeline` makes them.
//! (Latent normalization is
//! [`AutoencoderKl::normalize_latents`](crate::vae::AutoencoderKl::normalize_latents).)

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux/pipeline_flux.py (_pack_latents, _unpack_latents, _prepare_latent_image_ids, encode_prompt)

use burn::tensor::{Tensor, TensorData};
use burn_kernels::Kernels;

/// Each 2×2 patch of a latent as one token, its channels ordered `(channel, row, column)`.
///
/// # Shapes
/// - `latents`: `[batch, channels, height, width]`, even sides
/// - output: `[batch, height / 2 · width / 2, channels · 4]`, tokens in row-major order
///
/// # Panics
/// If a side is odd.
pub fn pack_latents<B: Kernels>(latents: Tensor<B, 4>) -> Tensor<B, 3> {
    let [b, c, h, w] = latents.dims();
    assert!(
        h.is_multiple_of(2) && w.is_multiple_of(2),
        "latent sides must be even to pack 2×2 patches, got {h}×{w}"
    );
    latents
        .reshape([b, c, h / 2, 2, w / 2, 2])
        .permute([0, 2, 4, 1, 3, 5])
        .reshape([b, h / 2 * (w / 2), c * 4])
}

/// The inverse of [`pack_latents`] for a latent of `height × width`.
///
/// # Shapes
/// - `tokens`: `[batch, height / 2 · width / 2, channels · 4]`
/// - output: `[batch, channels, height, width]`
///
/// # Panics
/// If the token count does not match the sides, or a side is odd.
pub fn unpack_latents<B: Kernels>(
    tokens: Tensor<B, 3>,
    height: usize,
    width: usize,
) -> Tensor<B, 4> {
    let [b, n, c4] = tokens.dims();
    assert!(
        height.is_multiple_of(2)
            && width.is_multiple_of(2)
            && n == height / 2 * (width / 2)
            && c4.is_multiple_of(4),
        "{n} tokens of {c4} channels are not a packed {height}×{width} latent"
    );
    tokens
        .reshape([b, height / 2, width / 2, c4 / 4, 2, 2])
        .permute([0, 3, 1, 4, 2, 5])
        .reshape([b, c4 / 4, height, width])
}

/// The position ids of the tokens of a packed `height × width` latent (`img_ids`): `(0, row,
/// column)` of each 2×2 patch, in f32.
///
/// # Shapes
/// - output: `[height / 2 · width / 2, 3]`
pub fn image_ids(height: usize, width: usize) -> TensorData {
    let (rows, cols) = (height / 2, width / 2);
    let ids: Vec<f32> = (0..rows)
        .flat_map(|r| (0..cols).flat_map(move |c| [0.0, r as f32, c as f32]))
        .collect();
    TensorData::new(ids, [rows * cols, 3])
}

/// The position ids of `tokens` text tokens (`txt_ids`): all zero, in f32.
///
/// # Shapes
/// - output: `[tokens, 3]`
pub fn text_ids(tokens: usize) -> TensorData {
    TensorData::new(vec![0f32; tokens * 3], [tokens, 3])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Int;

    #[test]
    fn a_token_holds_one_patch_channel_by_channel() {
        let device = Default::default();
        // 1 batch, 2 channels, 2×4 latent: values encode (channel, row, column).
        let latents = Tensor::<Flex, 1, Int>::arange(0..16, &device)
            .float()
            .reshape([1, 2, 2, 4]);
        let packed = pack_latents(latents.clone());
        assert_eq!(packed.dims(), [1, 2, 8]);
        let values = packed.clone().into_data().to_vec::<f32>().unwrap();
        // Token 1 is the right patch (columns 2, 3): channel 0 rows 0-1, then channel 1.
        assert_eq!(&values[8..], [2.0, 3.0, 6.0, 7.0, 10.0, 11.0, 14.0, 15.0]);
        unpack_latents(packed, 2, 4)
            .into_data()
            .assert_eq(&latents.into_data(), true);
    }

    #[test]
    fn ids_count_rows_then_columns() {
        let ids = image_ids(4, 6).to_vec::<f32>().unwrap();
        assert_eq!(ids.len(), 6 * 3);
        assert_eq!(&ids[3 * 4..3 * 5], [0.0, 1.0, 1.0]);
        assert!(
            text_ids(5)
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .all(|&v| v == 0.0)
        );
    }
}
