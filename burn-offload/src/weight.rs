//! Streamed weights in host memory: their wire encoding and its decoding.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{DType, Shape, TensorData};
use burn_quant::{FloatBytes, FloatDtype, Fp8Format, Fp8Spec, Fp8Tensor, Granularity};
use half::bf16;

use crate::config::WireFormat;
use crate::error::OffloadError;

/// FP8 codes are padded to this many bytes so the scales that follow them start aligned.
pub const CODE_ALIGN: usize = 256;

/// Host memory the device copies weights from (page-locked on CUDA).
pub trait HostMemory: Send + Sync {
    /// The bytes.
    fn bytes(&self) -> &[u8];
}

impl HostMemory for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// How a weight's bytes are laid out in host memory.
#[derive(Clone, Debug, PartialEq)]
pub enum Encoding {
    /// The weight's dtype, row-major.
    Native,
    /// bfloat16, row-major, decoded to the weight's dtype.
    Bf16,
    /// FP8 codes (padded to [`CODE_ALIGN`]) followed by the f32 scales.
    Fp8(Fp8Spec),
}

/// A frozen weight in host memory.
pub struct HostWeight {
    /// Unique in the process.
    pub id: u64,
    /// Its path in the module it came from.
    pub name: String,
    /// Its shape.
    pub shape: Shape,
    /// The dtype the compute receives.
    pub dtype: DType,
    /// The layout of `memory`.
    pub encoding: Encoding,
    /// The wire payload.
    pub memory: Box<dyn HostMemory>,
}

impl std::fmt::Debug for HostWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostWeight")
            .field("id", &self.id)
            .field("name", &self.name)
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field("encoding", &self.encoding)
            .finish()
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The wire payload of a weight, before it moves to host memory of the target.
pub struct Payload {
    /// How `bytes` are laid out.
    pub encoding: Encoding,
    /// The bytes.
    pub bytes: Vec<u8>,
}

impl Payload {
    /// Encodes `data` in `wire` format; payloads below `direct_threshold` bytes stay native.
    pub fn encode(
        name: &str,
        data: TensorData,
        wire: WireFormat,
        direct_threshold: u64,
    ) -> Result<Self, OffloadError> {
        let source = float_dtype(data.dtype).ok_or_else(|| OffloadError::UnsupportedDtype {
            name: name.to_string(),
            dtype: data.dtype,
        })?;
        let small = (data.bytes.len() as u64) < direct_threshold;
        let fp8 = match wire {
            _ if small => None,
            WireFormat::Native => None,
            WireFormat::Bf16 if data.dtype == DType::BF16 => None,
            WireFormat::Bf16 => {
                let bytes = data.convert_dtype(DType::BF16).bytes.to_vec();
                return Ok(Self {
                    encoding: Encoding::Bf16,
                    bytes,
                });
            }
            WireFormat::E5M2 => Some(Fp8Format::E5M2),
            WireFormat::E4M3 => Some(Fp8Format::E4M3),
        };
        let Some(format) = fp8 else {
            return Ok(Self {
                encoding: Encoding::Native,
                bytes: data.bytes.to_vec(),
            });
        };
        let values = FloatBytes::new(source, &data.bytes).expect("whole elements");
        let q = Fp8Tensor::quantize(values, &data.shape, format, Granularity::Block64);
        let mut bytes = q.data;
        bytes.resize(bytes.len().next_multiple_of(CODE_ALIGN), 0);
        bytes.extend_from_slice(bytemuck::cast_slice(&q.scales));
        Ok(Self {
            encoding: Encoding::Fp8(q.spec),
            bytes,
        })
    }
}

fn float_dtype(dtype: DType) -> Option<FloatDtype> {
    match dtype {
        DType::F32 => Some(FloatDtype::F32),
        DType::F16 => Some(FloatDtype::F16),
        DType::BF16 => Some(FloatDtype::BF16),
        _ => None,
    }
}

impl HostWeight {
    /// A weight with a fresh id.
    pub fn new(
        name: String,
        shape: Shape,
        dtype: DType,
        encoding: Encoding,
        memory: Box<dyn HostMemory>,
    ) -> Arc<Self> {
        Arc::new(Self {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            name,
            shape,
            dtype,
            encoding,
            memory,
        })
    }

    /// Bytes the decoded weight occupies on the device.
    pub fn device_bytes(&self) -> usize {
        self.shape.num_elements() * self.dtype.size()
    }

