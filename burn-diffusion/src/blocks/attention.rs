//! Scaled dot-product attention.

use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Tensor, backend::Backend};

/// Attention over heads, `softmax(q kᵀ / √d) v`, without mask.
///
/// Every model calls attention through this one function, so that a fused kernel can replace
/// it in one place. Under `Autodiff`, Burn 0.21 computes it naively (the full score matrix).
///
/// # Shapes
/// - `q`: `[batch, heads, len_q, head_dim]`
/// - `k`, `v`: `[batch, heads, len_k, head_dim]`
/// - output: `[batch, heads, len_q, head_dim]`
pub fn sdpa<B: Backend>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
    attention(q, k, v, None, None, AttentionModuleOptions::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::{Distribution, TensorData};

    /// The same attention in f64 loops.
    fn reference(q: &[f32], k: &[f32], v: &[f32], [b, h, lq, lk, d]: [usize; 5]) -> Vec<f64> {
        let mut out = vec![0.0; b * h * lq * d];
        for bh in 0..b * h {
            for i in 0..lq {
                let qi = &q[(bh * lq + i) * d..][..d];
                let scores: Vec<f64> = (0..lk)
                    .map(|j| {
                        let kj = &k[(bh * lk + j) * d..][..d];
                        qi.iter()
                            .zip(kj)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                let exp: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exp.iter().sum();
                for (j, e) in exp.iter().enumerate() {
                    for c in 0..d {
                        out[(bh * lq + i) * d + c] += e / total * v[(bh * lk + j) * d + c] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_a_float64_softmax() {
        let device = Default::default();
        let (b, h, lq, lk, d) = (2, 3, 5, 7, 8);
        let q = Tensor::<Flex, 4>::random([b, h, lq, d], Distribution::Normal(0.0, 1.0), &device);
        let k = Tensor::<Flex, 4>::random([b, h, lk, d], Distribution::Normal(0.0, 1.0), &device);
        let v = Tensor::<Flex, 4>::random([b, h, lk, d], Distribution::Normal(0.0, 1.0), &device);
        let data = |t: &Tensor<Flex, 4>| t.to_data().to_vec::<f32>().unwrap();
        let expected = reference(&data(&q), &data(&k), &data(&v), [b, h, lq, lk, d]);
        let out = sdpa(q, k, v);
        assert_eq!(out.dims(), [b, h, lq, d]);
        TensorData::new(out.into_data().to_vec::<f32>().unwrap(), [expected.len()])
            .assert_approx_eq::<f32>(
                &TensorData::new(
                    expected.iter().map(|&x| x as f32).collect(),
                    [expected.len()],
                ),
                burn::tensor::Tolerance::absolute(1e-5),
            );
    }
}
