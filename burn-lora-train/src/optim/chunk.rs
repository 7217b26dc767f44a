//! The optimizer's state chunk by chunk: consecutive parameters of one dtype and moment format
//! as flat tensors, their 8-bit or f32 moments, and the update as Burn tensor ops on whichever
//! backend holds the state.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Int, IntDType, Tensor, TensorData};

use super::{AdamWConfig, BLOCK, MIN_8BIT_NUMEL, tensor_bytes};
use crate::config::OptimizerKind;

/// One stored moment: f32 values, or 8-bit codes with a scale per block.
#[derive(Clone, Debug)]
pub enum Moment<B: Backend> {
    /// The values.
    F32(Tensor<B, 1>),
    /// Codes, and each block's largest magnitude.
    Q8 {
        /// One code per value.
        codes: Tensor<B, 1, Int>,
        /// One scale per block of [`BLOCK`] values.
        absmax: Tensor<B, 1>,
    },
}

/// Which of the two moments: they differ only in the 8-bit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    /// First moment, signed code on `m`.
    First,
    /// Second moment, unsigned code on `sqrt(v)`.
    Second,
}

impl Which {
    /// The largest code's magnitude.
    pub fn levels(self) -> f64 {
        match self {
            Which::First => 127.0,
            Which::Second => 255.0,
        }
    }

    /// The codes' dtype.
    pub fn code_dtype(self) -> IntDType {
        match self {
            Which::First => IntDType::I8,
            Which::Second => IntDType::U8,
        }
    }

    /// The key suffix of the saved moment.
    pub fn name(self) -> &'static str {
        match self {
            Which::First => "m",
            Which::Second => "v",
        }
    }
}

impl<B: Backend> Moment<B> {
    /// Zeros for `len` values (a multiple of [`BLOCK`] when `quantized`): what
    /// [`Moment::quantize`] makes of zeros, codes 0 and block scales 0.
    pub fn zeros(len: usize, quantized: bool, which: Which, device: &B::Device) -> Self {
        if quantized {
            Self::Q8 {
                codes: Tensor::zeros([len], (device, DType::from(which.code_dtype()))),
                absmax: Tensor::zeros([len / BLOCK], (device, DType::F32)),
            }
        } else {
            Self::F32(Tensor::zeros([len], (device, DType::F32)))
        }
    }

    /// Encodes `values` (`len` a multiple of [`BLOCK`]); for [`Which::Second`], `values` is `v`.
    pub fn quantize(values: Tensor<B, 1>, which: Which) -> Self {
        let [len] = values.dims();
        let blocks = match which {
            Which::First => values,
            Which::Second => values.sqrt(),
        }
        .reshape([len / BLOCK, BLOCK]);
        let absmax = blocks.clone().abs().max_dim(1);
        let y = blocks / absmax.clone().clamp_min(f32::MIN_POSITIVE);
        let magnitude = y
            .clone()
            .abs()
            .sqrt()
            .sqrt()
            .mul_scalar(which.levels())
            .round();
        let q = match which {
            Which::First => y.sign() * magnitude,
            // At least code 1 for any positive value.
            Which::Second => magnitude.max_pair(y.greater_elem(0.0).float()),
        };
        Self::Q8 {
            codes: q.reshape([len]).cast(which.code_dtype()),
            absmax: absmax.reshape([len / BLOCK]),
        }
    }

    /// The stored values as f32 (`v` for [`Which::Second`]).
    pub fn values(&self, which: Which) -> Tensor<B, 1> {
        match self {
            Self::F32(values) => values.clone(),
            Self::Q8 { codes, absmax } => {
                let [len] = codes.dims();
                let q = codes
                    .clone()
                    .cast(FloatDType::F32)
                    .reshape([len / BLOCK, BLOCK]);
                let y = q.clone().abs().div_scalar(which.levels()).square().square();
                let y = match which {
                    Which::First => q.sign() * y,
                    Which::Second => y,
                };
                let x = (y * absmax.clone().reshape([len / BLOCK, 1])).reshape([len]);
                match which {
                    Which::First => x,
                    Which::Second => x.square(),
                }
            }
        }
    }