    /// Bytes one upload moves.
    pub fn wire_bytes(&self) -> usize {
        self.memory.bytes().len()
    }

    /// Length of the padded codes of an FP8 payload (where its scales start).
    pub fn codes_len(spec: &Fp8Spec) -> usize {
        spec.numel().next_multiple_of(CODE_ALIGN)
    }

    /// The weight decoded on the host, in its dtype.
    pub fn decode(&self) -> TensorData {
        self.decode_bytes(self.memory.bytes())
    }

    /// The weight decoded on the host from `bytes`, a copy of its wire payload, in its dtype.
    pub fn decode_bytes(&self, bytes: &[u8]) -> TensorData {
        let values: Vec<f32> = match &self.encoding {
            Encoding::Native => {
                return TensorData::from_bytes_vec(bytes.to_vec(), self.shape.clone(), self.dtype);
            }
            Encoding::Bf16 => bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)
                .into_iter()
                .map(f32::from)
                .collect(),
            Encoding::Fp8(spec) => {
                let codes_len = Self::codes_len(spec);
                let q = Fp8Tensor {
                    spec: spec.clone(),
                    data: bytes[..spec.numel()].to_vec(),
                    scales: bytemuck::pod_collect_to_vec(&bytes[codes_len..]),
                };
                q.dequantize()
            }
        };
        TensorData::new(values, self.shape.clone()).convert_dtype(self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(dtype: DType) -> TensorData {
        let values: Vec<f32> = (0..64 * 5)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        TensorData::new(values, [64, 5]).convert_dtype(dtype)
    }

    fn weight(payload: Payload, reference: &TensorData) -> Arc<HostWeight> {
        HostWeight::new(
            "w".into(),
            reference.shape.clone(),
            reference.dtype,
            payload.encoding,
            Box::new(payload.bytes),
        )
    }

    #[test]
    fn native_and_bf16_round_trip_exactly() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let d = data(dtype);
            let w = weight(
                Payload::encode("w", d.clone(), WireFormat::Native, 0).unwrap(),
                &d,
            );
            assert_eq!(w.encoding, Encoding::Native);
            assert_eq!(w.decode(), d);
            assert_eq!(w.wire_bytes(), w.device_bytes());
        }
        // bf16 on the wire for an f32 weight: half the bytes, values rounded to bf16.
        let d = data(DType::F32);
        let w = weight(
            Payload::encode("w", d.clone(), WireFormat::Bf16, 0).unwrap(),
            &d,
        );
        assert_eq!(w.encoding, Encoding::Bf16);
        assert_eq!(w.wire_bytes() * 2, w.device_bytes());
        let expected = d
            .clone()
            .convert_dtype(DType::BF16)
            .convert_dtype(DType::F32);
        assert_eq!(w.decode(), expected);
        // For a bf16 weight it is the native encoding.
        let d = data(DType::BF16);
        let w = weight(
            Payload::encode("w", d.clone(), WireFormat::Bf16, 0).unwrap(),
            &d,
        );
        assert_eq!(w.encoding, Encoding::Native);
    }

    #[test]
    fn fp8_decodes_like_burn_quant() {
        for (wire, format) in [
            (WireFormat::E4M3, Fp8Format::E4M3),
            (WireFormat::E5M2, Fp8Format::E5M2),
        ] {
            let d = data(DType::F32);
            let w = weight(Payload::encode("w", d.clone(), wire, 0).unwrap(), &d);
            let reference = Fp8Tensor::quantize(
                FloatBytes::new(FloatDtype::F32, &d.bytes).unwrap(),
                &[64, 5],
                format,
                Granularity::Block64,
            );
            assert_eq!(w.decode().to_vec::<f32>().unwrap(), reference.dequantize());
            // Codes padded to the alignment, then one scale per block of a row.
            assert_eq!(w.wire_bytes(), CODE_ALIGN * 2 + 64 * 4);
        }
    }

    #[test]
    fn small_payloads_stay_native_and_ints_are_refused() {
        let d = data(DType::F32);
        let p = Payload::encode("w", d.clone(), WireFormat::E4M3, 10_000).unwrap();
        assert_eq!(p.encoding, Encoding::Native);
        let ints = TensorData::new(vec![1i32, 2], [2]);
        let err = Payload::encode("blocks.0.ids", ints, WireFormat::Native, 0)
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            "`blocks.0.ids` has dtype I32: only f32, f16 and bf16 weights can be streamed"
        );
    }
}
