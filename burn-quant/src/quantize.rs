//! Quantization of whole tensors on the CPU, in parallel on all cores.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::format::Fp8Format;
use crate::scale::{Granularity, ScaleLayout, scale_for};

/// The element type of a floating-point source tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDtype {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
}

impl FloatDtype {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            FloatDtype::F32 => 4,
            FloatDtype::F16 | FloatDtype::BF16 => 2,
        }
    }

    /// The dtype of a safetensors tensor, if it is one of these three.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F32 => Some(FloatDtype::F32),
            safetensors::Dtype::F16 => Some(FloatDtype::F16),
            safetensors::Dtype::BF16 => Some(FloatDtype::BF16),
            _ => None,
        }
    }
}

/// Little-endian floating-point values, borrowed (typically from a memory-mapped file, so no
/// alignment is assumed).
#[derive(Clone, Copy, Debug)]
pub struct FloatBytes<'a> {
    dtype: FloatDtype,
    bytes: &'a [u8],
}

impl<'a> FloatBytes<'a> {
    /// Wraps `bytes`; `None` when their length is not a whole number of elements.
    pub fn new(dtype: FloatDtype, bytes: &'a [u8]) -> Option<Self> {
        bytes
            .len()
            .is_multiple_of(dtype.size())
            .then_some(Self { dtype, bytes })
    }

    /// Wraps `f32` values.
    pub fn from_f32(values: &'a [f32]) -> Self {
        Self {
            dtype: FloatDtype::F32,
            bytes: bytemuck::cast_slice(values),
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The values converted to `f32`.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len());
        self.for_each_tile(|_, tile| out.extend_from_slice(tile));
        out
    }

    fn slice(&self, start: usize, end: usize) -> FloatBytes<'a> {
        let size = self.dtype.size();
        Self {
            dtype: self.dtype,
            bytes: &self.bytes[start * size..end * size],
        }
    }

    /// Calls `f` on the values converted to `f32` (exactly), in tiles of at most [`TILE`].
    fn for_each_tile(&self, mut f: impl FnMut(usize, &[f32])) {
        let mut tile = [0f32; TILE];
        let size = self.dtype.size();
        for (t, chunk) in self.bytes.chunks(TILE * size).enumerate() {
            let n = chunk.len() / size;
            let out = &mut tile[..n];
            match self.dtype {
                FloatDtype::F32 => {
                    for (o, b) in out.iter_mut().zip(chunk.chunks_exact(4)) {
                        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    }
                }
                FloatDtype::F16 => {
                    for (o, b) in out.iter_mut().zip(chunk.chunks_exact(2)) {
                        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                }
                FloatDtype::BF16 => {
                    for (o, b) in out.iter_mut().zip(chunk.chunks_exact(2)) {
                        *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                    }
                }
            }
            f(t * TILE, out);
        }
    }

    /// The largest finite magnitude (0 when there is none).
    fn amax(&self) -> f32 {
        let mut amax = 0f32;
        self.for_each_tile(|_, tile| {
            amax = tile
                .iter()
                .map(|v| v.abs())
                .filter(|a| a.is_finite())
                .fold(amax, f32::max);
        });
        amax
    }

    /// Writes `encode(value / scale)` for every value into `out` (same length).
    fn encode_into(&self, format: Fp8Format, scale: f32, out: &mut [u8]) {
        self.for_each_tile(|start, tile| {
            for (o, &v) in out[start..start + tile.len()].iter_mut().zip(tile) {
                *o = format.encode(v / scale);
            }
        });
    }
}

/// Values converted per tile (keeps the working set in L1).
const TILE: usize = 1024;

/// Values per parallel task when one scale covers many rows.
const CHUNK: usize = 1 << 16;

/// What an FP8 payload holds: its format, scale granularity and shape (everything but the
/// bytes, so it can describe codes that live elsewhere, e.g. on a device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fp8Spec {
    /// The 8-bit format of the codes.
    pub format: Fp8Format,
    /// How the scales map onto the codes.
    pub granularity: Granularity,
    /// The tensor's shape (row-major).
    pub shape: Vec<usize>,
}

impl Fp8Spec {
    /// The number of values.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The scale grid.
    pub fn layout(&self) -> ScaleLayout {
        self.granularity.layout(&self.shape)
    }
}

/// A tensor quantized to FP8: one byte per value, plus its scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Tensor {
    /// Format, granularity and shape.
    pub spec: Fp8Spec,
    /// One code per value.
    pub data: Vec<u8>,
    /// The scales (a single 1.0 for [`Granularity::None`]); value = decode(code) × scale.
    pub scales: Vec<f32>,
}

impl Fp8Tensor {
    /// Quantizes `values` of the given shape: each value becomes `encode(value / scale)`, where
    /// a block's scale is its largest finite magnitude divided by the format's maximum.
    ///
    /// # Panics
    /// If the shape does not match the number of values.
    pub fn quantize(
        values: FloatBytes<'_>,
        shape: &[usize],
        format: Fp8Format,
        granularity: Granularity,
    ) -> Self {
        let numel: usize = shape.iter().product();
        assert_eq!(
            numel,
            values.len(),
            "shape {shape:?} does not match the values"
        );
        let layout = granularity.layout(shape);
        let mut data = vec![0u8; numel];
        let scales = match granularity {
            Granularity::None => {
                encode_chunks(values, format, 1.0, &mut data);
                vec![1.0]
            }
            Granularity::Tensor => {
                let amax = (0..numel.div_ceil(CHUNK))
                    .into_par_iter()
                    .map(|c| values.slice(c * CHUNK, ((c + 1) * CHUNK).min(numel)).amax())
                    .reduce(|| 0.0, f32::max);
                let scale = scale_for(amax, format);
                encode_chunks(values, format, scale, &mut data);
                vec![scale]
            }
            Granularity::Row | Granularity::Block64 => {
                quantize_rows(values, layout, format, &mut data)
            }
        };
        Self {
            spec: Fp8Spec {
                format,
                granularity,
                shape: shape.to_vec(),
            },
            data,
            scales,
        }
    }

