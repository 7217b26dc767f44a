//! What the GPU programs that time work share: a clock and a timer that waits for the device.

use std::sync::OnceLock;
use std::time::Instant;

use burn::tensor::backend::Backend;

/// Seconds since the program started.
pub fn clock() -> f64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}

/// Seconds per call of `f`, after `warm` untimed calls.
pub fn time<B: Backend>(device: &B::Device, warm: usize, runs: usize, f: impl Fn()) -> f64 {
    for _ in 0..warm {
        f();
    }
    B::sync(device).unwrap();
    let start = Instant::now();
    for _ in 0..runs {
        f();
    }
    B::sync(device).unwrap();
    start.elapsed().as_secs_f64() / runs as f64
}
