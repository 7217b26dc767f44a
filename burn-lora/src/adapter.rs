//! The trainable adapter modules: LoRA / LoCon and LoKr weights.
//!
//! Weights use the PyTorch orientation (`down` is `[rank, in]`, `up` is `[out, rank]`), with a
//! convolution's kernel flattened into the input axis (`in·kh·kw`). For a convolution, the
//! Kronecker product of `w1 [o₁, i₁]` and a flattened `w2 [o₂, i₂·kh·kw]` has the same values
//! as the 4-D product LyCORIS computes, so one 2-D representation serves both layer kinds.

use burn::module::{Module, Param, ParamId};
use burn::nn::{Dropout, DropoutConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor, TensorCreationOptions, TensorData};
use burn_kernels::{Kernels, linear, trainable};

use crate::LoraError;
use crate::config::{AdapterConfig, LokrConfig, LoraConfig, factorize};
use crate::set::{LokrFactor, StoredAdapter};

/// The shape of the base layer an adapter is attached to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Output features (channels).
    pub out_features: usize,
    /// Input features (channels).
    pub in_features: usize,
    /// The kernel size of a convolution, `None` for a linear layer.
    pub kernel: Option<[usize; 2]>,
}

impl Geometry {
    /// `in_features · kh · kw`: the width of the flattened weight.
    pub fn fan_in(&self) -> usize {
        self.in_features * self.kernel_area()
    }

    fn kernel_area(&self) -> usize {
        self.kernel.map_or(1, |[h, w]| h * w)
    }

    /// File shape of a matrix with `rows` rows over the layer input: `[rows, in]` or
    /// `[rows, in, kh, kw]`.
    pub(crate) fn over_input(&self, rows: usize, in_features: usize) -> Vec<usize> {
        match self.kernel {
            None => vec![rows, in_features],
            Some([h, w]) => vec![rows, in_features, h, w],
        }
    }

    /// File shape of the LoRA up matrix: `[out, rank]` or `[out, rank, 1, 1]`.
    pub(crate) fn up_shape(&self, rank: usize) -> Vec<usize> {
        match self.kernel {
            None => vec![self.out_features, rank],
            Some(_) => vec![self.out_features, rank, 1, 1],
        }
    }
}

/// Which adapter family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterKind {
    /// LoRA (LoCon over a convolution).
    Lora,
    /// LoKr.
    Lokr,
}

/// LoRA / LoCon weights: `ΔW = scale · up · down`.
#[derive(Module, Debug)]
pub struct LoraWeights<B: Backend> {
    down: Param<Tensor<B, 2>>,
    up: Param<Tensor<B, 2>>,
    alpha: f64,
    rslora: bool,
    dropout: Dropout,
}

/// LoKr weights: `ΔW = scale · w1 ⊗ w2`, with `w2` full or `w2_a · w2_b`.
#[derive(Module, Debug)]
pub struct LokrWeights<B: Backend> {
    w1: Param<Tensor<B, 2>>,
    w2: Option<Param<Tensor<B, 2>>>,
    w2_a: Option<Param<Tensor<B, 2>>>,
    w2_b: Option<Param<Tensor<B, 2>>>,
    alpha: f64,
    dropout: Dropout,
}

/// A trainable adapter attached to a base layer.
// One adapter per layer, never in bulk collections: the variant size difference is harmless.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Adapter<B: Backend> {
    /// LoRA / LoCon.
    Lora(LoraWeights<B>),
    /// LoKr.
    Lokr(LokrWeights<B>),
}

fn options<B: Backend>(device: &B::Device, dtype: Option<DType>) -> TensorCreationOptions<B> {
    let options = TensorCreationOptions::new(device.clone());
    match dtype {
        Some(dtype) => options.with_dtype(dtype),
        None => options,
    }
}

/// Kaiming-uniform as PEFT initialises `lora_A` (`a = √5`): `U(-1/√fan_in, 1/√fan_in)`.
fn kaiming<B: Backend>(
    shape: [usize; 2],
    device: &B::Device,
    dtype: Option<DType>,
) -> Param<Tensor<B, 2>> {
    let bound = 1.0 / (shape[1] as f64).sqrt();
    Param::from_tensor(Tensor::random(
        shape,
        Distribution::Uniform(-bound, bound),
        options::<B>(device, dtype),
    ))
}

