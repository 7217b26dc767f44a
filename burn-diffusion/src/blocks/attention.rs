//! Scaled dot-product attention.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Tensor, backend::Backend, s};
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
/// (CUDA: bf16 heads of 64 or 128, forward and backward). Elsewhere it computes the score
/// matrix, in chunks of query rows when it is large: the two products in the inputs' dtype, the
/// softmax in f32, the scale applied to `q` before the first product (a pass over
/// `[.., len_q, head_dim]` instead of one over the score matrix). burn-kernels/DESIGN.md says
/// why Burn's own attention op is not used.
///
/// # Shapes
/// - `q`: `[batch, heads, len_q, head_dim]`
/// - `k`, `v`: `[batch, heads, len_k, head_dim]`
/// - output: `[batch, heads, len_q, head_dim]`
pub fn sdpa<B: Kernels>(q: Tensor<B, 4>, k: Tensor<B, 4>, v: Tensor<B, 4>) -> Tensor<B, 4> {
    let scale = (q.dims()[3] as f64).sqrt().recip();
    attention(q, k, v, scale, ScoreBias::None)
}

/// The most bytes of f32 scores the separate ops hold at once: longer queries are attended in
/// chunks of rows, each row's softmax whole (the VAE's mid-block at 1024² would otherwise hold a
/// 16384 × 16384 score matrix, 1 GiB, several times over in its softmax).
const MAX_SCORE_BYTES: usize = 1 << 28;

/// `softmax(scale · q kᵀ + bias) v`, computed as [`sdpa`] is (the bias added in f32; only
/// attention without bias runs fused), in chunks of query rows whose f32 scores take at most
/// 256 MiB.
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
    in_chunks(q, k, v, scale, bias, MAX_SCORE_BYTES)
}

/// [`attention`]'s separate ops over chunks of query rows whose f32 scores take at most
/// `max_score_bytes` (one row at least).
fn in_chunks<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    bias: ScoreBias<B>,
    max_score_bytes: usize,
) -> Tensor<B, 4> {
    let [batch, heads, len_q, _] = q.dims();
    let len_k = k.dims()[2];
    let row_bytes = batch * heads * len_k * size_of::<f32>();
    let rows = (max_score_bytes / row_bytes).max(1);
    if rows >= len_q {
        return separate(q, k, v, scale, bias, 0);
    }
    let chunks = (0..len_q)
        .step_by(rows)
        .map(|start| {
            let end = (start + rows).min(len_q);
            let bias = match &bias {
                ScoreBias::None => ScoreBias::None,
                ScoreBias::Causal => ScoreBias::Causal,
                ScoreBias::Add(bias) if bias.dims()[2] == 1 => ScoreBias::Add(bias.clone()),
                ScoreBias::Add(bias) => ScoreBias::Add(bias.clone().slice(s![.., .., start..end])),
            };
            let q = q.clone().slice(s![.., .., start..end]);
            separate(q, k.clone(), v.clone(), scale, bias, start)
        })
        .collect();
    Tensor::cat(chunks, 2)
}

/// Attention by separate ops for queries at positions `first..` of the sequence (where a
/// causal mask puts its diagonal).
fn separate<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    scale: f64,
    bias: ScoreBias<B>,
    first: usize,
) -> Tensor<B, 4> {
    let dtype = q.dtype();
    let q = if scale == 1.0 { q } else { q.mul_scalar(scale) };
    let scores = q.matmul(k.swap_dims(2, 3)).cast(DType::F32);
    let scores = match bias {
        ScoreBias::None => scores,
        ScoreBias::Causal => {
            let [_, _, lq, lk] = scores.dims();
            let future = Tensor::<B, 2, Bool>::tril_mask([lq, lk], first as i64, &scores.device());
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

    /// Long queries in chunks of rows give what the whole score matrix gives, for every kind of
    /// bias (a causal mask's diagonal moved to each chunk's first row, a bias sliced by rows or
    /// broadcast over them).
    #[test]
    fn chunks_of_query_rows_give_the_whole_attention() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let (b, h, lq, lk, d) = (2, 3, 11, 11, 4);
        let q = Tensor::<Flex, 4>::random([b, h, lq, d], normal, &device);
        let k = Tensor::<Flex, 4>::random([b, h, lk, d], normal, &device);
        let v = Tensor::<Flex, 4>::random([b, h, lk, d], normal, &device);
        let full_bias = Tensor::<Flex, 4>::random([1, h, lq, lk], normal, &device);
        let row_bias = Tensor::<Flex, 4>::random([b, 1, 1, lk], normal, &device);
        let biases = || {
            [
                ScoreBias::None,
                ScoreBias::Causal,
                ScoreBias::Add(full_bias.clone()),
                ScoreBias::Add(row_bias.clone()),
            ]
        };
        // Four rows of scores per chunk: chunks of 4, 4 and 3 rows.
        let four_rows = 4 * b * h * lk * size_of::<f32>();
        for (whole, chunked) in biases().into_iter().zip(biases()) {
            let expected = in_chunks(q.clone(), k.clone(), v.clone(), 0.5, whole, usize::MAX);
            let out = in_chunks(q.clone(), k.clone(), v.clone(), 0.5, chunked, four_rows);
            out.into_data().assert_approx_eq::<f32>(
                &expected.into_data(),
                burn::tensor::Tolerance::absolute(1e-6),
            );
        }
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
