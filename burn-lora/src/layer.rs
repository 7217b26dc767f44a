//! [`Adapted`]: a frozen base layer with an optional trainable adapter.
//!
//! The base parameters keep the paths and container type of the plain layer (`qkv.weight`
//! inside `Struct:Linear`), so a checkpoint that loads into a model of `nn::Linear` loads
//! unchanged into the same model built from [`LoraLinear`]. The adapter parameters sit under
//! `<layer>.lora.{down,up}` or `<layer>.lokr.{w1,w2,w2_a,w2_b}`.

use core::fmt;

use burn::module::{
    AutodiffModule, Content, Devices, HasAutodiffModule, Module, ModuleDisplay,
    ModuleDisplayDefault, ModuleMapper, ModuleVisitor, Param, ParamId,
};
use burn::nn::Linear;
use burn::nn::conv::Conv2d;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::module::conv2d;
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, Tensor};
use burn_kernels::Kernels;

use crate::LoraError;
use crate::adapter::{Adapter, Geometry};
use crate::config::AdapterConfig;
use crate::session;

/// A layer an adapter can be attached to: implemented for `nn::Linear` and `nn::Conv2d`.
pub trait BaseLayer<B: Backend>: Module<B> + ModuleDisplay {
    /// The layer's shape, read without initialising lazy parameters.
    fn geometry(&self) -> Geometry;
    /// Marks the parameters as not requiring gradients; lazy parameters stay lazy.
    fn freeze(self) -> Self;
    /// The device of the weight.
    fn weight_device(&self) -> B::Device;
    /// The dtype of the weight, `None` while it is lazily uninitialised.
    fn weight_dtype(&self) -> Option<DType>;
    /// Adds `delta` (`[out, in·kh·kw]`, PyTorch orientation) to the weight, outside autodiff.
    fn add_to_weight(self, delta: Tensor<B, 2>) -> Self;
    /// Why no adapter can be attached to this layer, if that is the case.
    fn unsupported(&self) -> Option<&'static str>;
}

/// A base layer that never trains, plus an optional adapter that does.
///
/// Use [`LoraLinear`] in place of `nn::Linear` and [`LoraConv2d`] in place of `nn::Conv2d`.
/// Without an adapter the layer computes exactly what the base computes, through the same
/// `burn::tensor::module::linear` / `conv2d` call. With one, it adds
/// `multiplier · scale · ΔW x` (or uses the merged weight after [`Adapted::merge`]).
pub struct Adapted<B: Backend, L> {
    base: L,
    adapter: Option<Adapter<B>>,
    multiplier: f64,
    merged: Option<f64>,
}

/// A `nn::Linear` with an optional LoRA / LoKr adapter.
pub type LoraLinear<B> = Adapted<B, Linear<B>>;

/// A `nn::Conv2d` with an optional LoCon / LoKr adapter.
pub type LoraConv2d<B> = Adapted<B, Conv2d<B>>;

/// Path segment of the LoRA parameters.
pub(crate) const LORA_SEGMENT: &str = "lora";
/// Path segment of the LoKr parameters.
pub(crate) const LOKR_SEGMENT: &str = "lokr";
const CONTAINER: &str = "Struct:Adapted";

impl<B: Backend, L: BaseLayer<B>> Adapted<B, L> {
    /// Wraps `base`, freezing it. The layer has no adapter yet.
    pub fn new(base: L) -> Self {
        Self {
            base: base.freeze(),
            adapter: None,
            multiplier: 1.0,
            merged: None,
        }
    }

    /// Attaches a fresh adapter (replacing any previous one, which is unmerged first).
    pub fn attach(self, config: &AdapterConfig) -> Result<Self, LoraError> {
        config.validate()?;
        if let Some(reason) = self.base.unsupported() {
            return Err(LoraError::Config(reason.to_string()));
        }
        let layer = self.unmerge();
        let adapter = Adapter::init(
            config,
            &layer.base.geometry(),
            &layer.base.weight_device(),
            layer.base.weight_dtype(),
        );
        Ok(layer.with_adapter(Some(adapter)))
    }

    /// Replaces the adapter (the layer must not be merged).
    pub(crate) fn with_adapter(self, adapter: Option<Adapter<B>>) -> Self {
        debug_assert!(self.merged.is_none());
        Self { adapter, ..self }
    }

