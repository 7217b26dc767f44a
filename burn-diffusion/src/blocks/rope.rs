//! Rotary position embedding: over several position axes with interleaved pairs (FLUX: time,
//! row, column), or over one axis with the halves of each head paired (Llama-family decoders).

use burn::tensor::{DType, Tensor, TensorData, backend::Backend};
use burn_kernels::Kernels;

use super::rms_norm;

/// Cosine and sine tables for every token, `[tokens, head_dim]`, in f32, and which lanes of a
/// head they pair ([`Rope::new`]: neighbours; [`Rope::halves`]: lane `i` with lane `i + d/2`).
#[derive(Clone, Debug)]
pub struct Rope<B: Backend> {
    cos: Tensor<B, 2>,
    sin: Tensor<B, 2>,
    pairing: Pairing,
}

/// Which two lanes of a head turn together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pairing {
    /// `(2j, 2j + 1)` (FLUX).
    Interleaved,
    /// `(j, j + d/2)` (transformers' `rotate_half`).
    Halves,
}

impl<B: Kernels> Rope<B> {
    /// Builds the tables from token positions, `positions[token * axes + axis]`, pairing
    /// neighbouring lanes.
    ///
    /// Head dimension `d` is split into one band per axis (`axes_dim`, summing to `d`); in the
    /// band of axis `a` (width `n`), pair `j` turns by `pos[a] / theta^(2j / n)`. The angles are
    /// computed in f64 and each value is repeated for the two lanes of its pair.
    ///
    /// # Panics
    /// If an axis width is odd or the positions are not a whole number of tokens.
    pub fn new(positions: &[f64], axes_dim: &[usize], theta: f64, device: &B::Device) -> Self {
        let axes = axes_dim.len();
        assert!(
            axes_dim.iter().all(|n| n % 2 == 0),
            "rope axis widths must be even, got {axes_dim:?}"
        );
        assert_eq!(
            positions.len() % axes,
            0,
            "positions are not [tokens, {axes}]"
        );
        let tokens = positions.len() / axes;
        let dim: usize = axes_dim.iter().sum();
        let freqs: Vec<f64> = axes_dim
            .iter()
            .flat_map(|&n| (0..n / 2).map(move |j| 1.0 / theta.powf((2 * j) as f64 / n as f64)))
            .collect();
        let axis_of: Vec<usize> = axes_dim
            .iter()
            .enumerate()
            .flat_map(|(a, &n)| std::iter::repeat_n(a, n / 2))
            .collect();
        let mut cos = Vec::with_capacity(tokens * dim);
        let mut sin = Vec::with_capacity(tokens * dim);
        for pos in positions.chunks_exact(axes) {
            for (freq, &axis) in freqs.iter().zip(&axis_of) {
                let angle = pos[axis] * freq;
                let (s, c) = (angle.sin() as f32, angle.cos() as f32);
                cos.extend([c, c]);
                sin.extend([s, s]);
            }
        }
        let table = |values| {
            Tensor::from_data(TensorData::new(values, [tokens, dim]), (device, DType::F32))
        };
        Self {
            cos: table(cos),
            sin: table(sin),
            pairing: Pairing::Interleaved,
        }
    }

