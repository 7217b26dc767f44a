//! Quantizer throughput on the CPU: GB/s of f32 and bf16 input, on one core and on all cores.
//!
//! `cargo bench -p burn-quant --bench quantize`; the figures are recorded in benches/RESULTS.md.

use burn_quant::{FloatBytes, FloatDtype, Fp8Format, Fp8Tensor, Granularity};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;

const SHAPE: [usize; 2] = [3072, 3072];

fn inputs() -> (Vec<u8>, Vec<u8>) {
    let n = SHAPE[0] * SHAPE[1];
    let values: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.618).sin() * 0.02).collect();
    let f32_bytes = bytemuck::cast_slice(&values).to_vec();
    let bf16_bytes = values
        .iter()
        .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
        .collect();
    (f32_bytes, bf16_bytes)
}

fn quantize(c: &mut Criterion) {
    let (f32_bytes, bf16_bytes) = inputs();
    let all_cores = rayon::current_num_threads();
    let mut group = c.benchmark_group("quantize_e4m3");
    group
        .sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(2));
    for (dtype, bytes) in [
        (FloatDtype::F32, &f32_bytes),
        (FloatDtype::BF16, &bf16_bytes),
    ] {
        group.throughput(Throughput::Bytes(bytes.len() as u64));
        let src = FloatBytes::new(dtype, bytes).unwrap();
        for granularity in Granularity::ALL {
            for threads in [1, all_cores] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let id = BenchmarkId::new(
                    format!("{dtype:?}/{granularity}"),
                    format!("{threads}-cores"),
                );
                group.bench_function(id, |b| {
                    b.iter(|| {
                        pool.install(|| {
                            Fp8Tensor::quantize(src, &SHAPE, Fp8Format::E4M3, granularity)
                        })
                    })
                });
            }
        }
    }
    group.finish();
}

criterion_group!(benches, quantize);
criterion_main!(benches);
