//! Scaled dot-product attention.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Tensor, backend::Backend};
use burn_kernels::Kernels;

/// What [`attention`] adds to the scores before the softmax.
pub enum ScoreBias<B: Backend> {
    /// Nothing.
    None,
    /// A causal mask: query `i` sees keys `0..=i`.
    Causal,
    /// An additive bias, broadcast to `[batch, heads, len_q, len_k]` (T5's position bias).
    Add(Tensor<B, 4>),
}

/// Attention over heads, `softmax(q kᵀ / √d) v`, without mask.
///
/// Every model calls attention through this one function or [`attention`], so that a fused
/// kernel replaces it in one place: [`burn_kernels::attention`] where the backend has one
/// (CUDA: bf16 heads of 64 or 128, forward and backward). Elsewhere it computes the full score
/// matrix: the two products in the inputs' dtype, the softmax in f32, the scale applied to `q`
/// before the first product (a pass over `[.., len_q, head_dim]` instead of one over the score
/// matrix). burn-kernels/DESIGN.md says why Burn's own attention op is not used.
///
/// # Shapes
/// - `q`: `[batch, heads, len_q, head_dim]`
/// - `k`, `v`: `[batch, heads, len_k, head_dim]`
/// - output: `[batch, heads, len_q, head_dim]`
pub fn sdpa<B: Kernels>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
    let scale = (q.dims()[3] as f64).sqrt().recip();
    attention(q, k, v, scale, ScoreBias::None)
}

/// `softmax(scale · q kᵀ + bias) v`, computed as [`sdpa`] is (the bias added in f32; only
/// attention without bias runs fused).
///
/// # Shapes
/// As [`sdpa`].
pub fn attention<B: Kernels>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    bias: ScoreBias<B>,
) -> Tensor<B, 4> {
    if let ScoreBias::None = bias
        && let Some(out) = burn_kernels::attention(&q, &k, &v, scale)
    {
        return out;
    }
    let dtype = q.dtype();
    let q = if scale == 1.0 { q } else { q.mul_scalar(scale) };
    let scores = q.matmul(k.swap_dims(2, 3)).cast(DType::F32);
    let scores = match bias {
        ScoreBias::None => scores,
        ScoreBias::Causal => {
            let [_, _, lq, lk] = scores.dims();
            let future = Tensor::<B, 2, Bool>::tril_mask([lq, lk], 0, &scores.device());
            scores.mask_fill(future.unsqueeze::<4>(), f32::NEG_INFINITY)
        }
        ScoreBias::Add(bias) => scores + bias.cast(DType::F32),
    };
    softmax(scores, 3).cast(dtype).matmul(v)
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