    /// The tables of tokens `0..tokens` for heads of `head_dim` lanes in which lane `j` turns with
    /// lane `j + head_dim / 2` by `position / theta^(2j / head_dim)`: the rotary embedding of
    /// transformers' Llama-family decoders (Mistral, Qwen3). Frequencies, angles, cosines and
    /// sines are computed in f32 as transformers computes them, so that the tables match its
    /// own at every position.
    ///
    /// # Panics
    /// If `head_dim` is odd.
    pub fn halves(tokens: usize, head_dim: usize, theta: f64, device: &B::Device) -> Self {
        assert!(
            head_dim.is_multiple_of(2),
            "rope head width must be even, got {head_dim}"
        );
        let half = head_dim / 2;
        let theta = theta as f32;
        let freqs: Vec<f32> = (0..half)
            .map(|j| 1.0 / theta.powf((2 * j) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(tokens * head_dim);
        let mut sin = Vec::with_capacity(tokens * head_dim);
        for position in 0..tokens {
            let angles: Vec<f32> = freqs.iter().map(|f| position as f32 * f).collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
                sin.extend(angles.iter().map(|a| a.sin()));
            }
        }
        let table = |values| {
            Tensor::from_data(
                TensorData::new(values, [tokens, head_dim]),
                (device, DType::F32),
            )
        };
        Self {
            cos: table(cos),
            sin: table(sin),
            pairing: Pairing::Halves,
        }
    }

    /// The tables of `len` tokens from token `start` on.
    pub fn narrow(&self, start: usize, len: usize) -> Self {
        Self {
            cos: self.cos.clone().narrow(0, start, len),
            sin: self.sin.clone().narrow(0, start, len),
            pairing: self.pairing,
        }
    }

    /// [`rms_norm`] of every head (`scale` `[head_dim]`), then [`apply`](Self::apply): one fused
    /// kernel each way where [`burn_kernels::rms_norm_rope`] has one for neighbouring pairs
    /// (unless the installed `KernelOptions` switch it off; it rounds once, where the separate
    /// ops round the normalized value and the scaled one too), elsewhere the two as written.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, tokens, head_dim]`
    pub fn apply_normalized(&self, x: Tensor<B, 4>, scale: Tensor<B, 1>, eps: f64) -> Tensor<B, 4> {
        self.fused_norm(&x, &scale, eps)
            .unwrap_or_else(|| self.apply(rms_norm(x, scale, eps)))
    }

    /// [`rms_norm`] of each token's `heads` heads together (`scale` `[heads · head_dim]`, Wan's
    /// norm across heads), split into heads, then [`apply`](Self::apply): one fused kernel each
    /// way where [`burn_kernels::rms_norm_rope`] has one for neighbouring pairs (rounding once),
    /// elsewhere the ops as written.
    ///
    /// # Shapes
    /// - `x`: `[batch, tokens, heads · head_dim]`; output: `[batch, heads, tokens, head_dim]`
    pub fn apply_normalized_across_heads(
        &self,
        x: Tensor<B, 3>,
        scale: Tensor<B, 1>,
        heads: usize,
        eps: f64,
    ) -> Tensor<B, 4> {
        let split = |t: Tensor<B, 3>| {
            let [b, l, width] = t.dims();
            t.reshape([b, l, heads, width / heads]).swap_dims(1, 2)
        };
        match self.fused_norm(&x, &scale, eps) {
            Some(turned) => split(turned),
            None => self.apply(split(rms_norm(x, scale, eps))),
        }
    }

    /// [`burn_kernels::rms_norm_rope`] of `x` with these tables, for neighbouring pairs only.
    fn fused_norm<const D: usize>(
        &self,
        x: &Tensor<B, D>,
        scale: &Tensor<B, 1>,
        eps: f64,
    ) -> Option<Tensor<B, D>> {
        match self.pairing {
            Pairing::Interleaved => {
                burn_kernels::rms_norm_rope(x, scale, &self.cos, &self.sin, eps)
            }
            Pairing::Halves => None,
        }
    }

    /// Rotates each pair of lanes `(x₀, x₁)` of every head: `(x₀ cos - x₁ sin, x₁ cos + x₀ sin)`,
    /// computed in f32 and returned in the input's dtype.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, tokens, head_dim]`
    pub fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let dtype = x.dtype();
        let [b, h, l, d] = x.dims();
        let x = x.cast(DType::F32);
        let rotated = match self.pairing {
            Pairing::Interleaved => {
                let pairs = x.clone().reshape([b, h, l, d / 2, 2]);
                let real = pairs.clone().narrow(4, 0, 1);
                let imag = pairs.narrow(4, 1, 1);
                Tensor::cat(vec![imag.neg(), real], 4).reshape([b, h, l, d])
            }
            Pairing::Halves => {
                let first = x.clone().narrow(3, 0, d / 2);
                let second = x.clone().narrow(3, d / 2, d / 2);
                Tensor::cat(vec![second.neg(), first], 3)
            }
        };
        let cos = self.cos.clone().unsqueeze::<4>();
        let sin = self.sin.clone().unsqueeze::<4>();
        (x * cos + rotated * sin).cast(dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn rotates_each_pair_by_its_axis_angle() {
        let device = Default::default();
        let axes_dim = [2, 4];
        let theta = 100.0;
        // Two tokens, two axes.
        let positions = [3.0, 5.0, -1.0, 2.0];
        let rope = Rope::<Flex>::new(&positions, &axes_dim, theta, &device);
        let values: Vec<f32> = (0..2 * 2 * 6).map(|i| (i as f32 * 0.37).sin()).collect();
        let x =
            Tensor::<Flex, 4>::from_data(TensorData::new(values.clone(), [1, 2, 2, 6]), &device);
        let out = rope.apply(x).into_data().to_vec::<f32>().unwrap();
        // Pair j of a token: band of axis 0 is pair 0 (freq 1), axis 1 has pairs 1, 2
        // (freqs 1 and theta^-1/2).
        let freq_axis = [(1.0, 0), (1.0, 1), (1.0 / theta.sqrt(), 1)];
        for head in 0..2 {
            for token in 0..2 {
                for (pair, (freq, axis)) in freq_axis.iter().enumerate() {
                    let angle: f64 = positions[token * 2 + axis] * freq;
                    let at = (head * 2 + token) * 6 + 2 * pair;
                    let (x0, x1) = (values[at] as f64, values[at + 1] as f64);
                    let y0 = x0 * angle.cos() - x1 * angle.sin();
                    let y1 = x1 * angle.cos() + x0 * angle.sin();
                    assert!((out[at] as f64 - y0).abs() < 1e-6);
                    assert!((out[at + 1] as f64 - y1).abs() < 1e-6);
                }
            }
        }
    }

    /// Wan's norm across heads: the fused path against the formula in f64, and its gradient
    /// against the separate ops' (options off).
    #[test]
    fn norm_across_heads_then_rotation_of_each_head() {
        use burn::backend::Autodiff;
        use burn::tensor::{Distribution, Tolerance};
        use burn_kernels::{KernelOptions, counters};
        type A = Autodiff<Flex>;
        let device = Default::default();
        let (tokens, heads, d, eps) = (3, 2, 6, 1e-6);
        let positions = [0.0, 1.0, 4.0, 2.0, -3.0, 0.5];
        let rope = Rope::<A>::new(&positions, &[2, 4], 100.0, &device);
        let width = heads * d;
        let values: Vec<f32> = (0..tokens * width)
            .map(|i| (i as f32 * 0.41).sin() * 2.0)
            .collect();
        let scale: Vec<f32> = (0..width).map(|i| 0.5 + i as f32 * 0.1).collect();
        let weights = Tensor::<A, 4>::random([1, heads, tokens, d], Distribution::Default, &device);
        let run = |options: KernelOptions| {
            let _options = options.install();
            let x = Tensor::<A, 3>::from_data(
                TensorData::new(values.clone(), [1, tokens, width]),
                &device,
            )
            .require_grad();
            let scale = Tensor::<A, 1>::from_floats(scale.as_slice(), &device);
            let before = counters();
            let out = rope.apply_normalized_across_heads(x.clone(), scale, heads, eps);
            let fused = counters().since(before).fused_elementwise;
            let grad = x
                .grad(&(out.clone() * weights.clone()).sum().backward())
                .unwrap();
            (out.inner(), grad, fused)
        };
        let (out, grad, fused) = run(KernelOptions::fast());
        let (separate_out, separate_grad, none) = run(KernelOptions::separate_ops());
        assert_eq!((fused, none), (1, 0));
        let got = out.clone().into_data().to_vec::<f32>().unwrap();
        let freqs = [1.0, 1.0, 0.1];
        for token in 0..tokens {
            let row = &values[token * width..][..width];
            let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / width as f64;
            let n = |c: usize| row[c] as f64 / (ms + eps).sqrt() * scale[c] as f64;
            for head in 0..heads {
                for (pair, freq) in freqs.iter().enumerate() {
                    let axis = usize::from(pair > 0);
                    let angle = positions[token * 2 + axis] * freq;
                    let c = head * d + 2 * pair;
                    let y0 = n(c) * angle.cos() - n(c + 1) * angle.sin();
                    let y1 = n(c + 1) * angle.cos() + n(c) * angle.sin();
                    let at = (head * tokens + token) * d + 2 * pair;
                    assert!((got[at] as f64 - y0).abs() < 1e-5, "{} vs {y0}", got[at]);
                    assert!(
                        (got[at + 1] as f64 - y1).abs() < 1e-5,
                        "{} vs {y1}",
                        got[at + 1]
                    );
                }
            }
        }
        let tolerance = Tolerance::absolute(1e-5);
        out.into_data()
            .assert_approx_eq::<f32>(&separate_out.into_data(), tolerance);
        grad.into_data()
            .assert_approx_eq::<f32>(&separate_grad.into_data(), tolerance);
    }

    #[test]
    fn halves_turn_lane_j_with_lane_j_plus_half() {
        let device = Default::default();
        let (tokens, d, theta) = (3, 8, 1e4);
        let rope = Rope::<Flex>::halves(tokens, d, theta, &device);
        let values: Vec<f32> = (0..tokens * d).map(|i| (i as f32 * 0.61).cos()).collect();
        let x = Tensor::<Flex, 4>::from_data(
            TensorData::new(values.clone(), [1, 1, tokens, d]),
            &device,
        );
        let out = rope.apply(x).into_data().to_vec::<f32>().unwrap();
        for token in 0..tokens {
            for j in 0..d / 2 {
                let angle = token as f64 / theta.powf((2 * j) as f64 / d as f64);
                let (x0, x1) = (
                    values[token * d + j] as f64,
                    values[token * d + j + d / 2] as f64,
                );
                let y0 = x0 * angle.cos() - x1 * angle.sin();
                let y1 = x1 * angle.cos() + x0 * angle.sin();
                assert!((out[token * d + j] as f64 - y0).abs() < 1e-5);
                assert!((out[token * d + j + d / 2] as f64 - y1).abs() < 1e-5);
            }
        }
    }
}
