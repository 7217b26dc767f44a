//! FP8 quantization for streaming frozen weights: E5M2 and E4M3 codes made on the CPU, with
//! scales per tensor, per row or per block of 64, and decoded on the device.
//!
//! Quantizing on the CPU before upload halves the bytes that cross the PCIe bus (from bf16).
//! Conversion is bit-exact: round to nearest even, saturating to the largest finite value,
//! NaN kept. [`quantize_checkpoint`] turns a whole safetensors checkpoint (single file or
//! sharded) into a scaled-FP8 file, streaming one tensor at a time; [`Fp8Backend`] decodes a
//! payload into a Burn tensor on the device (a CubeCL kernel on CUDA and wgpu, the CPU on Flex).
//!
//! # Features
//! - `cuda`, `wgpu`: the device kernel for those CubeCL backends.
//!
//! # Example
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::{FloatDType, Tensor};
//! use burn_quant::{dequantize, FloatBytes, Fp8Format, Fp8Tensor, Granularity};
//!
//! let weight = [0.5f32, -1.25, 3.0, 0.001, 100.0, -7.5];
//! let q = Fp8Tensor::quantize(
//!     FloatBytes::from_f32(&weight),
//!     &[2, 3],
//!     Fp8Format::E4M3,
//!     Granularity::Row,
//! );
//! assert_eq!(q.data.len(), 6); // one byte per value
//! assert_eq!(q.scales.len(), 2); // one scale per row
//!
//! let on_device: Tensor<Flex, 2> = dequantize(&q, &Default::default(), FloatDType::F32);
//! let back = on_device.into_data().to_vec::<f32>().unwrap();
//! assert!((back[4] - 100.0).abs() <= 100.0 / 16.0);
//! ```
#![warn(missing_docs)]

mod backend;
mod checkpoint;
#[cfg(feature = "cube")]
mod cube;
mod error;
mod file;
mod format;
mod quantize;
mod scale;

pub use backend::{Fp8Backend, dequantize};
pub use checkpoint::{Checkpoint, StreamingWriter, TensorEntry, TensorHeader};
#[cfg(feature = "cube")]
pub use cube::{dequantize_codes, padded_codes};
pub use error::QuantError;
pub use file::{
    FORMAT_KEY, QuantizeOptions, QuantizeReport, SCALE_KEY, quantize_checkpoint, read_fp8,
    scale_key,
};
pub use format::Fp8Format;
pub use quantize::{FloatBytes, FloatDtype, Fp8Spec, Fp8Tensor};
pub use scale::{Granularity, ScaleLayout, scale_for};