fn zeros<B: Backend>(
    shape: [usize; 2],
    device: &B::Device,
    dtype: Option<DType>,
) -> Param<Tensor<B, 2>> {
    Param::from_tensor(Tensor::zeros(shape, options::<B>(device, dtype)))
}

fn dropout(prob: f64) -> Dropout {
    DropoutConfig::new(prob).init()
}

/// `a ⊗ b` for 2-D tensors.
pub(crate) fn kron<B: Backend>(a: Tensor<B, 2>, b: Tensor<B, 2>) -> Tensor<B, 2> {
    let [m, n] = a.dims();
    let [p, q] = b.dims();
    let a = a.reshape([m, 1, n, 1]);
    let b = b.reshape([1, p, 1, q]);
    (a * b).reshape([m * p, n * q])
}

impl<B: Backend> Adapter<B> {
    /// A fresh adapter for a layer of `geometry`: `down`/`w1` Kaiming-uniform, `up`/`w2` zeros,
    /// so the layer's output is unchanged until training moves the weights.
    ///
    /// The weights are created in `config.dtype`, else in `base_dtype` ("born in bf16" under a
    /// bf16 base), else in the device's default float dtype.
    pub(crate) fn init(
        config: &AdapterConfig,
        geometry: &Geometry,
        device: &B::Device,
        base_dtype: Option<DType>,
    ) -> Self {
        match config {
            AdapterConfig::Lora(c) => {
                Self::Lora(LoraWeights::init(c, geometry, device, base_dtype))
            }
            AdapterConfig::Lokr(c) => {
                Self::Lokr(LokrWeights::init(c, geometry, device, base_dtype))
            }
        }
    }

    /// The adapter family.
    pub fn kind(&self) -> AdapterKind {
        match self {
            Self::Lora(_) => AdapterKind::Lora,
            Self::Lokr(_) => AdapterKind::Lokr,
        }
    }

    /// The rank (`None` for a LoKr with a full second factor).
    pub fn rank(&self) -> Option<usize> {
        match self {
            Self::Lora(w) => Some(w.down.shape().dims::<2>()[0]),
            Self::Lokr(w) => w.w2_b.as_ref().map(|b| b.shape().dims::<2>()[0]),
        }
    }

    /// The alpha in plain LoRA terms: `scale · rank` (for rsLoRA this is `alpha · √rank`).
    pub fn alpha(&self) -> f64 {
        match self {
            Self::Lora(w) => w.plain_alpha(),
            Self::Lokr(w) => w.alpha,
        }
    }

    /// The factor applied to the product of the factors.
    pub fn scale(&self) -> f64 {
        match self {
            Self::Lora(w) => w.scale(),
            Self::Lokr(w) => match self.rank() {
                Some(rank) => w.alpha / rank as f64,
                None => 1.0,
            },
        }
    }

    /// The dtype of the adapter weights.
    pub fn dtype(&self) -> DType {
        self.first_weight().val().dtype()
    }

    fn first_weight(&self) -> &Param<Tensor<B, 2>> {
        match self {
            Self::Lora(w) => &w.down,
            Self::Lokr(w) => &w.w1,
        }
    }

    /// Whether the adapter branch sees `x` itself ([`input`](Self::input) has no dropout to
    /// apply and no cast to make), so that its products may read the base layer's input.
    pub(crate) fn reads_as_is<const D: usize>(&self, x: &Tensor<B, D>) -> bool {
        let dropout = match self {
            Self::Lora(w) => &w.dropout,
            Self::Lokr(w) => &w.dropout,
        };
        dropout.prob == 0.0 && x.dtype() == self.dtype()
    }