    /// The frozen base layer.
    pub fn base(&self) -> &L {
        &self.base
    }

    /// The adapter, if one is attached.
    pub fn adapter(&self) -> Option<&Adapter<B>> {
        self.adapter.as_ref()
    }

    /// The inference-time strength of the adapter (1 by default).
    pub fn multiplier(&self) -> f64 {
        self.multiplier
    }

    /// Sets the multiplier. A merged layer keeps the strength it was merged with until
    /// [`unmerge`](Self::unmerge).
    pub fn with_multiplier(self, multiplier: f64) -> Self {
        Self { multiplier, ..self }
    }

    /// Whether the adapter is merged into the base weight.
    pub fn is_merged(&self) -> bool {
        self.merged.is_some()
    }

    /// Adds `multiplier · scale · ΔW` to the base weight; the forward then skips the adapter.
    pub fn merge(self) -> Self {
        match (&self.adapter, self.merged) {
            (Some(adapter), None) => {
                let factor = adapter.scale() * self.multiplier;
                let delta = adapter.product().mul_scalar(factor);
                Self {
                    base: self.base.add_to_weight(delta),
                    merged: Some(factor),
                    ..self
                }
            }
            _ => self,
        }
    }

    /// Removes what [`merge`](Self::merge) added.
    pub fn unmerge(self) -> Self {
        match (&self.adapter, self.merged) {
            (Some(adapter), Some(factor)) => {
                let delta = adapter.product().mul_scalar(-factor);
                Self {
                    base: self.base.add_to_weight(delta),
                    merged: None,
                    ..self
                }
            }
            _ => self,
        }
    }

    /// The adapter and its factor when the forward must run it.
    fn active(&self) -> Option<(&Adapter<B>, f64)> {
        match (&self.adapter, self.merged) {
            (Some(adapter), None) if self.multiplier != 0.0 => {
                Some((adapter, adapter.scale() * self.multiplier))
            }
            _ => None,
        }
    }

    fn map_adapter<M: ModuleMapper<B>>(adapter: Adapter<B>, mapper: &mut M) -> Adapter<B> {
        match adapter {
            Adapter::Lora(w) => {
                mapper.enter_module(LORA_SEGMENT, CONTAINER);
                let w = w.map(mapper);
                mapper.exit_module(LORA_SEGMENT, CONTAINER);
                Adapter::Lora(w)
            }
            Adapter::Lokr(w) => {
                mapper.enter_module(LOKR_SEGMENT, CONTAINER);
                let w = w.map(mapper);
                mapper.exit_module(LOKR_SEGMENT, CONTAINER);
                Adapter::Lokr(w)
            }
        }
    }
}

/// `y + factor · d`, with `d` cast back to `y`'s dtype; a factor of 1 (alpha equal to the rank,
/// the default) costs no pass over `d`.
fn add_branch<B: Backend, const D: usize>(
    y: Tensor<B, D>,
    d: Tensor<B, D>,
    factor: f64,
) -> Tensor<B, D> {
    let d = if factor == 1.0 {
        d
    } else {
        d.mul_scalar(factor)
    };
    let d = if d.dtype() == y.dtype() {
        d
    } else {
        d.cast(y.dtype())
    };
    y + d
}

impl<B: Kernels> Adapted<B, Linear<B>> {
    /// Applies the layer: the base's product through [`burn_kernels::linear`] (the vendor
    /// BLAS where the backend has one, else exactly `nn::Linear::forward`), plus the adapter's
    /// update; a LoRA's up factor accumulates its product into the base's output
    /// ([`burn_kernels::linear_add`]), which on a backend without BLAS is the same sum as
    /// separate ops. A LoRA that reads the input as it is (no dropout, the input's dtype) runs
    /// as one [`burn_kernels::lora_linear`], its products in one place in the backend's order.
    ///
    /// # Shapes
    ///
    /// - input: `[..., d_input]`
    /// - output: `[..., d_output]`
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let Some((adapter, factor)) = self.active() else {
            return self.base_forward(input);
        };
        let weight = self.base.weight.val();
        if adapter.reads_as_is(&input)
            && weight.dtype() == input.dtype()
            && let Some((down, up)) = adapter.forward_factors()
        {
            let bias = self.base.bias.as_ref().map(|b| b.val());
            return burn_kernels::lora_linear(
                input,
                weight,
                bias,
                down.transpose(),
                up.transpose(),
                factor,
            );
        }
        let y = self.base_forward(input.clone());
        let x = adapter.input(input);
        match adapter.forward_factors() {
            // The update accumulated into the base's output by the up factor's product.
            Some((down, up)) if up.dtype() == y.dtype() => {
                let h = burn_kernels::linear(x, down.transpose(), None);
                burn_kernels::linear_add(h, up.transpose(), y, factor)
            }
            _ => add_branch(y, adapter.linear_update(x), factor),
        }
    }
}

