//! FLUX.1's caption encoding, as `FluxPipeline.encode_prompt`: CLIP-L's pooled vector and
//! T5-XXL's last hidden state. Each encoder is loaded, runs over all captions in batches, and is
//! dropped (its device memory handed back) before the function returns, so that T5-XXL does not
//! stay in memory beside the transformer. The backend chooses where it runs: the CPU, a GPU, or
//! a GPU through weight streaming.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux/pipeline_flux.py (encode_prompt)

use std::path::Path;

use burn::tensor::{FloatDType, TensorData, backend::Backend};

use crate::clip::ClipTextModel;
use crate::error::LoadError;
use crate::t5::T5Encoder;
use crate::tokenize::{CLIP_LENGTH, CaptionTokenizer};

/// The pooled CLIP vector of each caption (`pooled_prompt_embeds`, `[hidden]` each, in `dtype`),
/// from a tokenizer folder (FLUX.1's `tokenizer/`) and a text encoder (a pipeline folder or
/// its `text_encoder/`, see [`ClipTextModel::load`]).
pub fn encode_clip_pooled<B: Backend>(
    tokenizer: &Path,
    model: &Path,
    captions: &[&str],
    batch_size: usize,
    device: &B::Device,
    dtype: FloatDType,
) -> Result<Vec<TensorData>, LoadError> {
    let tokenizer = CaptionTokenizer::clip(tokenizer, CLIP_LENGTH)?;
    let encoder = ClipTextModel::<B>::load(model, device, dtype)?;
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let ids = tokenizer.encode_tensor::<B>(batch, device)?;
        let pooled = encoder.forward(ids).pooled;
        out.extend(
            pooled
                .iter_dim(0)
                .map(|row| row.squeeze_dim::<1>(0).into_data()),
        );
    }
    drop(encoder);
    B::memory_cleanup(device);
    Ok(out)
}

/// T5's last hidden state of each caption (`prompt_embeds`, `[max_sequence_length, d_model]`
/// each, in `dtype`), from a tokenizer folder (FLUX.1's `tokenizer_2/`) and an encoder (a
/// pipeline folder, its `text_encoder_2/`, or a single file, see [`T5Encoder::load`]).
/// `max_sequence_length` is 512 for FLUX.1-dev and 256 for schnell.
pub fn encode_t5<B: Backend>(
    tokenizer: &Path,
    model: &Path,
    captions: &[&str],
    max_sequence_length: usize,
    batch_size: usize,
    device: &B::Device,
    dtype: FloatDType,
) -> Result<Vec<TensorData>, LoadError> {
    let tokenizer = CaptionTokenizer::t5(tokenizer, max_sequence_length)?;
    let encoder = T5Encoder::<B>::load(model, device, dtype)?;
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let ids = tokenizer.encode_tensor::<B>(batch, device)?;
        let hidden = encoder.forward(ids);
        out.extend(
            hidden
                .iter_dim(0)
                .map(|row| row.squeeze_dim::<2>(0).into_data()),
        );
    }
    drop(encoder);
    B::memory_cleanup(device);
    Ok(out)
}
