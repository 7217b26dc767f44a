//! Quantization of whole tensors on the CPU, in parallel on all cores. The loops are generic over
//! the source type and written so that LLVM vectorises them on the x86-64 baseline (SSE2).

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

    /// The values converted to `f32`, exactly (a bf16 NaN keeps its payload bit for bit).
    pub fn to_f32_vec(&self) -> Vec<f32> {
        match self.dtype {
            FloatDtype::F32 => values::<f32>(self.bytes),
            FloatDtype::F16 => values::<f16>(self.bytes),
            FloatDtype::BF16 => values::<bf16>(self.bytes),
        }
    }
}

/// Values per parallel task when one scale covers many rows.
const CHUNK: usize = 1 << 16;

/// How the quantizer reads the little-endian elements of one [`FloatDtype`]: the hot loops are
/// generic over it, so each source type gets its own loops, without a dispatch per element.
trait Element {
    /// The bytes of one element.
    type Raw: Copy + Send + Sync;
    /// The bit pattern of a magnitude (sign cleared), as a signed integer whose top bit is
    /// clear (`Default` is zero): for non-negative floats, integer order is the order of the
    /// values, so the absolute maximum is an integer maximum, in SSE2's signed comparisons.
    type Magnitude: Copy + Ord + Default;
    /// The magnitude of infinity: every magnitude from it up is not finite.
    const INFINITY: Self::Magnitude;

    /// The elements of `bytes` (a whole number of them).
    fn elements(bytes: &[u8]) -> &[Self::Raw];
    /// One element, exactly, as `f32`.
    fn value(raw: Self::Raw) -> f32;
    /// One element's magnitude.
    fn magnitude(raw: Self::Raw) -> Self::Magnitude;
    /// A finite magnitude, exactly, as `f32`.
    fn magnitude_value(magnitude: Self::Magnitude) -> f32;
}

impl Element for f32 {
    type Raw = [u8; 4];
    type Magnitude = i32;
    const INFINITY: i32 = 0x7f80_0000;

    fn elements(bytes: &[u8]) -> &[[u8; 4]] {
        bytes.as_chunks().0
    }
    #[inline(always)]
    fn value(raw: [u8; 4]) -> f32 {
        f32::from_le_bytes(raw)
    }
    #[inline(always)]
    fn magnitude(raw: [u8; 4]) -> i32 {
        i32::from_le_bytes(raw) & 0x7fff_ffff
    }
    fn magnitude_value(magnitude: i32) -> f32 {
        f32::from_bits(magnitude as u32)
    }
}

impl Element for f16 {
    type Raw = [u8; 2];
    type Magnitude = i16;
    const INFINITY: i16 = 0x7c00;

    fn elements(bytes: &[u8]) -> &[[u8; 2]] {
        bytes.as_chunks().0
    }
    #[inline(always)]
    fn value(raw: [u8; 2]) -> f32 {
        f16::from_le_bytes(raw).to_f32()
    }
    #[inline(always)]
    fn magnitude(raw: [u8; 2]) -> i16 {
        i16::from_le_bytes(raw) & 0x7fff
    }
    fn magnitude_value(magnitude: i16) -> f32 {
        f16::from_bits(magnitude as u16).to_f32()
    }
}

impl Element for bf16 {
    type Raw = [u8; 2];
    type Magnitude = i16;
    const INFINITY: i16 = 0x7f80;

    fn elements(bytes: &[u8]) -> &[[u8; 2]] {
        bytes.as_chunks().0
    }
    #[inline(always)]
    fn value(raw: [u8; 2]) -> f32 {
        // A bf16 is the top half of an f32: widening is a shift (NaN payloads kept as they are).
        f32::from_bits(u32::from(u16::from_le_bytes(raw)) << 16)
    }
    #[inline(always)]
    fn magnitude(raw: [u8; 2]) -> i16 {
        i16::from_le_bytes(raw) & 0x7fff
    }
    fn magnitude_value(magnitude: i16) -> f32 {
        bf16::from_bits(magnitude as u16).to_f32()
    }
}

/// Every element of `bytes` as `f32`.
fn values<E: Element>(bytes: &[u8]) -> Vec<f32> {
    E::elements(bytes)
        .iter()
        .map(|&raw| E::value(raw))
        .collect()
}

