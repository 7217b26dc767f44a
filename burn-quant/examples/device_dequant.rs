//! Checks the device dequantization kernel against the CPU decoding, bit for bit, and measures
//! its bandwidth. Runs on CUDA (`--features cuda`) or wgpu (`--features wgpu`).
//!
//! `cargo run --release -p burn-quant --features cuda --example device_dequant`

use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use burn_quant::{
    FloatBytes, Fp8Format, Fp8Tensor, Granularity, dequantize, dequantize_codes, padded_codes,
};
use cubecl::Runtime as _;
use half::bf16;

#[cfg(feature = "cuda")]
type Runtime = cubecl::cuda::CudaRuntime;
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
type Runtime = cubecl::wgpu::WgpuRuntime;
type Gpu = burn_cubecl::CubeBackend<Runtime, f32, i32, u8>;
type GpuDevice = <Runtime as cubecl::Runtime>::Device;

fn main() {
    let device = GpuDevice::default();
    let (rows, cols) = (3072, 12288);
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as f32) * 0.618).sin() * 2f32.powi((i % 23) as i32 - 12))
        .collect();
    for format in Fp8Format::ALL {
        for granularity in Granularity::ALL {
            let q = Fp8Tensor::quantize(
                FloatBytes::from_f32(&values),
                &[rows, cols],
                format,
                granularity,
            );
            let reference = q.dequantize();
            let f32_out: Vec<f32> = dequantize::<Gpu, 2>(&q, &device, FloatDType::F32)
                .into_data()
                .to_vec()
                .unwrap();
            let f32_ok = f32_out
                .iter()
                .zip(&reference)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            let bf16_out: Vec<bf16> = dequantize::<Gpu, 2>(&q, &device, FloatDType::BF16)
                .into_data()
                .to_vec()
                .unwrap();
            let bf16_ok = bf16_out
                .iter()
                .zip(&reference)
                .all(|(a, &b)| a.to_bits() == bf16::from_f32(b).to_bits());
            let gbps = bandwidth(&q, &device);
            println!(
                "{format} {granularity:8} f32 bit-exact: {f32_ok}  bf16 bit-exact: {bf16_ok}  kernel {gbps:.0} GB/s (bf16 out)"
            );
            assert!(f32_ok && bf16_ok, "device decoding differs from the CPU");
        }
    }
}

/// Bytes moved by the kernel (codes + scales read, bf16 written) per second, on codes already
/// on the device.
fn bandwidth(q: &Fp8Tensor, device: &GpuDevice) -> f64 {
    let client = Runtime::client(device);
    let codes = client.create_from_slice(&padded_codes(q));
    let scales = client.create_from_slice(bytemuck::cast_slice(&q.scales));
    let run = || {
        let out = dequantize_codes::<Runtime>(
            &client,
            device,
            codes.clone(),
            scales.clone(),
            &q.spec,
            FloatDType::BF16,
        );
        Tensor::<Gpu, 2>::from_primitive(TensorPrimitive::Float(out))
    };
    drop(run());
    Gpu::sync(device).unwrap();
    let iterations = 20;
    let start = Instant::now();
    for _ in 0..iterations {
        drop(run());
    }
    Gpu::sync(device).unwrap();
    let seconds = start.elapsed().as_secs_f64() / iterations as f64;
    let bytes = q.data.len() * 3 + q.scales.len() * 4;
    bytes as f64 / seconds / 1e9
}
