//! A small seeded random generator whose whole state is four `u64`s, so that it can be saved
//! in the training state and restored exactly.
//!
//! The generator is xoshiro256++ (Blackman and Vigna, public domain), seeded through SplitMix64.
//! [`derive()`] gives stateless, order-independent draws for choices that must not depend on
//! how far a stream has been consumed (data order, caption dropout).

use serde::{Deserialize, Serialize};

/// One SplitMix64 step: advances `state` and returns the next output.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A 64-bit value determined by `seed` and `parts` alone (a SplitMix64 hash chain).
pub fn derive(seed: u64, parts: &[u64]) -> u64 {
    let mut state = seed;
    let mut out = splitmix64(&mut state);
    for &part in parts {
        state ^= part.wrapping_add(out);
        out = splitmix64(&mut state);
    }
    out
}

/// Uniform in `[0, 1)` from 64 random bits (the top 53).
pub fn unit(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A xoshiro256++ generator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rng {
    state: [u64; 4],
}

impl Rng {
    /// The generator for `seed` (the four state words are SplitMix64 outputs).
    pub fn seeded(seed: u64) -> Self {
        let mut sm = seed;
        Self {
            state: std::array::from_fn(|_| splitmix64(&mut sm)),
        }
    }

    /// A generator at a saved state (see [`Rng::state`]).
    pub fn from_state(state: [u64; 4]) -> Self {
        Self { state }
    }

    /// The state to save; [`Rng::from_state`] continues from exactly here.
    pub fn state(&self) -> [u64; 4] {
        self.state
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)`, with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        unit(self.next_u64())
    }

    /// Standard normal (Box–Muller, one value per call so the state stays four words).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `count` standard normal values, [`normal`](Self::normal) draws narrowed to f32.
    pub fn normals(&mut self, count: usize) -> Vec<f32> {
        (0..count).map(|_| self.normal() as f32).collect()
    }

    /// Uniform in `0..n` (`n > 0`), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0) has no value to return");
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Shuffles `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_outputs_for_seed_zero() {
        let mut s = 0;
        let out: Vec<u64> = (0..3).map(|_| splitmix64(&mut s)).collect();
        assert_eq!(
            out,
            [
                0xe220_a839_7b1d_cdaf,
                0x6e78_9e6a_a1b9_65f4,
                0x06c4_5d18_8009_454f
            ]
        );
    }

    #[test]
    fn xoshiro256pp_matches_the_reference_algorithm() {
        // Outputs of the C reference (xoshiro256plusplus.c) from state {1, 2, 3, 4}.
        let mut rng = Rng::from_state([1, 2, 3, 4]);
        let out: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        assert_eq!(
            out,
            [41943041, 58720359, 3588806011781223, 3591011842654386]
        );
    }

    #[test]
    fn a_restored_state_continues_the_same_stream() {
        let mut a = Rng::seeded(7);
        (0..5).for_each(|_| {
            a.next_u64();
        });
        let mut b = Rng::from_state(a.state());
        let expected: Vec<u64> = (0..10).map(|_| a.next_u64()).collect();
        let got: Vec<u64> = (0..10).map(|_| b.next_u64()).collect();
        assert_eq!(expected, got);
    }

    #[test]
    fn normal_draws_have_unit_moments() {
        let mut rng = Rng::seeded(1);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        // Standard errors: 1/sqrt(n) = 0.0022 for the mean, sqrt(2/n) = 0.0032 for the variance.
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.015, "variance {var}");
    }

    #[test]
    fn shuffle_is_a_permutation_and_seed_dependent() {
        let shuffled = |seed| {
            let mut v: Vec<u32> = (0..50).collect();
            Rng::seeded(seed).shuffle(&mut v);
            v
        };
        let mut sorted = shuffled(3);
        assert_ne!(sorted, (0..50).collect::<Vec<_>>());
        assert_eq!(shuffled(3), sorted);
        assert_ne!(shuffled(4), sorted);
        sorted.sort();
        assert_eq!(sorted, (0..50).collect::<Vec<_>>());
    }

    #[test]
    fn derive_depends_on_every_part() {
        let base = derive(1, &[2, 3]);
        assert_eq!(base, derive(1, &[2, 3]));
        assert_ne!(base, derive(1, &[3, 2]));
        assert_ne!(base, derive(2, &[2, 3]));
        assert_ne!(base, derive(1, &[2, 4]));
    }
}
