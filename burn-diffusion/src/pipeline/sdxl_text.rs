//! SDXL's caption encoding, as `StableDiffusionXLPipeline.encode_prompt` without `clip_skip`:
//! the penultimate hidden states of CLIP ViT-L/14 (`text_encoder`) and OpenCLIP ViT-bigG/14
//! (`text_encoder_2`) concatenated per token, and bigG's projected end-of-text state, brought
//! back to the host.
//!
//! The encoders are borrowed: both are small beside the UNet, and the caller drops them when
//! its captions are encoded.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/stable_diffusion_xl/pipeline_stable_diffusion_xl.py (encode_prompt)

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData, backend::Backend};
use burn_kernels::Kernels;

use crate::clip::ClipTextModel;
use crate::error::LoadError;
use crate::tokenize::CaptionTokenizer;

/// SDXL's text conditioning of each caption, `batch_size` captions at a time: `(states,
/// pooled)`, in the second encoder's dtype. `states` are both encoders' penultimate hidden
/// states, the first's features then the second's (`prompt_embeds`, `[tokens, hidden +
/// hidden_2]`: `[77, 2048]` for SDXL); `pooled` is the second encoder's projected end-of-text
/// state (`pooled_prompt_embeds`, `[projection_dim]`: `[1280]` for SDXL).
///
/// `tokenizers` are the pipeline's `tokenizer` and `tokenizer_2` (both [`CaptionTokenizer::clip`]
/// at [`CLIP_LENGTH`](crate::tokenize::CLIP_LENGTH); SDXL's second pads with `!`, which its
/// folder names), `encoders` its `text_encoder` (`CLIPTextModel`) and `text_encoder_2`
/// (`CLIPTextModelWithProjection`). Each encoder reads its own tokenizer's ids; the first
/// encoder's states are moved to the second's device and dtype before the concatenation.
///
/// # Panics
/// If the second encoder has no text projection, or the tokenizers' lengths differ.
pub fn encode_sdxl_prompt<B: Kernels>(
    tokenizers: (&CaptionTokenizer, &CaptionTokenizer),
    encoders: (&ClipTextModel<B>, &ClipTextModel<B>),
    captions: &[&str],
    batch_size: usize,
) -> Result<Vec<(TensorData, TensorData)>, LoadError> {
    let (tokenizer, tokenizer_2) = tokenizers;
    let (encoder, encoder_2) = encoders;
    assert!(
        encoder_2.config().projection_dim.is_some(),
        "SDXL's text_encoder_2 is a CLIPTextModelWithProjection; this one has no text projection"
    );
    assert_eq!(
        tokenizer.length(),
        tokenizer_2.length(),
        "SDXL's tokenizers give rows of one length"
    );
    let (devices, devices_2) = (encoder.devices(), encoder_2.devices());
    let (device, device_2) = (&devices[0], &devices_2[0]);
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let (states, pooled) = sdxl_conditioning(
            encoders,
            (
                tokenizer.encode_tensor::<B>(batch, device)?,
                tokenizer_2.encode_tensor::<B>(batch, device_2)?,
            ),
        );
        out.extend(
            states
                .iter_dim(0)
                .zip(pooled.iter_dim(0))
                .map(|(states, pooled)| {
                    (
                        states.squeeze_dim::<2>(0).into_data(),
                        pooled.squeeze_dim::<1>(0).into_data(),
                    )
                }),
        );
    }
    Ok(out)
}

/// SDXL's text conditioning of a batch of token rows, `ids` of the first tokenizer for the
/// first encoder and of the second for the second: `(states, pooled)` as
/// [`encode_sdxl_prompt`] gives them, `[batch, tokens, hidden + hidden_2]` and `[batch,
/// projection_dim]`, on the second encoder's device, in its dtype. This is the computation a
/// step runs when the text encoders train.
///
/// # Panics
/// If the second encoder has no text projection.
pub fn sdxl_conditioning<B: Kernels>(
    encoders: (&ClipTextModel<B>, &ClipTextModel<B>),
    ids: (Tensor<B, 2, Int>, Tensor<B, 2, Int>),
) -> (Tensor<B, 3>, Tensor<B, 2>) {
    let (encoder, encoder_2) = encoders;
    let second = encoder_2.forward(ids.1);
    let states_2 = penultimate(second.hidden_states);
    let device_2 = states_2.device();
    let states = penultimate(encoder.forward(ids.0).hidden_states)
        .to_device(&device_2)
        .cast(states_2.dtype());
    let pooled = second
        .text_embeds
        .expect("SDXL's text_encoder_2 is a CLIPTextModelWithProjection, with text_embeds");
    (Tensor::cat(vec![states, states_2], 2), pooled)
}

/// `hidden_states[-2]`: the output of the next-to-last layer, without the final layer norm.
fn penultimate<B: Backend>(mut hidden_states: Vec<Tensor<B, 3>>) -> Tensor<B, 3> {
    let at = hidden_states
        .len()
        .checked_sub(2)
        .expect("a CLIP encoder gives its embeddings and at least one layer's output");
    hidden_states.swap_remove(at)
}
