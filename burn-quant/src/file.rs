//! Quantizing a whole checkpoint file to scaled FP8, streaming, and reading such files back.

use std::collections::HashSet;
use std::path::Path;

use regex::Regex;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, StreamingWriter, TensorEntry, TensorHeader};
use crate::error::QuantError;
use crate::format::Fp8Format;
use crate::quantize::{FloatBytes, FloatDtype, Fp8Spec, Fp8Tensor};
use crate::scale::Granularity;

/// Metadata key that records the FP8 format of a quantized file.
pub const FORMAT_KEY: &str = "fp8_format";
/// Metadata key that records the scale granularity of a quantized file.
pub const SCALE_KEY: &str = "fp8_scale";

/// What `quantize_checkpoint` does.
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// The 8-bit format.
    pub format: Fp8Format,
    /// Which values share a scale.
    pub granularity: Granularity,
    /// Only tensors whose key matches are quantized (all when `None`).
    pub include: Option<Regex>,
    /// Tensors whose key matches are copied unchanged.
    pub exclude: Option<Regex>,
}

/// What `quantize_checkpoint` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Tensors written as FP8.
    pub quantized: usize,
    /// Tensors copied unchanged.
    pub copied: usize,
    /// Bytes of tensor data read.
    pub bytes_in: u64,
    /// Bytes of tensor data written (payloads and scales).
    pub bytes_out: u64,
}

/// The key of the scale tensor stored beside `key`: `a.b.weight` → `a.b.scale_weight`.
pub fn scale_key(key: &str) -> String {
    format!(
        "{}.scale_weight",
        key.strip_suffix(".weight").unwrap_or(key)
    )
}

/// Quantizes every floating tensor of rank ≥ 2 selected by the options and copies the others,
/// from `input` (a file, a shard index, or a folder) to the single file `output`.
///
/// Tensors are read from memory maps and written one at a time, so the resident memory is
/// about one tensor, whatever the checkpoint's size. The output is written atomically.
/// A tensor that `include` selects by name but that is not floating-point is an error.
pub fn quantize_checkpoint(
    input: &Path,
    output: &Path,
    options: &QuantizeOptions,
) -> Result<QuantizeReport, QuantError> {
    let ckpt = Checkpoint::open(input)?;
    let plan = ckpt
        .tensors()
        .map(|t| plan_tensor(&t, options))
        .collect::<Result<Vec<_>, _>>()?;

    let mut headers = Vec::new();
    for (t, source) in ckpt.tensors().zip(&plan) {
        match source {
            Some(_) => {
                headers.push(TensorHeader {
                    name: t.name.to_string(),
                    dtype: options.format.safetensors_dtype(),
                    shape: t.shape.to_vec(),
                });
                if let Some(shape) = options.granularity.scale_shape(t.shape) {
                    headers.push(TensorHeader {
                        name: scale_key(t.name),
                        dtype: Dtype::F32,
                        shape,
                    });
                }
            }
            None => headers.push(TensorHeader {
                name: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
            }),
        }
    }
    let mut names = HashSet::new();
    for h in &headers {
        if !names.insert(h.name.as_str()) {
            return Err(QuantError::DuplicateKey {
                file: output.to_path_buf(),
                key: h.name.clone(),
            });
        }
    }

    let mut metadata = ckpt.metadata();
    metadata.insert(FORMAT_KEY.into(), options.format.name().into());
    metadata.insert(SCALE_KEY.into(), options.granularity.name().into());
    let mut writer = StreamingWriter::create(output, headers, metadata)?;
    let mut report = QuantizeReport::default();
    for (t, source) in ckpt.tensors().zip(plan) {
        report.bytes_in += t.data.len() as u64;
        match source {
            Some(values) => {
                let q = Fp8Tensor::quantize(values, t.shape, options.format, options.granularity);
                writer.write(t.name, &q.data)?;
                report.bytes_out += q.data.len() as u64;
                if options.granularity != Granularity::None {
                    let scales: &[u8] = bytemuck::cast_slice(&q.scales);
                    writer.write(&scale_key(t.name), scales)?;
                    report.bytes_out += scales.len() as u64;
                }
                report.quantized += 1;
            }
            None => {
                writer.write(t.name, t.data)?;
                report.bytes_out += t.data.len() as u64;
                report.copied += 1;
            }
        }
        ckpt.release(&t);
    }
    writer.finish()?;
    Ok(report)
}

/// The values to quantize, or `None` to copy the tensor unchanged.
fn plan_tensor<'a>(
    t: &TensorEntry<'a>,
    options: &QuantizeOptions,
) -> Result<Option<FloatBytes<'a>>, QuantError> {
    let included = options.include.as_ref().map(|r| r.is_match(t.name));
    let excluded = options.exclude.as_ref().is_some_and(|r| r.is_match(t.name));
    if excluded || included == Some(false) {
        return Ok(None);
    }
    match FloatDtype::from_safetensors(t.dtype) {
        Some(dtype) if t.shape.len() >= 2 => FloatBytes::new(dtype, t.data)
            .map(Some)
            .ok_or_else(|| QuantError::corrupt(t.file, format!("`{}` has a ragged size", t.name))),
        Some(_) => Ok(None),
        None if included == Some(true) => Err(QuantError::NotFloat {
            file: t.file.to_path_buf(),
            key: t.name.to_string(),
            dtype: t.dtype,
        }),
        None => Ok(None),
    }
}

/// Reads the FP8 tensor stored under `key` (with its `scale_weight`, if any) from a checkpoint.
///
/// Returns `None` when the tensor is not stored as FP8. The granularity is inferred from the
/// scale's shape: none, a single value, one per row, or one per 64 values of a row.
pub fn read_fp8(ckpt: &Checkpoint, key: &str) -> Result<Option<Fp8Tensor>, QuantError> {
    let Some(t) = ckpt.get(key) else {
        return Ok(None);
    };
    let Some(format) = Fp8Format::from_safetensors_dtype(t.dtype) else {
        return Ok(None);
    };
    let (granularity, scales) = match ckpt.get(&scale_key(key)) {
        None => (Granularity::None, vec![1.0]),
        Some(s) => {
            let scales: Vec<f32> = match FloatDtype::from_safetensors(s.dtype) {
                Some(dtype) => FloatBytes::new(dtype, s.data)
                    .map(|b| b.to_f32_vec())
                    .unwrap_or_default(),
                None => Vec::new(),
            };
            let granularity = [Granularity::Tensor, Granularity::Row, Granularity::Block64]
                .into_iter()
                .find(|g| g.layout(t.shape).count() == scales.len())
                .ok_or_else(|| {
                    QuantError::corrupt(
                        s.file,
                        format!(
                            "`{}` has {} scales, which fits no granularity for shape {:?}",
                            s.name,
                            scales.len(),
                            t.shape
                        ),
                    )
                })?;
            (granularity, scales)
        }
    };
    Ok(Some(Fp8Tensor {
        spec: Fp8Spec {
            format,
            granularity,
            shape: t.shape.to_vec(),
        },
        data: t.data.to_vec(),
        scales,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_keys() {
        assert_eq!(
            scale_key("double_blocks.0.img_attn.qkv.weight"),
            "double_blocks.0.img_attn.qkv.scale_weight"
        );
        assert_eq!(scale_key("pos_embed"), "pos_embed.scale_weight");
    }
}
