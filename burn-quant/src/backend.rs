//! Dequantization into a Burn tensor on the backend's device.

use burn::backend::Flex;
use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, FloatDType, Tensor, TensorData, TensorPrimitive};

use crate::quantize::Fp8Tensor;

/// A backend that can turn FP8 codes and scales into a float tensor on its device.
///
/// The default method decodes on the CPU and uploads the result; GPU backends
/// (CubeCL: CUDA, wgpu) override it to upload the codes (one byte per value) and decode them
/// with a kernel, so only a quarter (from f32) or half (from bf16) of the bytes cross the bus.
pub trait Fp8Backend: Backend {
    /// Decodes `tensor` into a float tensor of `dtype` on `device`:
    /// value = decode(code) × scale, computed in f32 and rounded once to `dtype`.
    fn fp8_dequantize(
        tensor: &Fp8Tensor,
        device: &Self::Device,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        let data = TensorData::new(tensor.dequantize(), tensor.spec.shape.clone())
            .convert_dtype(DType::from(dtype));
        Self::float_from_data(data, device)
    }
}

impl Fp8Backend for Flex {}

impl<B: Fp8Backend, C: CheckpointStrategy> Fp8Backend for Autodiff<B, C> {
    fn fp8_dequantize(
        tensor: &Fp8Tensor,
        device: &Self::Device,
        dtype: FloatDType,
    ) -> FloatTensor<Self> {
        Self::from_inner(B::fp8_dequantize(tensor, device, dtype))
    }
}

/// Decodes `tensor` into a `D`-dimensional float tensor of `dtype` on `device` (a constant: it
/// is never tracked by autodiff).
///
/// # Panics
/// If `D` differs from the rank of the tensor's shape.
pub fn dequantize<B: Fp8Backend, const D: usize>(
    tensor: &Fp8Tensor,
    device: &B::Device,
    dtype: FloatDType,
) -> Tensor<B, D> {
    assert_eq!(
        tensor.spec.shape.len(),
        D,
        "rank of {:?}",
        tensor.spec.shape
    );
    Tensor::from_primitive(TensorPrimitive::Float(B::fp8_dequantize(
        tensor, device, dtype,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Fp8Format;
    use crate::quantize::FloatBytes;
    use crate::scale::Granularity;
    use half::bf16;

    #[test]
    fn flex_dequantize_equals_the_cpu_decoding() {
        let values: Vec<f32> = (0..96 * 70)
            .map(|i| (i as f32 * 0.11).cos() * 3.0)
            .collect();
        let q = Fp8Tensor::quantize(
            FloatBytes::from_f32(&values),
            &[96, 70],
            Fp8Format::E4M3,
            Granularity::Block64,
        );
        let reference = q.dequantize();
        let device = Default::default();
        let f32_out: Vec<f32> = dequantize::<Flex, 2>(&q, &device, FloatDType::F32)
            .into_data()
            .to_vec()
            .unwrap();
        assert_eq!(f32_out, reference);
        let bf16_out: Vec<bf16> = dequantize::<Autodiff<Flex>, 2>(&q, &device, FloatDType::BF16)
            .into_data()
            .to_vec()
            .unwrap();
        let expected: Vec<bf16> = reference.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(bf16_out, expected);
    }
}