/// The largest finite magnitude of `src` (0 when there is none), found on the bit patterns.
#[inline(always)]
fn amax<E: Element>(src: &[E::Raw]) -> f32 {
    let zero = E::Magnitude::default();
    let max = src
        .iter()
        .map(|&raw| E::magnitude(raw))
        .map(|m| if m < E::INFINITY { m } else { zero })
        .fold(zero, Ord::max);
    E::magnitude_value(max)
}

/// Values widened to `f32` at a time before they are encoded: a loop of loads alone keeps many
/// cache misses in flight, and the arithmetic then reads the tile from L1.
const TILE: usize = 256;

/// Writes `format.encode(value / scale)` for every value of `src` into `out` (same length),
/// through `tile`.
#[inline(always)]
fn encode<E: Element>(
    src: &[E::Raw],
    format: Fp8Format,
    scale: f32,
    out: &mut [u8],
    tile: &mut [f32; TILE],
) {
    // One loop per format, each with its format's constants folded in.
    match format {
        Fp8Format::E5M2 => encode_as::<E>(src, Fp8Format::E5M2, scale, out, tile),
        Fp8Format::E4M3 => encode_as::<E>(src, Fp8Format::E4M3, scale, out, tile),
    }
}

/// [`encode`] for a format known where it is inlined.
#[inline(always)]
fn encode_as<E: Element>(
    src: &[E::Raw],
    format: Fp8Format,
    scale: f32,
    out: &mut [u8],
    tile: &mut [f32; TILE],
) {
    for (src, out) in src.chunks(TILE).zip(out.chunks_mut(TILE)) {
        let tile = &mut tile[..src.len()];
        for (t, &raw) in tile.iter_mut().zip(src) {
            *t = E::value(raw);
        }
        for (o, &value) in out.iter_mut().zip(&*tile) {
            *o = format.encode(value / scale);
        }
    }
}

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
        let scales = match values.dtype {
            FloatDtype::F32 => {
                quantize_as::<f32>(values.bytes, layout, format, granularity, &mut data)
            }
            FloatDtype::F16 => {
                quantize_as::<f16>(values.bytes, layout, format, granularity, &mut data)
            }
            FloatDtype::BF16 => {
                quantize_as::<bf16>(values.bytes, layout, format, granularity, &mut data)
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

/// [`Fp8Tensor::quantize`] for one source type: writes the codes into `data` and returns the
/// scales.
fn quantize_as<E: Element>(
    bytes: &[u8],
    layout: ScaleLayout,
    format: Fp8Format,
    granularity: Granularity,
    data: &mut [u8],
) -> Vec<f32> {
    let src = E::elements(bytes);
    match granularity {
        Granularity::None => {
            encode_chunks::<E>(src, format, 1.0, data);
            vec![1.0]
        }
        Granularity::Tensor => {
            let amax = src
                .par_chunks(CHUNK)
                .map(amax::<E>)
                .reduce(|| 0.0, f32::max);
            let scale = scale_for(amax, format);
            encode_chunks::<E>(src, format, scale, data);
            vec![scale]
        }
        Granularity::Row | Granularity::Block64 => quantize_rows::<E>(src, layout, format, data),
    }
}

/// Encodes all values with one scale, in parallel chunks.
fn encode_chunks<E: Element>(src: &[E::Raw], format: Fp8Format, scale: f32, data: &mut [u8]) {
    data.par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(out, src)| encode::<E>(src, format, scale, out, &mut [0.0; TILE]));
}

/// Quantizes row by row (rows in parallel), one scale per block of each row.
fn quantize_rows<E: Element>(
    src: &[E::Raw],
    layout: ScaleLayout,
    format: Fp8Format,
    data: &mut [u8],
) -> Vec<f32> {
    let mut scales = vec![1f32; layout.count()];
    if layout.cols == 0 {
        return scales;
    }
    data.par_chunks_mut(layout.cols)
        .zip(src.par_chunks(layout.cols))
        .zip(scales.par_chunks_mut(layout.blocks_per_row))
        .for_each(|((out, row), row_scales)| {
            let mut tile = [0.0; TILE];
            for ((out, block), scale) in out
                .chunks_mut(layout.block_len)
                .zip(row.chunks(layout.block_len))
                .zip(row_scales)
            {
                *scale = scale_for(amax::<E>(block), format);
                encode::<E>(block, format, *scale, out, &mut tile);
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

    /// Every 16-bit pattern once, as little-endian bytes, with its value as a bf16 and as an
    /// f16 (NaNs, infinities, zeros and subnormals included).
    fn all_16_bit_patterns() -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let bytes = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
        let as_bf16 = (0..=u16::MAX)
            .map(|v| bf16::from_bits(v).to_f32())
            .collect();
        let as_f16 = (0..=u16::MAX).map(|v| f16::from_bits(v).to_f32()).collect();
        (bytes, as_bf16, as_f16)
    }

    /// f32 values with every sign and exponent and scrambled low mantissa bits, so that they
    /// round (NaN payloads, infinities and subnormals included).
    fn f32_patterns() -> Vec<f32> {
        (0..=u16::MAX as u32)
            .map(|v| f32::from_bits(v << 16 | (v.wrapping_mul(0x9e37) & 0xffff)))
            .collect()
    }

    #[test]
    fn every_16_bit_pattern_quantizes_as_the_plain_rule() {
        let (bytes, as_bf16, as_f16) = all_16_bit_patterns();
        // Square, one block per row, and ragged blocks and tiles (675 = 10 * 64 + 35).
        let shapes: [&[usize]; 3] = [&[256, 256], &[1024, 64], &[97, 675]];
        for (dtype, widened) in [(FloatDtype::BF16, &as_bf16), (FloatDtype::F16, &as_f16)] {
            for shape in shapes {
                let n: usize = shape.iter().product();
                let src = FloatBytes::new(dtype, &bytes[..2 * n]).unwrap();
                for format in Fp8Format::ALL {
                    for g in Granularity::ALL {
                        let q = Fp8Tensor::quantize(src, shape, format, g);
                        let r = reference(&widened[..n], shape, format, g);
                        assert_eq!(q, r, "{dtype:?} {shape:?} {format} {g}");
                    }
                }
            }
        }
    }

    #[test]
    fn f32_patterns_quantize_as_the_plain_rule() {
        let values = f32_patterns();
        for shape in [[256, 256], [97, 675]] {
            let values = &values[..shape.iter().product()];
            for format in Fp8Format::ALL {
                for g in Granularity::ALL {
                    let q = Fp8Tensor::quantize(FloatBytes::from_f32(values), &shape, format, g);
                    let r = reference(values, &shape, format, g);
                    assert_eq!(q, r, "{shape:?} {format} {g}");
                }
            }
        }
    }

    /// The encoding loop against `Fp8Format::encode` one value at a time, at scales that do not
    /// come from a block's maximum (overflowing, underflowing, not powers of two).
    #[test]
    fn encoding_loop_matches_the_definition_at_any_scale() {
        let (bytes, as_bf16, as_f16) = all_16_bit_patterns();
        let f32s = f32_patterns();
        let scales = [1.0, 0.75, 3.0e-3, 1.5e5, 2f32.powi(-30), 7.0e30, 1.0e-40];
        let mut tile = [0.0; TILE];
        for format in Fp8Format::ALL {
            for scale in scales {
                let expected = |values: &[f32]| -> Vec<u8> {
                    values.iter().map(|&v| format.encode(v / scale)).collect()
                };
                let mut out = vec![0u8; 1 << 16];
                encode::<bf16>(bf16::elements(&bytes), format, scale, &mut out, &mut tile);
                assert_eq!(out, expected(&as_bf16), "bf16 {format} {scale:e}");
                encode::<f16>(f16::elements(&bytes), format, scale, &mut out, &mut tile);
                assert_eq!(out, expected(&as_f16), "f16 {format} {scale:e}");
                let f32_bytes = bytemuck::cast_slice(&f32s);
                encode::<f32>(f32::elements(f32_bytes), format, scale, &mut out, &mut tile);
                assert_eq!(out, expected(&f32s), "f32 {format} {scale:e}");
            }
        }
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