impl<B: Kernels> Adapted<B, Linear<B>> {
    fn base_forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        let bias = self.base.bias.as_ref().map(|b| b.val());
        burn_kernels::linear(input, self.base.weight.val(), bias)
    }
}

impl<B: Kernels> Adapted<B, Conv2d<B>> {
    /// Applies the layer.
    ///
    /// # Shapes
    ///
    /// - input: `[batch, channels_in, height_in, width_in]`
    /// - output: `[batch, channels_out, height_out, width_out]`
    pub fn forward(&self, input: Tensor<B, 4>) -> Tensor<B, 4> {
        let Some((adapter, factor)) = self.active() else {
            return self.base.forward(input);
        };
        let y = self.base.forward(input.clone());
        let x = adapter.input(input);
        let g = self.base.geometry();
        let [kh, kw] = self.base.kernel_size;
        let d = match adapter.forward_factors() {
            Some((down, up)) => {
                let rank = down.dims()[0];
                let h = self.conv_like_base(x, down.reshape([rank, g.in_features, kh, kw]));
                let pointwise = ConvOptions::new([1, 1], [0, 0], [1, 1], 1);
                conv2d(h, up.reshape([g.out_features, rank, 1, 1]), None, pointwise)
            }
            None => self.conv_like_base(
                x,
                adapter
                    .product()
                    .reshape([g.out_features, g.in_features, kh, kw]),
            ),
        };
        add_branch(y, d, factor)
    }

    /// A convolution with the base layer's kernel, stride, dilation and padding rule.
    fn conv_like_base(&self, x: Tensor<B, 4>, weight: Tensor<B, 4>) -> Tensor<B, 4> {
        Conv2d {
            weight: Param::initialized(ParamId::new(), weight),
            bias: None,
            stride: self.base.stride,
            kernel_size: self.base.kernel_size,
            dilation: self.base.dilation,
            groups: 1,
            padding: self.base.padding.clone(),
        }
        .forward(x)
    }
}

impl<B: Backend> From<Linear<B>> for LoraLinear<B> {
    fn from(base: Linear<B>) -> Self {
        Self::new(base)
    }
}

impl<B: Backend> From<Conv2d<B>> for LoraConv2d<B> {
    fn from(base: Conv2d<B>) -> Self {
        Self::new(base)
    }
}

/// Adds `delta` to a parameter outside autodiff, in at least f32, keeping its dtype and
/// gradient flag.
fn add_into<B: Backend, const D: usize>(
    param: Param<Tensor<B, D>>,
    delta: Tensor<B, D>,
) -> Param<Tensor<B, D>> {
    param.map(|w| {
        let (dtype, require_grad) = (w.dtype(), w.is_require_grad());
        let wide = if dtype == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let sum = w.detach().cast(wide) + delta.detach().cast(wide);
        sum.cast(dtype).set_require_grad(require_grad)
    })
}

impl<B: Backend> BaseLayer<B> for Linear<B> {
    fn geometry(&self) -> Geometry {
        let [d_input, d_output] = self.weight.lazy_shape().dims::<2>();
        Geometry {
            out_features: d_output,
            in_features: d_input,
            kernel: None,
        }
    }

    fn freeze(self) -> Self {
        Linear {
            weight: self.weight.set_require_grad(false),
            bias: self.bias.map(|b| b.set_require_grad(false)),
        }
    }

    fn weight_device(&self) -> B::Device {
        self.weight.lazy_device()
    }

    fn weight_dtype(&self) -> Option<DType> {
        self.weight.is_initialized().then(|| self.weight.dtype())
    }

