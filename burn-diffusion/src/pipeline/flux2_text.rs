//! FLUX.2's caption encoding, as `Flux2Pipeline.encode_prompt` (Mistral Small 3, layers 10, 20,
//! 30) and `Flux2KleinPipeline.encode_prompt` (Qwen3, layers 9, 18, 27): the chosen hidden states
//! of the decoder, concatenated per token, brought back to the host.
//!
//! Like [`encode_t5`](super::encode_t5), the function takes the decoder by value and drops it
//! before returning, so that a 24 B decoder does not stay in memory beside the transformer.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/pipeline_flux2.py (_get_mistral_3_small_prompt_embeds)
// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux2/pipeline_flux2_klein.py (_get_qwen3_prompt_embeds)

use burn::module::Module;
use burn::tensor::TensorData;
use burn_kernels::Kernels;

use super::flux_text::release;
use crate::error::LoadError;
use crate::text_decoder::TextDecoder;
use crate::tokenize::PromptTokenizer;

/// The hidden states FLUX.2-dev stacks (Mistral Small 3's `text_encoder_out_layers`).
pub const FLUX2_DEV_LAYERS: [usize; 3] = [10, 20, 30];
/// The hidden states FLUX.2-klein stacks (Qwen3's `text_encoder_out_layers`).
pub const FLUX2_KLEIN_LAYERS: [usize; 3] = [9, 18, 27];

/// The decoder's hidden states `layers` of each caption, concatenated per token
/// (`prompt_embeds`, `[tokens, layers.len() · hidden]` each, in the model's dtype),
/// `batch_size` captions at a time. `tokenizer` is the decoder's, whose length is the pipeline's
/// `max_sequence_length` (512); `layers` are [`FLUX2_DEV_LAYERS`] or [`FLUX2_KLEIN_LAYERS`].
pub fn encode_flux2_text<B: Kernels>(
    tokenizer: &PromptTokenizer,
    decoder: TextDecoder<B>,
    captions: &[&str],
    layers: &[usize],
    batch_size: usize,
) -> Result<Vec<TensorData>, LoadError> {
    let devices = decoder.devices();
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let tokens = tokenizer.encode_tensors::<B>(batch, &devices[0])?;
        let hidden = decoder.hidden_states(tokens.input_ids, tokens.attention_mask, layers);
        out.extend(
            hidden
                .iter_dim(0)
                .map(|row| row.squeeze_dim::<2>(0).into_data()),
        );
    }
    release(decoder, &devices);
    Ok(out)
}