    /// Dropout then cast to the adapter dtype: what the adapter branch sees of the input.
    pub(crate) fn input<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let x = match self {
            Self::Lora(w) => w.dropout.forward(x),
            Self::Lokr(w) => w.dropout.forward(x),
        };
        let dtype = self.dtype();
        if x.dtype() == dtype { x } else { x.cast(dtype) }
    }

    /// The unscaled update `up · down` or `w1 ⊗ w2`, `[out, in·kh·kw]`.
    pub fn product(&self) -> Tensor<B, 2> {
        match self {
            Self::Lora(w) => w.up.val().matmul(w.down.val()),
            Self::Lokr(w) => kron(w.w1.val(), w.second_factor()),
        }
    }

    /// The adapter in file layout.
    pub fn to_stored(&self, geometry: &Geometry) -> StoredAdapter {
        let data = |p: &Param<Tensor<B, 2>>, shape: Vec<usize>| reshape(p.val().to_data(), shape);
        match self {
            Self::Lora(w) => {
                let rank = self.rank().expect("LoRA has a rank");
                StoredAdapter::Lora {
                    down: data(&w.down, geometry.over_input(rank, geometry.in_features)),
                    up: data(&w.up, geometry.up_shape(rank)),
                    alpha: self.alpha() as f32,
                }
            }
            Self::Lokr(w) => {
                let [o1, i1] = w.w1.shape().dims::<2>();
                let (o2, i2) = (geometry.out_features / o1, geometry.in_features / i1);
                let w2 = match (&w.w2, &w.w2_a, &w.w2_b) {
                    (Some(w2), _, _) => LokrFactor::Full(data(w2, geometry.over_input(o2, i2))),
                    (None, Some(a), Some(b)) => LokrFactor::LowRank {
                        a: a.val().to_data(),
                        b: b.val().to_data(),
                    },
                    _ => unreachable!("LoKr holds w2 or both w2_a and w2_b"),
                };
                StoredAdapter::Lokr {
                    w1: w.w1.val().to_data(),
                    w2,
                    alpha: w.alpha as f32,
                }
            }
        }
    }

    /// Builds an adapter from a stored one whose shapes fit `geometry` (`check_stored`).
    ///
    /// When `previous` is an adapter of the same shape (resuming training), its parameter ids,
    /// gradient flags and dropout are kept, so optimizer state stays attached.
    pub(crate) fn from_stored(
        stored: &StoredAdapter,
        geometry: &Geometry,
        device: &B::Device,
        previous: Option<Adapter<B>>,
    ) -> Self {
        let fan_in = geometry.fan_in();
        match (stored, previous) {
            (StoredAdapter::Lora { down, up, alpha }, previous) => {
                let rank = down.shape[0];
                let (down_p, up_p, prob) = match previous {
                    Some(Adapter::Lora(p)) => (Some(p.down), Some(p.up), p.dropout.prob),
                    _ => (None, None, 0.0),
                };
                Self::Lora(LoraWeights {
                    down: param(down_p, down, [rank, fan_in], device),
                    up: param(up_p, up, [geometry.out_features, rank], device),
                    alpha: *alpha as f64,
                    rslora: false,
                    dropout: dropout(prob),
                })
            }
            (StoredAdapter::Lokr { w1, w2, alpha }, previous) => {
                let (o1, i1) = (w1.shape[0], w1.shape[1]);
                let o2 = geometry.out_features / o1;
                let w2_width = fan_in / i1;
                let (prev_w1, prev_w2, prev_a, prev_b, prob) = match previous {
                    Some(Adapter::Lokr(p)) => (Some(p.w1), p.w2, p.w2_a, p.w2_b, p.dropout.prob),
                    _ => (None, None, None, None, 0.0),
                };
                let (w2, w2_a, w2_b) = match w2 {
                    LokrFactor::Full(w2) => {
                        (Some(param(prev_w2, w2, [o2, w2_width], device)), None, None)
                    }
                    LokrFactor::LowRank { a, b } => {
                        let rank = b.shape[0];
                        (
                            None,
                            Some(param(prev_a, a, [o2, rank], device)),
                            Some(param(prev_b, b, [rank, w2_width], device)),
                        )
                    }
                };
                Self::Lokr(LokrWeights {
                    w1: param(prev_w1, w1, [o1, i1], device),
                    w2,
                    w2_a,
                    w2_b,
                    alpha: *alpha as f64,
                    dropout: dropout(prob),
                })
            }
        }
    }
}

fn reshape(data: TensorData, shape: Vec<usize>) -> TensorData {
    TensorData::from_bytes(data.bytes, shape, data.dtype)
}

/// A parameter holding `data` reshaped to `shape`, reusing `previous`'s id and gradient flag.
fn param<B: Backend>(
    previous: Option<Param<Tensor<B, 2>>>,
    data: &TensorData,
    shape: [usize; 2],
    device: &B::Device,
) -> Param<Tensor<B, 2>> {
    let data = reshape(data.clone(), shape.to_vec());
    let tensor = Tensor::<B, 2>::from_data(data.clone(), (device, data.dtype));
    match previous {
        Some(previous) => {
            let require_grad = previous.is_require_grad();
            let (id, _, mapper) = previous.consume();
            Param::from_mapped_value(id, tensor.set_require_grad(require_grad), mapper)
        }
        None => Param::initialized(ParamId::new(), tensor.require_grad()),
    }
}