    fn add_to_weight(self, delta: Tensor<B, 2>) -> Self {
        Linear {
            weight: add_into(self.weight, delta.transpose()),
            bias: self.bias,
        }
    }

    fn unsupported(&self) -> Option<&'static str> {
        None
    }
}

impl<B: Backend> BaseLayer<B> for Conv2d<B> {
    fn geometry(&self) -> Geometry {
        let [out, in_per_group, kh, kw] = self.weight.lazy_shape().dims::<4>();
        Geometry {
            out_features: out,
            in_features: in_per_group * self.groups,
            kernel: Some([kh, kw]),
        }
    }

    fn freeze(self) -> Self {
        Conv2d {
            weight: self.weight.set_require_grad(false),
            bias: self.bias.map(|b| b.set_require_grad(false)),
            ..self
        }
    }

    fn weight_device(&self) -> B::Device {
        self.weight.lazy_device()
    }

    fn weight_dtype(&self) -> Option<DType> {
        self.weight.is_initialized().then(|| self.weight.dtype())
    }

    fn add_to_weight(self, delta: Tensor<B, 2>) -> Self {
        let shape = self.weight.lazy_shape().dims::<4>();
        Conv2d {
            weight: add_into(self.weight, delta.reshape(shape)),
            ..self
        }
    }

    fn unsupported(&self) -> Option<&'static str> {
        (self.groups != 1).then_some("adapters on grouped convolutions are not supported")
    }
}

impl<B: Backend, L: BaseLayer<B>> Module<B> for Adapted<B, L> {
    type Record = (L::Record, <Option<Adapter<B>> as Module<B>>::Record);

    fn collect_devices(&self, devices: Devices<B>) -> Devices<B> {
        let devices = self.base.collect_devices(devices);
        self.adapter.collect_devices(devices)
    }

    fn fork(self, device: &B::Device) -> Self {
        Self {
            base: self.base.fork(device),
            adapter: self.adapter.fork(device),
            ..self
        }
    }

    fn to_device(self, device: &B::Device) -> Self {
        Self {
            base: self.base.to_device(device),
            adapter: self.adapter.to_device(device),
            ..self
        }
    }

    fn visit<V: ModuleVisitor<B>>(&self, visitor: &mut V) {
        self.base.visit(visitor);
        session::on_visit(self);
        match &self.adapter {
            Some(Adapter::Lora(w)) => {
                visitor.enter_module(LORA_SEGMENT, CONTAINER);
                w.visit(visitor);
                visitor.exit_module(LORA_SEGMENT, CONTAINER);
            }
            Some(Adapter::Lokr(w)) => {
                visitor.enter_module(LOKR_SEGMENT, CONTAINER);
                w.visit(visitor);
                visitor.exit_module(LOKR_SEGMENT, CONTAINER);
            }
            None => {}
        }
    }

    fn map<M: ModuleMapper<B>>(self, mapper: &mut M) -> Self {
        let base = self.base.map(mapper);
        let layer = session::on_map(Self { base, ..self });
        let adapter = layer.adapter.map(|a| Self::map_adapter(a, mapper));
        Self { adapter, ..layer }
    }

    fn load_record(self, record: Self::Record) -> Self {
        let (base, adapter) = record;
        Self {
            base: self.base.load_record(base),
            adapter: self.adapter.load_record(adapter),
            ..self
        }
    }

    fn into_record(self) -> Self::Record {
        (self.base.into_record(), self.adapter.into_record())
    }
}

impl<B, L> AutodiffModule<B> for Adapted<B, L>
where
    B: AutodiffBackend,
    L: BaseLayer<B> + AutodiffModule<B>,
    L::InnerModule: BaseLayer<B::InnerBackend>,
{
    type InnerModule = Adapted<B::InnerBackend, L::InnerModule>;

    fn valid(&self) -> Self::InnerModule {
        Adapted {
            base: self.base.valid(),
            adapter: self.adapter.valid(),
            multiplier: self.multiplier,
            merged: self.merged,
        }
    }

    fn from_inner(module: Self::InnerModule) -> Self {
        // Freeze again: Burn 0.21 restores each parameter's remembered gradient flag here, and
        // a parameter frozen while still lazy remembers the flag it was created with.
        Self {
            base: L::from_inner(module.base).freeze(),
            adapter: <Option<Adapter<B>> as AutodiffModule<B>>::from_inner(module.adapter),
            multiplier: module.multiplier,
            merged: module.merged,
        }
    }
}

