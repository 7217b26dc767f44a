//! The two 8-bit float formats and their bit-exact conversion from and to `f32`.

use std::fmt;
use std::str::FromStr;
use std::sync::LazyLock;

use crate::error::QuantError;

/// An 8-bit floating-point format.
///
/// Conversion from `f32` rounds to nearest, ties to even, and saturates: every value beyond the
/// largest finite magnitude (infinities included) becomes `±max`. NaN stays NaN.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// 5 exponent bits, 2 mantissa bits, bias 15 (the top byte of an IEEE `f16`); max 57344.
    E5M2,
    /// 4 exponent bits, 3 mantissa bits, bias 7, no infinities ("fn" variant); max 448.
    E4M3,
}

/// The constants that drive the conversion, one set per format.
struct Params {
    /// Mantissa bits.
    mantissa_bits: u32,
    /// `f32` bit pattern of the largest finite value.
    max_bits: u32,
    /// Code of the largest finite value (sign bit clear).
    max_code: u8,
    /// Code written for NaN (sign bit clear).
    nan_code: u8,
    /// `f32` bit pattern of the smallest normal value.
    min_normal_bits: u32,
    /// `2^(bias - 1 + mantissa_bits)`: turns a subnormal magnitude into its integer code.
    subnormal_scale: f32,
    /// `(127 - bias) << mantissa_bits`: moves an `f32` exponent to this format's bias.
    rebias: u32,
}

const E5M2: Params = Params {
    mantissa_bits: 2,
    max_bits: 0x4760_0000, // 57344.0
    max_code: 0x7b,
    nan_code: 0x7e,
    min_normal_bits: 0x3880_0000, // 2^-14
    subnormal_scale: 65536.0,     // 2^16
    rebias: 112 << 2,
};

const E4M3: Params = Params {
    mantissa_bits: 3,
    max_bits: 0x43e0_0000, // 448.0
    max_code: 0x7e,
    nan_code: 0x7f,
    min_normal_bits: 0x3c80_0000, // 2^-6
    subnormal_scale: 512.0,       // 2^9
    rebias: 120 << 3,
};

/// Adding then subtracting 2^23 rounds a float in `[0, 2^22)` to an integer, ties to even.
const ROUNDING_MAGIC: f32 = 8_388_608.0;

impl Fp8Format {
    /// Both formats, in a fixed order.
    pub const ALL: [Fp8Format; 2] = [Fp8Format::E5M2, Fp8Format::E4M3];

    const fn params(self) -> &'static Params {
        match self {
            Fp8Format::E5M2 => &E5M2,
            Fp8Format::E4M3 => &E4M3,
        }
    }

    /// The largest finite magnitude.
    pub const fn max(self) -> f32 {
        f32::from_bits(self.params().max_bits)
    }

    /// The lowercase name used on the command line and in file metadata (`e5m2`, `e4m3`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Format::E5M2 => "e5m2",
            Fp8Format::E4M3 => "e4m3",
        }
    }

    /// The safetensors dtype that stores this format.
    pub const fn safetensors_dtype(self) -> safetensors::Dtype {
        match self {
            Fp8Format::E5M2 => safetensors::Dtype::F8_E5M2,
            Fp8Format::E4M3 => safetensors::Dtype::F8_E4M3,
        }
    }

    /// The format stored under a safetensors dtype, if it is one of the two.
    pub fn from_safetensors_dtype(dtype: safetensors::Dtype) -> Option<Self> {
        match dtype {
            safetensors::Dtype::F8_E5M2 => Some(Fp8Format::E5M2),
            safetensors::Dtype::F8_E4M3 => Some(Fp8Format::E4M3),
            _ => None,
        }
    }

    /// Converts one value: round to nearest even, saturating, NaN kept.
    #[inline(always)]
    pub fn encode(self, value: f32) -> u8 {
        let p = self.params();
        let bits = value.to_bits();
        let sign = (bits >> 24) & 0x80;
        let abs = bits & 0x7fff_ffff;

        let shift = 23 - p.mantissa_bits;
        let rounded = abs + ((1 << (shift - 1)) - 1) + ((abs >> shift) & 1);
        let normal = (rounded >> shift).wrapping_sub(p.rebias);
        let subnormal = (f32::from_bits(abs) * p.subnormal_scale + ROUNDING_MAGIC).to_bits()
            - ROUNDING_MAGIC.to_bits();

        // Every candidate is computed and one is selected (no branch), in 32 bits: this keeps
        // a loop of conversions vectorisable, with a single narrowing at the end.
        let magnitude = if abs > 0x7f80_0000 {
            u32::from(p.nan_code)
        } else if abs >= p.max_bits {
            u32::from(p.max_code)
        } else if abs < p.min_normal_bits {
            subnormal
        } else {
            normal
        };
        (sign | magnitude) as u8
    }

    /// Converts one code to the `f32` it stands for (exact).
    #[inline(always)]
    pub fn decode(self, code: u8) -> f32 {
        self.table()[code as usize]
    }

    /// All 256 decoded values, indexed by code.
    pub fn table(self) -> &'static [f32; 256] {
        static E5M2_TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| decode_table(Fp8Format::E5M2));
        static E4M3_TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| decode_table(Fp8Format::E4M3));
        match self {
            Fp8Format::E5M2 => &E5M2_TABLE,
            Fp8Format::E4M3 => &E4M3_TABLE,
        }
    }
}

