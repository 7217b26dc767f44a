//! The device dequantization kernel for CubeCL backends (CUDA, wgpu).
//!
//! The codes travel as `u32` words (four codes each, little-endian), so the kernel reads only
//! 32-bit words and decodes with integer operations: it needs no FP8 type support on the
//! device and runs the same on CUDA and WGSL.

use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;
use cubecl::server::Handle;
use cubecl::{calculate_cube_count_elemwise, client::ComputeClient};

use crate::backend::Fp8Backend;
use crate::format::Fp8Format;
use crate::quantize::{Fp8Spec, Fp8Tensor};

#[cube]
fn decode(code: u32, #[comptime] e4m3: bool) -> f32 {
    let mantissa_bits = comptime!(if e4m3 { 3u32 } else { 2u32 });
    let exponent_max = comptime!(if e4m3 { 15u32 } else { 31u32 });
    let rebias = comptime!(if e4m3 { 120u32 } else { 112u32 });
    let subnormal_step = comptime!(if e4m3 {
        1.0f32 / 512.0
    } else {
        1.0f32 / 65536.0
    });

    let sign = (code & 0x80u32) << 24u32;
    let exponent = (code >> mantissa_bits) & exponent_max;
    let mantissa = code & ((1u32 << mantissa_bits) - 1u32);
    let mut bits = ((exponent + rebias) << 23u32) | (mantissa << (23u32 - mantissa_bits));
    if exponent == 0u32 {
        bits = u32::reinterpret(f32::cast_from(mantissa) * subnormal_step);
    }
    if comptime!(e4m3) {
        if (code & 0x7fu32) == 0x7fu32 {
            bits = 0x7fc0_0000u32;
        }
    } else if exponent == exponent_max {
        bits = if mantissa == 0u32 {
            0x7f80_0000u32
        } else {
            0x7fc0_0000u32
        };
    }
    f32::reinterpret(bits | sign)
}

/// Decodes one `u32` word of codes per unit. Where every word lies within one row and one
/// scale block (`whole_words`), the unit reads its scale once and writes its four values as one
/// vector (`N` = 4); otherwise (`N` = 1) each value finds its own scale and is written alone.
#[cube(launch)]
fn dequantize_kernel<F: Float, N: Size>(
    words: &Array<u32>,
    scales: &Array<f32>,
    output: &mut Array<Vector<F, N>>,
    numel: usize,
    cols: usize,
    block_len: usize,
    blocks_per_row: usize,
    #[comptime] e4m3: bool,
    #[comptime] whole_words: bool,
    #[define(F)] _dtype: StorageType,
) {
    let word_index = ABSOLUTE_POS;
    if word_index >= words.len() {
        terminate!();
    }
    let word = words[word_index];
    let first = word_index * 4;
    if whole_words {
        let scale = scales[(first / cols) * blocks_per_row + (first % cols) / block_len];
        let mut values = Vector::<F, N>::empty();
        #[unroll]
        for k in 0..4usize {
            let code = (word >> (8u32 * k as u32)) & 0xffu32;
            values[k] = F::cast_from(decode(code, e4m3) * scale);
        }
        output[word_index] = values;
    } else {
        #[unroll]
        for k in 0..4usize {
            let i = first + k;
            if i < numel {
                let code = (word >> (8u32 * k as u32)) & 0xffu32;
                let scale = scales[(i / cols) * blocks_per_row + (i % cols) / block_len];
                output[i] = Vector::cast_from(decode(code, e4m3) * scale);
            }
        }
    }
}