    /// Decodes every value to `f32`: `decode(code) × scale`.
    pub fn dequantize(&self) -> Vec<f32> {
        let layout = self.spec.layout();
        let table = self.spec.format.table();
        let mut out = vec![0f32; self.data.len()];
        out.par_chunks_mut(CHUNK)
            .zip(self.data.par_chunks(CHUNK))
            .enumerate()
            .for_each(|(c, (out, codes))| {
                for (i, (o, &code)) in out.iter_mut().zip(codes).enumerate() {
                    *o = table[code as usize] * self.scales[layout.index_of(c * CHUNK + i)];
                }
            });
        out
    }
}

/// Encodes all values with one scale, in parallel chunks.
fn encode_chunks(values: FloatBytes<'_>, format: Fp8Format, scale: f32, data: &mut [u8]) {
    data.par_chunks_mut(CHUNK).enumerate().for_each(|(c, out)| {
        let start = c * CHUNK;
        values
            .slice(start, start + out.len())
            .encode_into(format, scale, out);
    });
}

/// Quantizes row by row (rows in parallel), one scale per block of each row.
fn quantize_rows(
    values: FloatBytes<'_>,
    layout: ScaleLayout,
    format: Fp8Format,
    data: &mut [u8],
) -> Vec<f32> {
    let mut scales = vec![1f32; layout.count()];
    if layout.cols == 0 {
        return scales;
    }
    data.par_chunks_mut(layout.cols)
        .zip(scales.par_chunks_mut(layout.blocks_per_row))
        .enumerate()
        .for_each(|(row, (out, row_scales))| {
            let row_start = row * layout.cols;
            for (b, (block_out, scale)) in out
                .chunks_mut(layout.block_len)
                .zip(row_scales.iter_mut())
                .enumerate()
            {
                let start = row_start + b * layout.block_len;
                let block = values.slice(start, start + block_out.len());
                *scale = scale_for(block.amax(), format);
                block.encode_into(format, *scale, block_out);
            }
        });
    scales
}

#[cfg(test)]
mod tests {
    use super::*;

    /// f64 reference of the whole rule, written without the fast paths above.
    fn reference(values: &[f32], shape: &[usize], format: Fp8Format, g: Granularity) -> Fp8Tensor {
        let layout = g.layout(shape);
        let mut amax = vec![0f32; layout.count()];
        for (i, v) in values.iter().enumerate() {
            if v.is_finite() {
                let s = &mut amax[layout.index_of(i)];
                *s = s.max(v.abs());
            }
        }
        let scales: Vec<f32> = match g {
            Granularity::None => vec![1.0],
            _ => amax.iter().map(|&a| scale_for(a, format)).collect(),
        };
        let data = values
            .iter()
            .enumerate()
            .map(|(i, &v)| format.encode(v / scales[layout.index_of(i)]))
            .collect();
        Fp8Tensor {
            spec: Fp8Spec {
                format,
                granularity: g,
                shape: shape.to_vec(),
            },
            data,
            scales,
        }
    }

    fn sample(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.37).sin() * (1.0 + (i % 97) as f32)).powi(3))
            .collect()
    }

    #[test]
    fn parallel_paths_equal_the_plain_rule() {
        let shape = [300, 2, 97];
        let values = sample(300 * 2 * 97);
        for format in Fp8Format::ALL {
            for g in Granularity::ALL {
                let q = Fp8Tensor::quantize(FloatBytes::from_f32(&values), &shape, format, g);
                assert_eq!(q, reference(&values, &shape, format, g), "{format} {g}");
            }
        }
    }

    #[test]
    fn bf16_and_f16_sources_convert_exactly() {
        let values = sample(4096);
        let as_bf16: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        let widened: Vec<f32> = as_bf16.iter().map(|v| v.to_f32()).collect();
        let bytes: Vec<u8> = as_bf16.iter().flat_map(|v| v.to_le_bytes()).collect();
        let src = FloatBytes::new(FloatDtype::BF16, &bytes).unwrap();
        let q = Fp8Tensor::quantize(src, &[64, 64], Fp8Format::E4M3, Granularity::Block64);
        let r = Fp8Tensor::quantize(
            FloatBytes::from_f32(&widened),
            &[64, 64],
            Fp8Format::E4M3,
            Granularity::Block64,
        );
        assert_eq!(q, r);
    }

    #[test]
    fn dequantized_values_are_within_half_a_step() {
        let values = sample(128 * 256);
        let q = Fp8Tensor::quantize(
            FloatBytes::from_f32(&values),
            &[128, 256],
            Fp8Format::E4M3,
            Granularity::Row,
        );
        for (row, (x, y)) in values
            .chunks(256)
            .zip(q.dequantize().chunks(256))
            .enumerate()
        {
            let scale = q.scales[row] as f64;
            for (&a, &b) in x.iter().zip(y) {
                let err = (a as f64 - b as f64).abs();
                let step = (a as f64).abs().max(scale * 2f64.powi(-6)) * 2f64.powi(-3);
                assert!(err <= step * 0.5 + 1e-12, "{a} vs {b}");
            }
        }
    }
}