/// Decodes every code from the format's definition (sign, biased exponent, mantissa).
fn decode_table(format: Fp8Format) -> [f32; 256] {
    let p = format.params();
    let mantissa_bits = p.mantissa_bits as i32;
    let exponent_bits = 7 - mantissa_bits;
    let bias = (1 << (exponent_bits - 1)) - 1;
    let exponent_max = (1 << exponent_bits) - 1;
    std::array::from_fn(|code| {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let exponent = ((code & 0x7f) >> mantissa_bits) as i32;
        let mantissa = (code & ((1 << mantissa_bits) - 1)) as i32;
        let magnitude = match format {
            Fp8Format::E5M2 if exponent == exponent_max && mantissa == 0 => f32::INFINITY,
            Fp8Format::E5M2 if exponent == exponent_max => f32::NAN,
            Fp8Format::E4M3 if (code & 0x7f) == 0x7f => f32::NAN,
            _ if exponent == 0 => mantissa as f32 * 2f32.powi(1 - bias - mantissa_bits),
            _ => (1.0 + mantissa as f32 / (1 << mantissa_bits) as f32) * 2f32.powi(exponent - bias),
        };
        sign * magnitude
    })
}

impl fmt::Display for Fp8Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fp8Format {
    type Err = QuantError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fp8Format::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| QuantError::UnknownFormat(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips() {
        for format in Fp8Format::ALL {
            for code in 0..=255u8 {
                let value = format.decode(code);
                if value.is_finite() && code != 0x80 {
                    assert_eq!(format.encode(value), code, "{format} code {code:#04x}");
                }
            }
        }
    }

    #[test]
    fn max_and_saturation() {
        for format in Fp8Format::ALL {
            let max = format.max();
            assert_eq!(format.decode(format.encode(max)), max);
            assert_eq!(format.decode(format.encode(f32::INFINITY)), max);
            assert_eq!(format.decode(format.encode(f32::NEG_INFINITY)), -max);
            assert_eq!(format.decode(format.encode(max * 1.5)), max);
            assert!(format.decode(format.encode(f32::NAN)).is_nan());
        }
        assert_eq!(Fp8Format::E5M2.max(), 57344.0);
        assert_eq!(Fp8Format::E4M3.max(), 448.0);
    }

    /// Independent reference: the nearest representable value by exhaustive search, ties to the
    /// even code, in f64.
    fn nearest(format: Fp8Format, x: f32) -> u8 {
        let x = (x as f64).clamp(-(format.max() as f64), format.max() as f64);
        let mut best = 0u8;
        let mut best_err = f64::INFINITY;
        for code in 0..=255u8 {
            let v = format.decode(code) as f64;
            if !v.is_finite() || (v == 0.0 && code == 0x80) {
                continue;
            }
            let err = (v - x).abs();
            if err < best_err || (err == best_err && code % 2 == 0) {
                best = code;
                best_err = err;
            }
        }
        if best == 0 && x.is_sign_negative() {
            0x80
        } else {
            best
        }
    }

    #[test]
    fn matches_exhaustive_nearest_search() {
        let mut state = 0x2545_f491_u32;
        for format in Fp8Format::ALL {
            for _ in 0..20_000 {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let exponent = (state % 40) as i32 - 24;
                let x = f32::from_bits(state) % 1.0 * 2f32.powi(exponent);
                if x.is_finite() {
                    assert_eq!(format.encode(x), nearest(format, x), "{format} {x:e}");
                }
            }
        }
    }
}