/// Decodes FP8 codes already on the device into a new contiguous float tensor.
///
/// `codes` holds `ceil(numel / 4)` little-endian `u32` words (the codes in row-major order,
/// zero-padded to a multiple of four bytes); `scales` holds `layout.count()` f32 values.
/// This is the entry point for callers that upload the codes themselves (e.g. into a ring of
/// device buffers); [`Fp8Backend::fp8_dequantize`] uploads and calls it.
pub fn dequantize_codes<R: CubeRuntime>(
    client: &ComputeClient<R>,
    device: &R::Device,
    codes: Handle,
    scales: Handle,
    spec: &Fp8Spec,
    dtype: FloatDType,
) -> CubeTensor<R> {
    let numel = spec.numel();
    let layout = spec.layout();
    let words = numel.div_ceil(4);
    let dtype = DType::from(dtype);
    let output = empty_device_contiguous_dtype(
        client.clone(),
        device.clone(),
        Shape::from(spec.shape.clone()),
        dtype,
    );
    if numel == 0 {
        return output;
    }
    let cols = layout.cols.max(1);
    let block_len = layout.block_len.max(1);
    // Rows and scale blocks of whole words: each word's four values share one scale.
    let whole_words = cols.is_multiple_of(4) && block_len.is_multiple_of(4);
    let vector_size = if whole_words { 4 } else { 1 };
    let cube_dim = CubeDim::new(client, words);
    let cube_count = calculate_cube_count_elemwise(client, words, cube_dim);
    // SAFETY: the lengths given match the buffers' sizes: `words` u32 words of codes and
    // `layout.count()` f32 scales, checked by the callers, and `numel` outputs just allocated
    // (`numel / 4` vectors of four where rows are whole words, so `numel` is a multiple of 4).
    let (codes, scales, out) = unsafe {
        (
            ArrayArg::from_raw_parts(codes, words),
            ArrayArg::from_raw_parts(scales, layout.count()),
            ArrayArg::from_raw_parts(output.handle.clone(), numel / vector_size),
        )
    };
    dequantize_kernel::launch(
        client,
        cube_count,
        cube_dim,
        vector_size,
        codes,
        scales,
        out,
        numel,
        cols,
        block_len,
        layout.blocks_per_row,
        spec.format == Fp8Format::E4M3,
        whole_words,
        dtype.into(),
    );
    output
}

/// The codes of `tensor` as bytes padded to whole `u32` words.
pub fn padded_codes(tensor: &Fp8Tensor) -> Vec<u8> {
    let mut bytes = tensor.data.clone();
    bytes.resize(tensor.data.len().next_multiple_of(4), 0);
    bytes
}

impl<R, F, I, BT> Fp8Backend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn fp8_dequantize(tensor: &Fp8Tensor, device: &R::Device, dtype: FloatDType) -> CubeTensor<R> {
        let client = R::client(device);
        let codes = client.create_from_slice(&padded_codes(tensor));
        let scales = client.create_from_slice(bytemuck::cast_slice(&tensor.scales));
        dequantize_codes(&client, device, codes, scales, &tensor.spec, dtype)
    }
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::FloatDType;

    use crate::{FloatBytes, Fp8Format, Fp8Tensor, Granularity, dequantize};

    type Gpu = burn::backend::wgpu::Wgpu;

    /// The device decodes every format and granularity as the CPU does, bit for bit, in shapes
    /// whose rows are whole words (one scale and one vector store per word) and shapes whose
    /// rows, scale blocks or length split words.
    #[test]
    fn the_device_decodes_as_the_cpu_does() {
        let device = Default::default();
        for shape in [[6, 128], [3, 136], [5, 7], [2, 130], [1, 9]] {
            let numel = shape[0] * shape[1];
            // Signed zeros, values that underflow to subnormal codes, NaN and infinities
            // among values spread over 2^-14 .. 2^8.
            let values: Vec<f32> = (0..numel)
                .map(|i| match i % 31 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => f32::NAN,
                    3 => f32::INFINITY,
                    4 => f32::NEG_INFINITY,
                    5 => 3e-7,
                    _ => (i as f32 * 0.37).cos() * 2f32.powi((i % 23) as i32 - 14),
                })
                .collect();
            for format in Fp8Format::ALL {
                for granularity in Granularity::ALL {
                    let q = Fp8Tensor::quantize(
                        FloatBytes::from_f32(&values),
                        &shape,
                        format,
                        granularity,
                    );
                    let device_values: Vec<f32> =
                        dequantize::<Gpu, 2>(&q, &device, FloatDType::F32)
                            .into_data()
                            .to_vec()
                            .unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&device_values),
                        bits(&q.dequantize()),
                        "{format} {granularity} {shape:?}"
                    );
                }
            }
        }
    }
}