impl<B: Kernels> Adapter<B> {
    /// The LoRA factors `(down, up)` as the forward reads them, through
    /// [`burn_kernels::trainable`] (whose gradients the backend may take to host memory);
    /// `None` for LoKr.
    pub(crate) fn forward_factors(&self) -> Option<(Tensor<B, 2>, Tensor<B, 2>)> {
        match self {
            Self::Lora(w) => Some((trainable(w.down.val()), trainable(w.up.val()))),
            Self::Lokr(_) => None,
        }
    }

    /// The unscaled update applied to the input of a linear layer: `x · (up · down)ᵀ`, or
    /// `x · (w1 ⊗ w2)ᵀ` computed as `W1 · X · W2ᵀ` on `x` reshaped to `[…, in₁, in₂]`, so the
    /// Kronecker product is never formed. The products go through [`burn_kernels::linear`]
    /// (the vendor BLAS where the backend has one, else Burn's `linear`).
    pub(crate) fn linear_update<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        match self {
            Self::Lora(w) => linear(
                linear(x, trainable(w.down.val()).transpose(), None),
                trainable(w.up.val()).transpose(),
                None,
            ),
            Self::Lokr(w) => {
                let (w1, w2) = (w.w1.val(), w.second_factor());
                let ([o1, i1], [o2, i2]) = (w1.dims(), w2.dims());
                let mut dims = x.dims();
                let rows = dims[..D - 1].iter().product();
                let x = x.reshape([rows, i1, i2]);
                let h = linear(x, w2.transpose(), None).swap_dims(1, 2);
                let y = linear(h, w1.transpose(), None).swap_dims(1, 2);
                dims[D - 1] = o1 * o2;
                y.reshape(dims)
            }
        }
    }
}

impl<B: Backend> LoraWeights<B> {
    fn init(c: &LoraConfig, g: &Geometry, device: &B::Device, base: Option<DType>) -> Self {
        let dtype = c.dtype.or(base);
        Self {
            down: kaiming([c.rank, g.fan_in()], device, dtype),
            up: zeros([g.out_features, c.rank], device, dtype),
            alpha: c.effective_alpha(),
            rslora: c.rslora,
            dropout: dropout(c.dropout),
        }
    }

    fn rank(&self) -> f64 {
        self.down.shape().dims::<2>()[0] as f64
    }

    /// The alpha giving the same scale under the plain rule `alpha / rank`.
    fn plain_alpha(&self) -> f64 {
        if self.rslora {
            self.alpha * self.rank().sqrt()
        } else {
            self.alpha
        }
    }

    fn scale(&self) -> f64 {
        self.plain_alpha() / self.rank()
    }
}

impl<B: Backend> LokrWeights<B> {
    fn init(c: &LokrConfig, g: &Geometry, device: &B::Device, base: Option<DType>) -> Self {
        let dtype = c.dtype.or(base);
        let (o1, o2) = factorize(g.out_features, c.factor);
        let (i1, i2) = factorize(g.in_features, c.factor);
        let w2_width = i2 * g.kernel_area();
        let (w2, w2_a, w2_b) = if c.decompose_w2 {
            (
                None,
                Some(kaiming([o2, c.rank], device, dtype)),
                Some(zeros([c.rank, w2_width], device, dtype)),
            )
        } else {
            (Some(zeros([o2, w2_width], device, dtype)), None, None)
        };
        Self {
            w1: kaiming([o1, i1], device, dtype),
            w2,
            w2_a,
            w2_b,
            alpha: c.effective_alpha(),
            dropout: dropout(c.dropout),
        }
    }

    fn second_factor(&self) -> Tensor<B, 2> {
        match (&self.w2, &self.w2_a, &self.w2_b) {
            (Some(w2), _, _) => w2.val(),
            (None, Some(a), Some(b)) => a.val().matmul(b.val()),
            _ => unreachable!("LoKr holds w2 or both w2_a and w2_b"),
        }
    }
}

