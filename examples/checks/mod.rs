//! What the GPU check programs (`blas_check`, `attention_check`) share: deterministic inputs in
//! a chosen precision and relative errors.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

/// Values in [-1, 1) from a fixed xorshift sequence.
fn data(shape: &[usize], seed: u64) -> TensorData {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect();
    TensorData::new(values, shape.to_vec())
}

/// The dtypes of one run: inputs rounded to `input`, then computed in `compute`.
#[derive(Clone, Copy)]
pub struct Precision {
    pub input: DType,
    pub compute: DType,
}

impl Precision {
    /// The dtype sums and softmaxes run in: f64 for a float64 reference, f32 otherwise.
    pub fn wide(self) -> DType {
        if self.compute == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }
}

/// The inputs `seed` names, rounded to `precision.input`, held in `precision.compute`.
pub fn input<B: Backend, const D: usize>(
    shape: [usize; D],
    seed: u64,
    precision: Precision,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::<B, D>::from_data(data(&shape, seed), device)
        .cast(precision.input)
        .cast(precision.compute)
}

/// `‖got − want‖ / ‖want‖`, in f64.
pub fn relative_error(got: &TensorData, want: &TensorData) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (g, w) in got.iter::<f64>().zip(want.iter::<f64>()) {
        diff += (g - w).powi(2);
        norm += w.powi(2);
    }
    (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
}
