//! The update of a chunk whose state is in host memory ([`super::OnHost`]): one pass over the
//! values on all cores, instead of a pass per tensor op on one. Each value goes through the
//! operations [`Chunk::update`] applies with Burn's tensor ops, in the same order, each rounded
//! to f32, and is rounded to its dtype to nearest even. Flex's tensor ops give the same values
//! but for the last bit of a few (its casts to bf16 decide ties from the top bits only, its
//! vectorised division rounds some quotients the other way), which can move a code by one.

use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData, bf16, f16};
use rayon::prelude::*;

use std::collections::BTreeMap;

use burn_offload::HostGradient;

use super::chunk::{Chunk, Member, Moment, UpdateStep};
use super::{BLOCK, CODE_POWER, upload};

const _: () = assert!(
    CODE_POWER == 4.0,
    "the host's code is written for the power 4"
);

/// Values per task of the f32-moment update.
const SPAN: usize = 1 << 14;

/// A parameter dtype: read as f32, written back rounded to nearest even.
trait Value: Copy + Send + Sync + bytemuck::Zeroable + burn::tensor::Element {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Value for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Value for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    /// `half`'s conversion (to nearest even; a NaN stays a quiet NaN of the same sign) without
    /// its branches, so that the loops around it vectorize.
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
        let quiet = (bits >> 16) | 0x0040;
        bf16::from_bits(if value.is_nan() { quiet } else { rounded } as u16)
    }
}

impl Value for f16 {
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

/// The scalars of the update, each rounded to f32 as Burn's scalar ops round them.
#[derive(Clone, Copy)]
struct Scalars {
    /// 1 without clipping (a product by 1 is exact).
    grad_scale: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    correction1: f32,
    correction2: f32,
    epsilon: f32,
    decay: f32,
    lr: f32,
}

impl Scalars {
    fn new(step: &UpdateStep) -> Self {
        let c = step.config;
        let t = step.t as i32;
        Self {
            grad_scale: step.grad_scale as f32,
            beta1: c.beta1 as f32,
            one_minus_beta1: (1.0 - c.beta1) as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            correction1: (1.0 - c.beta1.powi(t)) as f32,
            correction2: (1.0 - c.beta2.powi(t)) as f32,
            epsilon: c.epsilon as f32,
            decay: (1.0 - step.lr * c.weight_decay) as f32,
            lr: step.lr as f32,
        }
    }