impl<B, L> HasAutodiffModule<B> for Adapted<B::InnerBackend, L>
where
    B: AutodiffBackend,
    L: BaseLayer<B::InnerBackend> + HasAutodiffModule<B>,
    L::TrainModule: BaseLayer<B>,
{
    type TrainModule = Adapted<B, L::TrainModule>;
}

impl<B: Backend, L: BaseLayer<B>> ModuleDisplayDefault for Adapted<B, L> {
    fn content(&self, content: Content) -> Option<Content> {
        content
            .set_top_level_type("Adapted")
            .add("base", &self.base)
            .add("adapter", &self.adapter)
            .add_debug_attribute("multiplier", &self.multiplier)
            .add_debug_attribute("merged", &self.merged.is_some())
            .optional()
    }

    fn num_params(&self) -> usize {
        Module::num_params(self)
    }
}

impl<B: Backend, L: BaseLayer<B>> ModuleDisplay for Adapted<B, L> {}

impl<B: Backend, L: BaseLayer<B>> fmt::Display for Adapted<B, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.format(Default::default()))
    }
}

impl<B: Backend, L: Clone> Clone for Adapted<B, L> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            adapter: self.adapter.clone(),
            multiplier: self.multiplier,
            merged: self.merged,
        }
    }
}

impl<B: Backend, L: fmt::Debug> fmt::Debug for Adapted<B, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adapted")
            .field("base", &self.base)
            .field("adapter", &self.adapter)
            .field("multiplier", &self.multiplier)
            .field("merged", &self.merged)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::kron;
    use crate::config::{LokrConfig, LoraConfig};
    use crate::set::{LokrFactor, StoredAdapter};
    use burn::backend::Flex;
    use burn::nn::conv::Conv2dConfig;
    use burn::nn::{LinearConfig, PaddingConfig2d};
    use burn::tensor::{Distribution, TensorData, Tolerance};

    type B = Flex;

    fn random(shape: &[usize], seed: f32) -> TensorData {
        let n = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.77).sin()).collect();
        TensorData::new(values, shape.to_vec())
    }

    /// Replaces the layer's adapter with `stored`.
    fn with_stored<L: BaseLayer<B>>(layer: Adapted<B, L>, stored: &StoredAdapter) -> Adapted<B, L> {
        let geometry = layer.base.geometry();
        let device = layer.base.weight_device();
        let adapter = Adapter::from_stored(stored, &geometry, &device, None);
        layer.with_adapter(Some(adapter))
    }

    fn assert_close<const D: usize>(actual: Tensor<B, D>, expected: Tensor<B, D>) {
        actual
            .into_data()
            .assert_approx_eq::<f32>(&expected.into_data(), Tolerance::absolute(1e-5));
    }

    #[test]
    fn linear_forward_adds_the_scaled_update() {
        let device = Default::default();
        let layer: LoraLinear<B> = LinearConfig::new(6, 5).init(&device).into();
        let stored = StoredAdapter::Lora {
            down: random(&[3, 6], 0.0),
            up: random(&[5, 3], 1.0),
            alpha: 1.5,
        };
        let layer = with_stored(layer, &stored);
        let x = Tensor::<B, 3>::random([2, 4, 6], Distribution::Default, &device);
        let down = Tensor::<B, 2>::from_data(random(&[3, 6], 0.0), &device);
        let up = Tensor::<B, 2>::from_data(random(&[5, 3], 1.0), &device);
        let delta = up.matmul(down).mul_scalar(0.5).transpose().unsqueeze::<3>();
        let expected = layer.base.forward(x.clone()) + x.clone().matmul(delta);
        assert_close(layer.forward(x), expected);
    }

    #[test]
    fn lokr_linear_update_never_forms_the_product_but_equals_it() {
        let device = Default::default();
        let layer: LoraLinear<B> = LinearConfig::new(6, 4).init(&device).into();
        for w2 in [
            LokrFactor::Full(random(&[2, 3], 2.0)),
            LokrFactor::LowRank {
                a: random(&[2, 1], 3.0),
                b: random(&[1, 3], 4.0),
            },
        ] {
            let stored = StoredAdapter::Lokr {
                w1: random(&[2, 2], 1.0),
                w2,
                alpha: 1.0,
            };
            let layer = with_stored(layer.clone(), &stored);
            let adapter = layer.adapter().unwrap();
            let x = Tensor::<B, 3>::random([2, 3, 6], Distribution::Default, &device);
            let full = adapter.product().transpose().unsqueeze::<3>();
            assert_close(adapter.linear_update(x.clone()), x.matmul(full));
        }
    }

    #[test]
    fn conv_adapters_follow_the_base_geometry() {
        let device = Default::default();
        // Materialised: lazy parameters would initialise differently in each clone.
        let conv: Conv2d<B> = Conv2dConfig::new([3, 4], [3, 3])
            .with_stride([2, 2])
            .with_padding(PaddingConfig2d::Same)
            .init(&device)
            .to_device(&device);
        let layer: LoraConv2d<B> = conv.clone().into();
        let x = Tensor::<B, 4>::random([2, 3, 7, 6], Distribution::Default, &device);
        let cases = [
            StoredAdapter::Lora {
                down: random(&[2, 3, 3, 3], 0.0),
                up: random(&[4, 2, 1, 1], 5.0),
                alpha: 1.0,
            },
            StoredAdapter::Lokr {
                w1: random(&[2, 1], 1.0),
                w2: LokrFactor::LowRank {
                    a: random(&[2, 2], 2.0),
                    b: random(&[2, 27], 3.0),
                },
                alpha: 3.0,
            },
        ];
        for stored in &cases {
            let layer = with_stored(layer.clone(), stored);
            // The plain conv with W + scale · ΔW.
            let (rows, cols, delta) = stored.delta();
            assert_eq!((rows, cols), (4, 27));
            let delta: Vec<f32> = delta.into_iter().map(|v| v as f32).collect();
            let delta = Tensor::<B, 4>::from_data(TensorData::new(delta, [4, 3, 3, 3]), &device);
            let merged = Conv2d {
                weight: Param::from_tensor(conv.weight.val() + delta),
                ..conv.clone()
            };
            let expected = merged.forward(x.clone());
            assert_eq!(expected.dims(), [2, 4, 4, 3]);
            assert_close(layer.forward(x.clone()), expected);
        }
    }

    #[test]
    fn grouped_convolutions_are_refused() {
        let conv: Conv2d<B> = Conv2dConfig::new([4, 4], [3, 3])
            .with_groups(2)
            .init(&Default::default());
        let err = LoraConv2d::from(conv)
            .attach(&LoraConfig::new(2).into())
            .unwrap_err();
        assert!(err.to_string().contains("grouped"), "{err}");
    }

    #[test]
    fn records_carry_the_adapter_and_display_names_it() {
        let device = Default::default();
        let layer: LoraLinear<B> = LinearConfig::new(4, 4).init(&device).into();
        let config = LokrConfig::new(2).with_decompose_w2(true).into();
        let trained = with_stored(
            layer.clone().attach(&config).unwrap(),
            &StoredAdapter::Lokr {
                w1: random(&[2, 2], 0.0),
                w2: LokrFactor::LowRank {
                    a: random(&[2, 2], 1.0),
                    b: random(&[2, 2], 2.0),
                },
                alpha: 2.0,
            },
        );
        let x = Tensor::<B, 2>::random([3, 4], Distribution::Default, &device);
        let expected = trained.forward(x.clone());
        let loaded = layer
            .attach(&config)
            .unwrap()
            .load_record(trained.into_record());
        assert_close(loaded.forward(x), expected);
        let text = loaded.to_string();
        assert!(
            text.contains("Adapted") && text.contains("LokrWeights"),
            "{text}"
        );
        let product = loaded.adapter().unwrap().product();
        let [w1, w2] = [random(&[2, 2], 0.0), random(&[2, 2], 1.0)]
            .map(|d| Tensor::<B, 2>::from_data(d, &device));
        let b = Tensor::<B, 2>::from_data(random(&[2, 2], 2.0), &device);
        assert_close(product, kron(w1, w2.matmul(b)));
    }
}