/// Checks that `stored` fits a layer of `geometry` and, when the layer already has an adapter,
/// that it has the same kind and shapes. `key` names a tensor the way the file does.
pub(crate) fn check_stored(
    stored: &StoredAdapter,
    geometry: &Geometry,
    existing: Option<&StoredShape>,
    key: impl Fn(crate::set::Role) -> String,
) -> Result<(), LoraError> {
    use crate::set::Role;
    let shape = |t: &TensorData| t.shape.to_vec();
    let expect = |role: Role, t: &TensorData, expected: Vec<usize>| {
        if shape(t) == expected {
            Ok(())
        } else {
            Err(LoraError::Shape {
                key: key(role),
                expected,
                found: shape(t),
            })
        }
    };
    match stored {
        StoredAdapter::Lora { down, up, .. } => {
            let rank = down.shape.first().copied().unwrap_or(0);
            expect(
                Role::Down,
                down,
                geometry.over_input(rank, geometry.in_features),
            )?;
            expect(Role::Up, up, geometry.up_shape(rank))?;
        }
        StoredAdapter::Lokr { w1, w2, .. } => {
            let dims = shape(w1);
            let fits = dims.len() == 2
                && dims[0] > 0
                && dims[1] > 0
                && geometry.out_features.is_multiple_of(dims[0])
                && geometry.in_features.is_multiple_of(dims[1]);
            if !fits {
                let (o1, _) = factorize(geometry.out_features, None);
                let (i1, _) = factorize(geometry.in_features, None);
                return Err(LoraError::Shape {
                    key: key(Role::W1),
                    expected: vec![o1, i1],
                    found: dims,
                });
            }
            let (o2, i2) = (
                geometry.out_features / dims[0],
                geometry.in_features / dims[1],
            );
            match w2 {
                LokrFactor::Full(w2) => expect(Role::W2, w2, geometry.over_input(o2, i2))?,
                LokrFactor::LowRank { a, b } => {
                    let rank = b.shape.first().copied().unwrap_or(0);
                    expect(Role::W2A, a, vec![o2, rank])?;
                    let flat = vec![rank, i2 * geometry.kernel_area()];
                    let full = geometry.over_input(rank, i2);
                    if shape(b) != flat && shape(b) != full {
                        return Err(LoraError::Shape {
                            key: key(Role::W2B),
                            expected: flat,
                            found: shape(b),
                        });
                    }
                }
            }
        }
    }
    if let Some(existing) = existing {
        let found = StoredShape::of(stored, geometry);
        if &found != existing {
            let role = match stored {
                StoredAdapter::Lora { .. } => Role::Down,
                StoredAdapter::Lokr { .. } => Role::W1,
            };
            return Err(LoraError::Rank {
                key: key(role),
                expected: existing.to_string(),
                found: found.to_string(),
            });
        }
    }
    Ok(())
}

/// The kind and internal shapes of an adapter, to compare a file against an attached adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredShape {
    kind: AdapterKind,
    shapes: Vec<[usize; 2]>,
}

impl StoredShape {
    pub fn of_adapter<B: Backend>(adapter: &Adapter<B>) -> Self {
        let dims = |p: &Param<Tensor<B, 2>>| p.shape().dims::<2>();
        let shapes = match adapter {
            Adapter::Lora(w) => vec![dims(&w.down), dims(&w.up)],
            Adapter::Lokr(w) => [Some(&w.w1), w.w2.as_ref(), w.w2_a.as_ref(), w.w2_b.as_ref()]
                .into_iter()
                .flatten()
                .map(dims)
                .collect(),
        };
        Self {
            kind: adapter.kind(),
            shapes,
        }
    }

    fn of(stored: &StoredAdapter, geometry: &Geometry) -> Self {
        let fan_in = geometry.fan_in();
        match stored {
            StoredAdapter::Lora { down, .. } => {
                let rank = down.shape[0];
                Self {
                    kind: AdapterKind::Lora,
                    shapes: vec![[rank, fan_in], [geometry.out_features, rank]],
                }
            }
            StoredAdapter::Lokr { w1, w2, .. } => {
                let (o1, i1) = (w1.shape[0], w1.shape[1]);
                let (o2, width) = (geometry.out_features / o1, fan_in / i1);
                let mut shapes = vec![[o1, i1]];
                match w2 {
                    LokrFactor::Full(_) => shapes.push([o2, width]),
                    LokrFactor::LowRank { b, .. } => {
                        shapes.push([o2, b.shape[0]]);
                        shapes.push([b.shape[0], width]);
                    }
                }
                Self {
                    kind: AdapterKind::Lokr,
                    shapes,
                }
            }
        }
    }
}