    /// The tensors to save, with their key suffixes.
    pub fn parts(&self, which: Which) -> Vec<(String, Part<B>)> {
        match self {
            Self::F32(values) => vec![(which.name().to_string(), Part::Float(values.clone()))],
            Self::Q8 { codes, absmax } => vec![
                (format!("{}.codes", which.name()), Part::Int(codes.clone())),
                (
                    format!("{}.absmax", which.name()),
                    Part::Float(absmax.clone()),
                ),
            ],
        }
    }

    /// The values of one member (for 8-bit moments, its whole blocks).
    pub fn member(&self, member: &Member) -> Self {
        match self {
            Self::F32(values) => Self::F32(member_values(values, member)),
            Self::Q8 { codes, absmax } => {
                let span = member.span(true);
                Self::Q8 {
                    codes: codes.clone().narrow(0, member.offset, span),
                    absmax: absmax
                        .clone()
                        .narrow(0, member.offset / BLOCK, span / BLOCK),
                }
            }
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32(values) => tensor_bytes(values.dims()[0], values.dtype()),
            Self::Q8 { codes, absmax } => {
                tensor_bytes(codes.dims()[0], codes.dtype())
                    + tensor_bytes(absmax.dims()[0], absmax.dtype())
            }
        }
    }
}

/// One saved tensor of the state: float values or 8-bit codes.
#[derive(Clone, Debug)]
pub enum Part<B: Backend> {
    /// f32 values.
    Float(Tensor<B, 1>),
    /// Codes.
    Int(Tensor<B, 1, Int>),
}

impl<B: Backend> Part<B> {
    /// The values' dtype.
    pub fn dtype(&self) -> DType {
        match self {
            Self::Float(t) => t.dtype(),
            Self::Int(t) => t.dtype(),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            Self::Float(t) => t.dims()[0],
            Self::Int(t) => t.dims()[0],
        }
    }

    /// The values, read where they live.
    pub fn to_data(&self) -> TensorData {
        match self {
            Self::Float(t) => t.to_data(),
            Self::Int(t) => t.to_data(),
        }
    }
}

/// One parameter's place in its chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The module path, the key of its saved state.
    pub path: String,
    /// Values in the parameter.
    pub numel: usize,
    /// Where its values start in the chunk.
    pub offset: usize,
}

impl Member {
    /// The values it takes in its chunk: its own, padded to whole blocks when `quantized`.
    pub fn span(&self, quantized: bool) -> usize {
        span(self.numel, quantized)
    }
}

/// `numel` values padded to whole blocks when `quantized`.
fn span(numel: usize, quantized: bool) -> usize {
    if quantized {
        numel.div_ceil(BLOCK) * BLOCK
    } else {
        numel
    }
}

/// Consecutive parameters of one dtype and moment format, updated together as one flat
/// tensor. Every flat tensor of the chunk (moments, master, gradient) has `len` values: the
/// members one after another, each padded to a whole [`BLOCK`] when the moments are 8-bit (so
/// that no block straddles two parameters), the padding 0.
#[derive(Clone, Debug)]
pub struct Chunk<B: Backend> {
    /// The parameters' dtype.
    pub dtype: DType,
    /// Whether the moments are 8-bit.
    pub quantized: bool,
    /// The parameters, in order.
    pub members: Vec<Member>,
    /// Values in each flat tensor of the chunk.
    pub len: usize,
    /// The first moment.
    pub m: Moment<B>,
    /// The second moment.
    pub v: Moment<B>,
    /// The f32 values of the members: for 16-bit parameters the master copy they are rounded
    /// from, for f32 parameters the very values they hold.
    pub master: Tensor<B, 1>,
}

