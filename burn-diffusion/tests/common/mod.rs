//! What the parity tests share: reading the references' fixture files and comparing against
//! them.
// Each test binary uses a part of this module.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use burn_quant::{Checkpoint, FloatBytes, FloatDtype};

/// Relative error required in f32.
pub const F32_TOLERANCE: f64 = 1e-5;
/// Relative error allowed for a bf16 run against the f32 or bf16 reference: it only guards
/// against gross errors (mixed dtypes, a norm or softmax computed in bf16 where it must not be).
pub const BF16_TOLERANCE: f64 = 3e-2;

/// A path under `tests/fixtures/`.
pub fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

/// A float tensor of a fixture file, as f32, with its shape.
pub fn read(file: &Path, key: &str) -> (Vec<f32>, Vec<usize>) {
    let files = Checkpoint::open(file).unwrap();
    let entry = files
        .get(key)
        .unwrap_or_else(|| panic!("{}: no `{key}`", file.display()));
    let dtype = FloatDtype::from_safetensors(entry.dtype).unwrap();
    let values = FloatBytes::new(dtype, entry.data).unwrap().to_f32_vec();
    (values, entry.shape.to_vec())
}

/// An i64 tensor of a fixture file.
pub fn read_i64(file: &Path, key: &str) -> TensorData {
    let files = Checkpoint::open(file).unwrap();
    let entry = files
        .get(key)
        .unwrap_or_else(|| panic!("{}: no `{key}`", file.display()));
    let values: Vec<i64> = entry
        .data
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect();
    TensorData::new(values, entry.shape.to_vec())
}

/// `‖a - b‖ / ‖b‖` in f64 (`‖a‖` for a zero reference).
pub fn relative_error(actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(actual.len(), expected.len());
    let diff: f64 = actual
        .iter()
        .zip(expected)
        .map(|(a, b)| (*a as f64 - *b as f64).powi(2))
        .sum();
    let norm: f64 = expected.iter().map(|b| (*b as f64).powi(2)).sum();
    if norm == 0.0 {
        diff.sqrt()
    } else {
        (diff / norm).sqrt()
    }
}

/// Checks `actual` against the reference `key` of `file`: the same shape, and a relative error
/// within `tolerance`.
pub fn assert_within(actual: TensorData, file: &Path, key: &str, tolerance: f64) {
    let (expected, shape) = read(file, key);
    assert_eq!(actual.shape.to_vec(), shape, "{key}: shape");
    let actual = actual.convert::<f32>().to_vec::<f32>().unwrap();
    let error = relative_error(&actual, &expected);
    println!("{key}: relative error {error:.2e}");
    assert!(error <= tolerance, "{key}: relative error {error:.2e}");
}