    /// One value: the new `(m, v, weight)` from the old moments, the gradient and the master.
    #[inline]
    fn step(&self, m: f32, v: f32, g: f32, master: f32) -> (f32, f32, f32) {
        let g = g * self.grad_scale;
        let m = m * self.beta1 + g * self.one_minus_beta1;
        let v = v * self.beta2 + (g * g) * self.one_minus_beta2;
        let m_hat = m / self.correction1;
        let v_hat = v / self.correction2;
        let step = m_hat / (v_hat.sqrt() + self.epsilon);
        (m, v, master * self.decay - step * self.lr)
    }
}

/// The sums of the `members`' gradients (in host memory, by path, taken out of `sums`) laid
/// out as the chunk's flat gradient of `len` values in `dtype`, zeros elsewhere, converted on
/// all cores; `None` when no member has one.
pub fn gather_sums(
    members: &[Member],
    len: usize,
    dtype: DType,
    sums: &mut BTreeMap<String, HostGradient<'_>>,
) -> Option<TensorData> {
    match dtype {
        DType::BF16 => gather_typed::<bf16>(members, len, sums),
        DType::F16 => gather_typed::<f16>(members, len, sums),
        _ => gather_typed::<f32>(members, len, sums),
    }
}

fn gather_typed<T: Value>(
    members: &[Member],
    len: usize,
    sums: &mut BTreeMap<String, HostGradient<'_>>,
) -> Option<TensorData> {
    let mut flat: Option<Vec<T>> = None;
    for member in members {
        let Some(sum) = sums.remove(&member.path) else {
            continue;
        };
        // Zeroed pages, touched first by the conversion on all cores.
        let flat = flat.get_or_insert_with(|| bytemuck::zeroed_vec(len));
        let to = &mut flat[member.offset..member.offset + member.numel];
        match sum {
            HostGradient::F32(from) => convert(to, from),
            HostGradient::Bf16(from) => convert(to, from),
            HostGradient::F16(from) => convert(to, from),
        }
    }
    flat.map(|flat| TensorData::new(flat, [len]))
}

/// `from`'s values into `to`, each rounded to `T` to nearest even, on all cores.
fn convert<T: Value, S: Value>(to: &mut [T], from: &[S]) {
    to.par_chunks_mut(SPAN)
        .zip(from.par_chunks(SPAN))
        .for_each(|(to, from)| {
            for (t, &f) in to.iter_mut().zip(from) {
                *t = T::from_f32(f.to_f32());
            }
        });
}

/// `values` (f32, bf16 or f16) as f32, converted on all cores.
pub fn to_f32(values: TensorData) -> TensorData {
    fn typed<T: Value>(values: &[T]) -> Vec<f32> {
        values.par_iter().map(|v| v.to_f32()).collect()
    }
    let shape = values.shape.clone();
    let converted = match values.dtype {
        DType::BF16 => typed::<bf16>(values.as_slice().expect("bf16 values")),
        DType::F16 => typed::<f16>(values.as_slice().expect("f16 values")),
        _ => return values,
    };
    TensorData::new(converted, shape)
}

/// The sum of the squares of `values` (f32, bf16 or f16), rounded to f32: each task's part in
/// f64, the parts added in order, so the result does not depend on the threads.
pub fn square_sum(values: &TensorData) -> f32 {
    fn typed<T: Value>(values: &[T]) -> f64 {
        let parts: Vec<f64> = values
            .par_chunks(SPAN)
            .map(|part| {
                part.iter()
                    .map(|&v| {
                        let v = f64::from(v.to_f32());
                        v * v
                    })
                    .sum()
            })
            .collect();
        parts.iter().sum()
    }
    let sum = match values.dtype {
        DType::BF16 => typed::<bf16>(values.as_slice().expect("bf16 values")),
        DType::F16 => typed::<f16>(values.as_slice().expect("f16 values")),
        _ => typed::<f32>(values.as_slice().expect("f32 values")),
    };
    sum as f32
}

/// [`Chunk::update`] on the CPU's cores.
pub fn update(chunk: &mut Chunk<Flex>, step: &UpdateStep, g: Tensor<Flex, 1>) -> Tensor<Flex, 1> {
    match chunk.dtype {
        DType::BF16 => update_typed::<bf16>(chunk, step, g),
        DType::F16 => update_typed::<f16>(chunk, step, g),
        _ => update_typed::<f32>(chunk, step, g),
    }
}

/// `values` as a tensor of their dtype.
fn vector<E: burn::tensor::Element, K: burn::tensor::BasicOps<Flex>>(
    values: Vec<E>,
    device: &<Flex as burn::tensor::backend::BackendTypes>::Device,
) -> Tensor<Flex, 1, K> {
    let len = values.len();
    upload(TensorData::new(values, [len]), device)
}

fn floats(tensor: Tensor<Flex, 1>) -> Vec<f32> {
    tensor
        .into_data()
        .into_vec()
        .expect("the optimizer's f32 state")
}

fn update_typed<T: Value>(
    chunk: &mut Chunk<Flex>,
    step: &UpdateStep,
    g: Tensor<Flex, 1>,
) -> Tensor<Flex, 1> {
    let device = g.device();
    // The new values are written over the gradient, each value's after it was read.
    let mut g: Vec<T> = g
        .into_data()
        .into_vec()
        .expect("a gradient in the parameters' dtype");
    let s = Scalars::new(step);
    let taken = |moment: &mut Moment<Flex>| {
        std::mem::replace(moment, Moment::F32(Tensor::empty([0], &device)))
    };
    let mut master = floats(std::mem::replace(
        &mut chunk.master,
        Tensor::empty([0], &device),
    ));
    match (taken(&mut chunk.m), taken(&mut chunk.v)) {
        (Moment::F32(m), Moment::F32(v)) => {
            let (mut m, mut v) = (floats(m), floats(v));
            m.par_chunks_mut(SPAN)
                .zip(v.par_chunks_mut(SPAN))
                .zip(master.par_chunks_mut(SPAN))
                .zip(g.par_chunks_mut(SPAN))
                .for_each(|(((m, v), master), g)| {
                    for i in 0..m.len() {
                        let (mi, vi, w) = s.step(m[i], v[i], g[i].to_f32(), master[i]);
                        (m[i], v[i], master[i], g[i]) = (mi, vi, w, T::from_f32(w));
                    }
                });
            chunk.m = Moment::F32(vector(m, &device));
            chunk.v = Moment::F32(vector(v, &device));
        }
        (
            Moment::Q8 {
                codes: m_codes,
                absmax: m_absmax,
            },
            Moment::Q8 {
                codes: v_codes,
                absmax: v_absmax,
            },
        ) => {
            let ints = |codes: Tensor<Flex, 1, Int>| codes.into_data();
            let mut m_codes: Vec<i8> = ints(m_codes).into_vec().expect("i8 codes");
            let mut v_codes: Vec<u8> = ints(v_codes).into_vec().expect("u8 codes");
            let (mut m_absmax, mut v_absmax) = (floats(m_absmax), floats(v_absmax));
            m_codes
                .par_chunks_mut(BLOCK)
                .zip(v_codes.par_chunks_mut(BLOCK))
                .zip(m_absmax.par_iter_mut())
                .zip(v_absmax.par_iter_mut())
                .zip(master.par_chunks_mut(BLOCK))
                .zip(g.par_chunks_mut(BLOCK))
                .for_each(|(((((mc, vc), ma), va), master), g)| {
                    // Simple loops over whole blocks, which the compiler vectorizes.
                    let (master, g): (&mut [f32; BLOCK], &mut [T; BLOCK]) = (
                        master.try_into().expect("whole blocks"),
                        g.try_into().expect("whole blocks"),
                    );
                    let (mut m, mut w) = ([0f32; BLOCK], [0f32; BLOCK]);
                    for i in 0..BLOCK {
                        m[i] = decode_signed(mc[i], *ma);
                        w[i] = decode_unsigned(vc[i], *va);
                    }
                    for i in 0..BLOCK {
                        let (mi, vi, wi) = s.step(m[i], w[i], g[i].to_f32(), master[i]);
                        (m[i], w[i], master[i]) = (mi, vi.sqrt(), wi);
                    }
                    for i in 0..BLOCK {
                        g[i] = T::from_f32(master[i]);
                    }
                    *ma = encode_signed(&m, mc);
                    *va = encode_unsigned(&w, vc);
                });
            chunk.m = Moment::Q8 {
                codes: vector(m_codes, &device),
                absmax: vector(m_absmax, &device),
            };
            chunk.v = Moment::Q8 {
                codes: vector(v_codes, &device),
                absmax: vector(v_absmax, &device),
            };
        }
        _ => unreachable!("both moments of a chunk have one format"),
    }
    chunk.master = vector(master, &device);
    vector(g, &device)
}

/// `x^4`, as the tensor ops compute the code's power.
fn fourth_power(x: f32) -> f32 {
    let square = x * x;
    square * square
}

/// `x^(1/4)`, as the tensor ops compute the code's root.
fn fourth_root(x: f32) -> f32 {
    x.sqrt().sqrt()
}

/// `x` rounded to the nearest integer, ties to even, for `|x| < 2²²`: adding and taking away
/// 1.5 · 2²³ leaves the integer that f32's own rounding (to nearest even) chose, without a call
/// to the C library's `rintf` (x86-64's baseline has no rounding instruction), so that the
/// loop around it vectorizes.
fn round_even(x: f32) -> f32 {
    const SHIFT: f32 = 12_582_912.0;
    (x + SHIFT) - SHIFT
}

/// Burn's `sign`.
fn sign(x: f32) -> f32 {
    if x.is_nan() {
        x
    } else if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// A first-moment value from its code and its block's absmax.
fn decode_signed(code: i8, absmax: f32) -> f32 {
    let q = f32::from(code);
    let y = fourth_power(q.abs() / 127.0);
    (sign(q) * y) * absmax
}

/// A second-moment value (`v`) from the code of `sqrt(v)` and its block's absmax.
fn decode_unsigned(code: u8, absmax: f32) -> f32 {
    let y = fourth_power(f32::from(code) / 255.0);
    let x = y * absmax;
    x * x
}

/// The block's absmax, and its codes in `codes`: `code(y, round(levels · |y|^(1/4)))` for each
/// value at ratio `y` of the absmax.
fn encode<T>(
    values: &[f32; BLOCK],
    levels: f32,
    codes: &mut [T],
    code: impl Fn(f32, f32) -> T,
) -> f32 {
    let absmax = values
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x.abs()));
    let scale = absmax.max(f32::MIN_POSITIVE);
    for (c, &x) in codes.iter_mut().zip(values) {
        let y = x / scale;
        *c = code(y, round_even(fourth_root(y.abs()) * levels));
    }
    absmax
}

