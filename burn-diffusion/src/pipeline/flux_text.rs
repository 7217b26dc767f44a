//! FLUX.1's caption encoding, as `FluxPipeline.encode_prompt`: CLIP-L's pooled vector and
//! T5-XXL's last hidden state, brought back to the host.
//!
//! Each function takes the encoder by value, runs it over all captions in batches and drops it
//! (handing its device memory back) before returning, so that T5-XXL does not stay in memory
//! beside the transformer. Where the encoder runs is the caller's choice of backend: the CPU, a
//! GPU, or a GPU with its weights streamed from host memory (an encoder whose frozen weights
//! were handed to burn-offload).

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/flux/pipeline_flux.py (encode_prompt)

use burn::module::Module;
use burn::tensor::TensorData;
use burn_kernels::Kernels;

use crate::clip::ClipTextModel;
use crate::error::LoadError;
use crate::t5::T5Encoder;
use crate::tokenize::CaptionTokenizer;

/// The pooled CLIP vector of each caption (`pooled_prompt_embeds`, `[hidden]` each, in the
/// model's dtype), `batch_size` captions at a time. `tokenizer` is CLIP's (77 tokens for
/// FLUX.1).
pub fn encode_clip_pooled<B: Kernels>(
    tokenizer: &CaptionTokenizer,
    encoder: ClipTextModel<B>,
    captions: &[&str],
    batch_size: usize,
) -> Result<Vec<TensorData>, LoadError> {
    let devices = encoder.devices();
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let ids = tokenizer.encode_tensor::<B>(batch, &devices[0])?;
        let pooled = encoder.forward(ids).pooled;
        out.extend(
            pooled
                .iter_dim(0)
                .map(|row| row.squeeze_dim::<1>(0).into_data()),
        );
    }
    release(encoder, &devices);
    Ok(out)
}

/// T5's last hidden state of each caption (`prompt_embeds`, `[tokens, d_model]` each, in the
/// model's dtype), `batch_size` captions at a time. `tokenizer` is T5's, whose length is the
/// pipeline's `max_sequence_length` (512 for FLUX.1-dev, 256 for schnell).
pub fn encode_t5<B: Kernels>(
    tokenizer: &CaptionTokenizer,
    encoder: T5Encoder<B>,
    captions: &[&str],
    batch_size: usize,
) -> Result<Vec<TensorData>, LoadError> {
    let devices = encoder.devices();
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let ids = tokenizer.encode_tensor::<B>(batch, &devices[0])?;
        let hidden = encoder.forward(ids);
        out.extend(
            hidden
                .iter_dim(0)
                .map(|row| row.squeeze_dim::<2>(0).into_data()),
        );
    }
    release(encoder, &devices);
    Ok(out)
}

/// Drops a model and hands the memory its devices cached back.
pub(super) fn release<B: Kernels, M: Module<B>>(model: M, devices: &[B::Device]) {
    drop(model);
    for device in devices {
        B::memory_cleanup(device);
    }
}