impl std::fmt::Display for StoredShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            AdapterKind::Lora => write!(f, "LoRA rank {}", self.shapes[0][0]),
            AdapterKind::Lokr => write!(f, "LoKr with factors {:?}", self.shapes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::Tolerance;

    type B = Flex;

    fn linear_geometry(out_features: usize, in_features: usize) -> Geometry {
        Geometry {
            out_features,
            in_features,
            kernel: None,
        }
    }

    #[test]
    fn fresh_lora_has_zero_product_and_kaiming_bound() {
        let device = Default::default();
        let g = linear_geometry(6, 16);
        let a = Adapter::<B>::init(&LoraConfig::new(4).into(), &g, &device, None);
        let (down, up) = a.forward_factors().unwrap();
        assert_eq!(down.dims(), [4, 16]);
        assert_eq!(up.dims(), [6, 4]);
        down.to_data().assert_within_range(-0.25..0.25);
        assert!(down.abs().max().into_scalar() > 0.1);
        assert_eq!(up.abs().max().into_scalar(), 0.0);
        assert_eq!(a.product().abs().max().into_scalar(), 0.0);
    }

    #[test]
    fn kron_matches_definition() {
        let device = Default::default();
        let a = Tensor::<B, 2>::from_floats([[1.0, 2.0], [3.0, 4.0]], &device);
        let b = Tensor::<B, 2>::from_floats([[0.0, 5.0, 1.0]], &device);
        let expected = Tensor::<B, 2>::from_floats(
            [
                [0.0, 5.0, 1.0, 0.0, 10.0, 2.0],
                [0.0, 15.0, 3.0, 0.0, 20.0, 4.0],
            ],
            &device,
        );
        kron(a, b)
            .to_data()
            .assert_approx_eq::<f32>(&expected.to_data(), Tolerance::default());
    }

    #[test]
    fn lokr_factors_balance_out_and_in() {
        let device = Default::default();
        let g = Geometry {
            out_features: 12,
            in_features: 8,
            kernel: Some([3, 3]),
        };
        let cfg = LokrConfig::new(2)
            .with_decompose_w2(true)
            .with_alpha(Some(1.0));
        let a = Adapter::<B>::init(&cfg.into(), &g, &device, None);
        assert_eq!(a.rank(), Some(2));
        assert_eq!(a.scale(), 0.5);
        assert_eq!(a.product().dims(), [12, 72]);
        let shape = StoredShape::of_adapter(&a);
        assert_eq!(shape.shapes, vec![[3, 2], [4, 2], [2, 36]]);
        // Round trip through the file layout keeps the shapes.
        let stored = a.to_stored(&g);
        check_stored(&stored, &g, Some(&shape), |r| format!("{r:?}")).unwrap();
        let back = Adapter::<B>::from_stored(&stored, &g, &device, None);
        assert_eq!(StoredShape::of_adapter(&back), shape);
    }

    #[test]
    fn born_in_base_dtype_unless_configured() {
        let device = Default::default();
        let g = linear_geometry(4, 4);
        let a = Adapter::<B>::init(&LoraConfig::new(2).into(), &g, &device, Some(DType::BF16));
        assert_eq!(a.dtype(), DType::BF16);
        let cfg = LoraConfig::new(2).with_dtype(Some(DType::F32));
        let a = Adapter::<B>::init(&cfg.into(), &g, &device, Some(DType::BF16));
        assert_eq!(a.dtype(), DType::F32);
    }

    #[test]
    fn check_stored_names_the_key() {
        let g = linear_geometry(6, 16);
        let stored = StoredAdapter::Lora {
            down: TensorData::zeros::<f32, _>([4, 15]),
            up: TensorData::zeros::<f32, _>([6, 4]),
            alpha: 4.0,
        };
        let err = check_stored(&stored, &g, None, |r| format!("m{}", r.kohya_suffix()))
            .unwrap_err()
            .to_string();
        assert_eq!(err, "`m.lora_down.weight` is [4, 15], expected [4, 16]");

        let stored = StoredAdapter::Lora {
            down: TensorData::zeros::<f32, _>([8, 16]),
            up: TensorData::zeros::<f32, _>([6, 8]),
            alpha: 4.0,
        };
        let existing = StoredShape {
            kind: AdapterKind::Lora,
            shapes: vec![[4, 16], [6, 4]],
        };
        let err = check_stored(&stored, &g, Some(&existing), |r| {
            format!("m{}", r.kohya_suffix())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("m.lora_down.weight"), "{err}");
        assert!(
            err.contains("LoRA rank 8") && err.contains("LoRA rank 4"),
            "{err}"
        );
    }
}
