//! The host-side AdamW step (`train.optimizer_state: host` with `train.gradients: host`): the
//! chunk gradients gathered from the sums, their norm, and the update on all cores, for 100 M
//! bf16 values in 1024 × 1024 parameters, with f32 and 8-bit moments. Prints the median of five
//! steps after the first (which creates the state).
//!
//! ```text
//! cargo bench --bench host_optimizer
//! ```

use std::time::Instant;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, bf16};
use burn_lora_train::config::OptimizerKind;
use burn_lora_train::optim::{AdamW, AdamWConfig, OnHost};
use burn_offload::HostGradient;

const PARAMS: usize = 100;
const SIDE: usize = 1024;

#[derive(Module, Debug)]
struct Net<B: Backend> {
    params: Vec<Param<Tensor<B, 2>>>,
}

fn main() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let names: Vec<String> = (0..PARAMS).map(|i| format!("params.{i}")).collect();
    let sums: Vec<Vec<bf16>> = (0..PARAMS)
        .map(|i| {
            (0..SIDE * SIDE)
                .map(|j| bf16::from_f32(((i * 31 + j) as f32 * 0.001).sin() * 1e-3))
                .collect()
        })
        .collect();
    let host: Vec<(&str, HostGradient<'_>)> = names
        .iter()
        .zip(&sums)
        .map(|(name, sum)| (name.as_str(), HostGradient::Bf16(sum)))
        .collect();
    for kind in [OptimizerKind::AdamW8bit, OptimizerKind::AdamW] {
        let mut net = Net::<B> {
            params: (0..PARAMS)
                .map(|i| {
                    let t = Tensor::<B, 2>::ones([SIDE, SIDE], &device).mul_scalar(i as f64 * 0.01);
                    Param::from_tensor(t.cast(DType::BF16).detach().require_grad())
                })
                .collect(),
        };
        let config = AdamWConfig {
            max_grad_norm: Some(1.0),
            ..AdamWConfig::new(kind, 0.01)
        };
        let mut optimizer = AdamW::<Flex, OnHost>::new(config);
        let mut seconds = Vec::new();
        for _ in 0..6 {
            let start = Instant::now();
            net = optimizer
                .step_with_host_gradients(net, GradientsParams::new(), &host, 1e-4, 1)
                .0;
            seconds.push(start.elapsed().as_secs_f64());
        }
        let mut steady = seconds[1..].to_vec();
        steady.sort_by(f64::total_cmp);
        let median = steady[steady.len() / 2];
        let values = PARAMS * SIDE * SIDE;
        println!(
            "{kind:?}: {median:.3} s per step for {values} values ({:.2} ns per value on {} \
             threads); first step {:.3} s",
            median / values as f64 * 1e9,
            rayon::current_num_threads(),
            seconds[0]
        );
    }
}