/// [`encode`] of the first moment: `q = round(127 · sign(y) · |y|^(1/4))`.
fn encode_signed(values: &[f32; BLOCK], codes: &mut [i8]) -> f32 {
    encode(values, 127.0, codes, |y, magnitude| {
        (sign(y) * magnitude) as i8
    })
}

/// [`encode`] of `sqrt(v)`: `q = round(255 · y^(1/4))`, at least 1 for `y > 0`.
fn encode_unsigned(values: &[f32; BLOCK], codes: &mut [u8]) -> f32 {
    encode(values, 255.0, codes, |y, magnitude| {
        magnitude.max(if y > 0.0 { 1.0 } else { 0.0 }) as u8
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OptimizerKind;
    use crate::optim::AdamWConfig;
    use crate::optim::chunk::{Member, Which};

    /// A chunk of `len` values with moments from a first update of `g0` (so that they are not
    /// zero) and the given master values.
    fn chunk(quantized: bool, dtype: DType, len: usize, seed: f32) -> Chunk<Flex> {
        let device = Default::default();
        let wave = |k: f32| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as f32 + seed) * k).sin() * (1.0 + (i % 7) as f32))
                .collect()
        };
        let tensor = |v: Vec<f32>| Tensor::<Flex, 1>::from_floats(v.as_slice(), &device);
        let m = tensor(wave(0.37)).mul_scalar(1e-3);
        let v = tensor(wave(0.91)).powi_scalar(2).mul_scalar(1e-6);
        let (m, v) = if quantized {
            (
                Moment::quantize(m, Which::First),
                Moment::quantize(v, Which::Second),
            )
        } else {
            (Moment::F32(m), Moment::F32(v))
        };
        Chunk {
            dtype,
            quantized,
            members: vec![Member {
                path: "p".into(),
                numel: len,
                offset: 0,
            }],
            len,
            m,
            v,
            master: tensor(wave(0.13)),
        }
    }

    /// The values of a tensor of any dtype, as f64.
    fn numbers(data: TensorData) -> Vec<f64> {
        data.convert::<f64>().to_vec().unwrap()
    }

    fn moment(moment: &Moment<Flex>) -> Vec<Vec<f64>> {
        match moment {
            Moment::F32(values) => vec![numbers(values.to_data())],
            Moment::Q8 { codes, absmax } => {
                vec![numbers(codes.to_data()), numbers(absmax.to_data())]
            }
        }
    }

    /// `a` and `b` agree within `relative` of each value plus `absolute`, and exactly for all
    /// but one in a hundred.
    fn close(a: &[f64], b: &[f64], (relative, absolute): (f64, f64), case: &str) {
        assert_eq!(a.len(), b.len(), "{case}");
        let mut apart = 0;
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            let tolerance = relative * x.abs() + absolute;
            assert!((x - y).abs() <= tolerance, "{case}[{i}]: {x} against {y}");
            apart += usize::from(x != y);
        }
        assert!(
            apart * 100 <= a.len(),
            "{case}: {apart} of {} differ",
            a.len()
        );
    }

    #[test]
    fn the_bf16_conversion_is_halfs() {
        // A stride through every f32 bit pattern, and every pattern around each rounding
        // boundary of a few exponents.
        let around = (0..=u16::MAX).flat_map(|hi| {
            let base = u32::from(hi) << 16;
            [
                base,
                base | 0x7FFF,
                base | 0x8000,
                base | 0x8001,
                base | 0xFFFF,
            ]
        });
        for bits in (0..=u32::MAX).step_by(65_537).chain(around) {
            let x = f32::from_bits(bits);
            assert_eq!(
                <bf16 as Value>::from_f32(x).to_bits(),
                bf16::from_f32(x).to_bits(),
                "{bits:#010x}"
            );
        }
    }

    #[test]
    fn rounding_by_shifting_is_rounding_to_nearest_even() {
        // Every f32 in [0, 256] with at most 12 fraction bits (ties included), and around them.
        for i in 0..=(256 << 12) {
            let x = i as f32 / 4096.0;
            for x in [
                x,
                -x,
                f32::from_bits(x.to_bits() + 1),
                f32::from_bits(x.to_bits().max(1) - 1),
            ] {
                assert_eq!(round_even(x), x.round_ties_even(), "{x}");
            }
        }
    }

    #[test]
    fn the_host_update_agrees_with_the_tensor_ops() {
        let device = Default::default();
        for (quantized, dtype, grad_scale) in [
            (false, DType::F32, 1.0),
            (false, DType::BF16, 0.37),
            (true, DType::BF16, 1.0),
            (true, DType::F32, 0.61),
        ] {
            let len = 16 * BLOCK;
            let g: Vec<f32> = (0..len).map(|i| ((i as f32) * 0.71).cos() * 0.1).collect();
            let g = Tensor::<Flex, 1>::from_floats(g.as_slice(), &device).cast(dtype);
            let kind = if quantized {
                OptimizerKind::AdamW8bit
            } else {
                OptimizerKind::AdamW
            };
            let step = UpdateStep {
                config: AdamWConfig::new(kind, 0.1),
                t: 3,
                lr: 1e-2,
                grad_scale,
            };
            let mut ops = chunk(quantized, dtype, len, 1.0);
            let mut host = chunk(quantized, dtype, len, 1.0);
            let by_ops = numbers(ops.update(&step, g.clone()).into_data());
            let by_host = numbers(update(&mut host, &step, g).into_data());
            let case = format!("{quantized} {dtype:?} {grad_scale}");
            // One step of the parameters' dtype; two of f32 for the state.
            let ulp = if dtype == DType::F32 {
                2.0 / 8388608.0
            } else {
                1.0 / 128.0
            };
            close(&by_ops, &by_host, (ulp, 0.0), &format!("{case} values"));
            close(
                &numbers(ops.master.to_data()),
                &numbers(host.master.to_data()),
                (2.0 / 8388608.0, 0.0),
                &format!("{case} master"),
            );
            for (which, a, b) in [("m", &ops.m, &host.m), ("v", &ops.v, &host.v)] {
                for (part, (x, y)) in moment(a).iter().zip(&moment(b)).enumerate() {
                    // Codes within one step, the rest within two f32 steps.
                    let tolerance = if quantized && part == 0 {
                        (0.0, 1.0)
                    } else {
                        (2.0 / 8388608.0, 0.0)
                    };
                    close(x, y, tolerance, &format!("{case} {which}{part}"));
                }
            }
        }
    }
}
