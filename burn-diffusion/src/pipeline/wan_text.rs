//! Wan's caption encoding, as `WanPipeline.encode_prompt`: umT5's last hidden state with the
//! padding masked out, cut to each caption's own tokens.

// ref: huggingface/diffusers@v0.42.1 src/diffusers/pipelines/wan/pipeline_wan.py (_get_t5_prompt_embeds)

use burn::module::Module;
use burn::tensor::{Int, Tensor, TensorData};
use burn_kernels::Kernels;

use super::flux_text::release;
use crate::error::LoadError;
use crate::t5::T5Encoder;
use crate::tokenize::CaptionTokenizer;

/// umT5's last hidden state of each caption over its own tokens (`[tokens, d_model]` each, in
/// the model's dtype, `</s>` included), the padding masked out of the attention,
/// `batch_size` captions at a time. `tokenizer` is umT5's, whose length is the pipeline's
/// `max_sequence_length` (512). The pipeline pads each row back to that length with zeros;
/// the trainer does so when it batches.
pub fn encode_wan_prompt<B: Kernels>(
    tokenizer: &CaptionTokenizer,
    encoder: T5Encoder<B>,
    captions: &[&str],
    batch_size: usize,
) -> Result<Vec<TensorData>, LoadError> {
    let devices = encoder.devices();
    let device = &devices[0];
    let mut out = Vec::with_capacity(captions.len());
    for batch in captions.chunks(batch_size.max(1)) {
        let (ids, mask) = tokenizer.encode_masked(batch)?;
        let lengths: Vec<usize> = mask
            .iter()
            .map(|row| row.iter().filter(|&&m| m != 0).count())
            .collect();
        let [ids, mask] = [ids, mask].map(|rows| {
            let flat: Vec<i64> = rows.iter().flatten().map(|&v| i64::from(v)).collect();
            Tensor::<B, 2, Int>::from_data(
                TensorData::new(flat, [batch.len(), tokenizer.length()]),
                device,
            )
        });
        let hidden = encoder.forward_masked(ids, mask);
        out.extend(
            hidden
                .iter_dim(0)
                .zip(lengths)
                .map(|(row, length)| row.squeeze_dim::<2>(0).narrow(0, 0, length).into_data()),
        );
    }
    release(encoder, &devices);
    Ok(out)
}