/// The layout of chunks over `entries` (path, dtype, values) in order: consecutive parameters
/// of one dtype and moment format, up to `chunk_values` values each. Returns per chunk its dtype,
/// moment format, members and length.
pub fn plan_chunks(
    entries: &[(String, DType, usize)],
    kind: OptimizerKind,
    chunk_values: usize,
) -> Vec<(DType, bool, Vec<Member>, usize)> {
    let mut chunks: Vec<(DType, bool, Vec<Member>, usize)> = Vec::new();
    for (path, dtype, numel) in entries {
        let quantized = kind == OptimizerKind::AdamW8bit && *numel >= MIN_8BIT_NUMEL;
        let padded = span(*numel, quantized);
        let fits = chunks.last().is_some_and(|(d, q, _, len)| {
            d == dtype && *q == quantized && len + padded <= chunk_values
        });
        if !fits {
            chunks.push((*dtype, quantized, Vec::new(), 0));
        }
        let (_, _, members, len) = chunks.last_mut().expect("a chunk was just pushed");
        members.push(Member {
            path: path.clone(),
            numel: *numel,
            offset: *len,
        });
        *len += padded;
    }
    chunks
}

/// The members' tensors (flattened, in `dtype`) laid out as the chunk's flat tensor on
/// `device`; members without one are zeros. `None` when no member has one.
pub fn gather<B: Backend>(
    members: &[Member],
    len: usize,
    dtype: DType,
    mut tensor: impl FnMut(&Member) -> Option<Tensor<B, 1>>,
) -> Option<Tensor<B, 1>> {
    let mut flat: Option<Tensor<B, 1>> = None;
    for member in members {
        let Some(values) = tensor(member) else {
            continue;
        };
        let base = flat.unwrap_or_else(|| Tensor::zeros([len], (&values.device(), dtype)));
        let range = member.offset..member.offset + member.numel;
        flat = Some(base.slice_assign(range, values));
    }
    flat
}

/// The member's values of the chunk's flat tensor.
pub fn member_values<B: Backend>(flat: &Tensor<B, 1>, member: &Member) -> Tensor<B, 1> {
    flat.clone().narrow(0, member.offset, member.numel)
}

/// What one optimizer step applies to every chunk.
#[derive(Clone, Copy, Debug)]
pub struct UpdateStep {
    /// The hyperparameters.
    pub config: AdamWConfig,
    /// The step, from 1 (`t` of the bias correction).
    pub t: u64,
    /// The learning rate.
    pub lr: f64,
    /// The clipping factor of the gradients (1: none).
    pub grad_scale: f64,
}

impl<B: Backend> Chunk<B> {
    /// The AdamW update of the chunk with its gradient `g` (in the parameters' dtype):
    /// updates the state and returns the new values in the parameters' dtype.
    pub fn update(&mut self, step: &UpdateStep, g: Tensor<B, 1>) -> Tensor<B, 1> {
        let UpdateStep {
            config: c,
            t,
            lr,
            grad_scale,
        } = *step;
        let mut g = g.cast(FloatDType::F32);
        if grad_scale != 1.0 {
            g = g.mul_scalar(grad_scale);
        }
        let m = self
            .m
            .values(Which::First)
            .mul_scalar(c.beta1)
            .add(g.clone().mul_scalar(1.0 - c.beta1));
        let v = self
            .v
            .values(Which::Second)
            .mul_scalar(c.beta2)
            .add(g.square().mul_scalar(1.0 - c.beta2));
        let t = t as i32;
        let m_hat = m.clone().div_scalar(1.0 - c.beta1.powi(t));
        let v_hat = v.clone().div_scalar(1.0 - c.beta2.powi(t));
        let step = m_hat / v_hat.sqrt().add_scalar(c.epsilon);
        let weights =
            self.master.clone().mul_scalar(1.0 - lr * c.weight_decay) - step.mul_scalar(lr);
        (self.m, self.v) = if self.quantized {
            (
                Moment::quantize(m, Which::First),
                Moment::quantize(v, Which::Second),
            )
        } else {
            (Moment::F32(m), Moment::F32(v))
        };
        self.master = weights.clone();
        weights.cast(self.dtype)
    }
}
