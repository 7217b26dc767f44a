//! Adaptive modulation (adaLN): shift, scale and gate computed from the conditioning vector.

use burn::tensor::{Tensor, backend::Backend};
use burn_kernels::Kernels;

/// One set of modulation parameters, each `[batch, 1, hidden]` so that it broadcasts over tokens.
#[derive(Clone, Debug)]
pub struct Modulation<B: Backend> {
    /// Added after scaling.
    pub shift: Tensor<B, 3>,
    /// Multiplies as `1 + scale`.
    pub scale: Tensor<B, 3>,
    /// Multiplies a residual branch.
    pub gate: Tensor<B, 3>,
}

impl<B: Kernels> Modulation<B> {
    /// Splits `[batch, 3 · n · hidden]` into `n` sets, each taken in the order shift, scale, gate.
    pub fn split(projected: Tensor<B, 2>, n: usize) -> Vec<Self> {
        let chunks = projected.unsqueeze_dim::<3>(1).chunk(3 * n, 2);
        chunks
            .chunks_exact(3)
            .map(|c| Self {
                shift: c[0].clone(),
                scale: c[1].clone(),
                gate: c[2].clone(),
            })
            .collect()
    }

    /// `x · (1 + scale) + shift`.
    ///
    /// # Shapes
    /// - `x`: `[batch, tokens, hidden]`
    pub fn scale_shift(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        x * (self.scale.clone() + 1.0) + self.shift.clone()
    }

    /// `gate · x`.
    pub fn gate(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.gate.clone() * x
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    #[test]
    fn splits_in_shift_scale_gate_order_and_applies() {
        let device = Default::default();
        // batch 1, hidden 2, two sets: values 0..12.
        let projected = Tensor::<Flex, 1, burn::tensor::Int>::arange(0..12, &device)
            .float()
            .reshape([1, 12]);
        let sets = Modulation::split(projected, 2);
        assert_eq!(sets.len(), 2);
        let values = |t: &Tensor<Flex, 3>| t.to_data().to_vec::<f32>().unwrap();
        assert_eq!(values(&sets[1].shift), [6.0, 7.0]);
        assert_eq!(values(&sets[1].scale), [8.0, 9.0]);
        assert_eq!(values(&sets[1].gate), [10.0, 11.0]);
        let x = Tensor::<Flex, 3>::from_floats([[[1.0, -1.0], [2.0, 0.5]]], &device);
        // set 0: shift [0, 1], scale [2, 3], gate [4, 5].
        assert_eq!(
            values(&sets[0].scale_shift(x.clone())),
            [3.0, -3.0, 6.0, 3.0]
        );
        assert_eq!(values(&sets[0].gate(x)), [4.0, -5.0, 8.0, 2.5]);
    }
}
