//! Whole-model behaviour: applying plans, paths, freezing, training, merging, multiplier,
//! dropout and dtypes.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module, Param};
use burn::nn::conv::Conv2dConfig;
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use burn_lora::{
    AdapterKind, AdapterSet, LokrConfig, LokrFactor, LoraConfig, LoraConv2d, LoraLinear, LoraPlan,
    StoredAdapter, adapted_layers, export, load_adapters, merge, set_multiplier, unmerge,
};
use common::{Params, param_paths, rel_err};

type B = Flex;
type AB = Autodiff<Flex>;

#[derive(Module, Debug)]
struct Attn<B: Backend> {
    qkv: LoraLinear<B>,
    proj: LoraLinear<B>,
    norm_lin: LoraLinear<B>,
}

#[derive(Module, Debug)]
struct Net<B: Backend> {
    blocks: Vec<Attn<B>>,
    conv: LoraConv2d<B>,
    plain: Linear<B>,
}

#[derive(Module, Debug)]
struct PlainAttn<B: Backend> {
    qkv: Linear<B>,
    proj: Linear<B>,
    norm_lin: Linear<B>,
}

#[derive(Module, Debug)]
struct PlainNet<B: Backend> {
    blocks: Vec<PlainAttn<B>>,
    conv: burn::nn::conv::Conv2d<B>,
    plain: Linear<B>,
}

fn plain_net<B: Backend>(device: &B::Device) -> PlainNet<B> {
    PlainNet {
        blocks: (0..2)
            .map(|_| PlainAttn {
                qkv: LinearConfig::new(8, 24).init(device),
                proj: LinearConfig::new(8, 8).init(device),
                norm_lin: LinearConfig::new(8, 16).init(device),
            })
            .collect(),
        conv: Conv2dConfig::new([2, 8], [3, 3])
            .with_padding(PaddingConfig2d::Same)
            .init(device),
        plain: LinearConfig::new(8, 8).init(device),
    }
}

/// The same model, with each layer wrapped: what a model crate gets by switching types.
fn net<B: Backend>(plain: PlainNet<B>) -> Net<B> {
    Net {
        blocks: plain
            .blocks
            .into_iter()
            .map(|b| Attn {
                qkv: b.qkv.into(),
                proj: b.proj.into(),
                norm_lin: b.norm_lin.into(),
            })
            .collect(),
        conv: plain.conv.into(),
        plain: plain.plain,
    }
}

/// Replaces every adapter weight with deterministic non-zero values.
fn randomize<B: Backend, M: Module<B>>(model: M, seed: f64) -> M {
    let fill = |t: &TensorData, k: f64| {
        let n = t.num_elements();
        let values: Vec<f64> = (0..n)
            .map(|i| 0.3 * ((i as f64 + k) * 0.713).sin())
            .collect();
        TensorData::new(values, t.shape.clone()).convert_dtype(t.dtype)
    };
    let set = export(&model, Default::default());
    let mut out = AdapterSet::default();
    for (i, (name, adapter)) in set.iter().enumerate() {
        let k = seed + 10.0 * i as f64;
        let adapter = match adapter {
            StoredAdapter::Lora { down, up, alpha } => StoredAdapter::Lora {
                down: fill(down, k),
                up: fill(up, k + 1.0),
                alpha: *alpha,
            },
            StoredAdapter::Lokr { w1, w2, alpha } => StoredAdapter::Lokr {
                w1: fill(w1, k),
                w2: match w2 {
                    LokrFactor::Full(w2) => LokrFactor::Full(fill(w2, k + 1.0)),
                    LokrFactor::LowRank { a, b } => LokrFactor::LowRank {
                        a: fill(a, k + 2.0),
                        b: fill(b, k + 3.0),
                    },
                },
                alpha: *alpha,
            },
        };
        out.insert(name, adapter);
    }
    load_adapters(model, out).unwrap().0
}

impl<B: burn_kernels::Kernels> Net<B> {
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut h = self.conv.forward(x).permute([0, 2, 3, 1]);
        for block in &self.blocks {
            let [n, height, width, channels] = h.dims();
            let v = block
                .qkv
                .forward(h.clone())
                .slice([0..n, 0..height, 0..width, 16..24]);
            let gate =
                block
                    .norm_lin
                    .forward(h.clone())
                    .slice([0..n, 0..height, 0..width, 0..channels]);
            h = h + block.proj.forward(v) + gate;
        }
        self.plain.forward(h)
    }
}

fn input<B: Backend>(device: &B::Device) -> Tensor<B, 4> {
    Tensor::random([2, 2, 5, 5], Distribution::Normal(0.0, 1.0), device)
}

#[test]
fn wrapped_layers_keep_the_plain_parameter_paths() {
    let device = Default::default();
    let plain = plain_net::<B>(&device);
    let plain_paths = param_paths(&plain);
    let adapted = net(plain);
    assert_eq!(param_paths(&adapted), plain_paths);
    assert!(plain_paths.contains(&("blocks.0.qkv.weight".into(), "Struct:Linear".into())));

    let (adapted, _) = LoraPlan::new(LoraConfig::new(2))
        .unwrap()
        .include("qkv")
        .unwrap()
        .apply(adapted);
    let paths: Vec<String> = param_paths(&adapted).into_iter().map(|(p, _)| p).collect();
    let added: Vec<&String> = paths
        .iter()
        .filter(|p| !plain_paths.iter().any(|(q, _)| q == *p))
        .collect();
    assert_eq!(
        added,
        [
            "blocks.0.qkv.lora.down",
            "blocks.0.qkv.lora.up",
            "blocks.1.qkv.lora.down",
            "blocks.1.qkv.lora.up"
        ]
    );
}

#[test]
fn plan_selects_by_pattern_with_overrides_and_reports() {
    let device = Default::default();
    let model = net(plain_net::<B>(&device));
    let plan = LoraPlan::new(LoraConfig::new(4).with_alpha(Some(2.0)))
        .unwrap()
        .include("blocks")
        .unwrap()
        .exclude("norm")
        .unwrap()
        .with_override(r"\.qkv$", Some(8), Some(16.0))
        .unwrap();
    let (model, report) = plan.apply(model);
    let wrapped: Vec<(&str, Option<usize>, f64)> = report
        .wrapped
        .iter()
        .map(|w| (w.path.as_str(), w.rank, w.alpha))
        .collect();
    assert_eq!(
        wrapped,
        [
            ("blocks.0.qkv", Some(8), 16.0),
            ("blocks.0.proj", Some(4), 2.0),
            ("blocks.1.qkv", Some(8), 16.0),
            ("blocks.1.proj", Some(4), 2.0),
        ]
    );
    // qkv: 8·8 + 24·8, proj: 4·8 + 8·4, twice.
    assert_eq!(report.count(), 4);
    assert_eq!(report.params(), 2 * (8 * 8 + 24 * 8 + 4 * 8 + 8 * 4));
    assert_eq!(model.blocks[0].qkv.adapter().unwrap().scale(), 2.0);
    assert_eq!(model.blocks[1].proj.adapter().unwrap().scale(), 0.5);
    assert!(model.blocks[0].norm_lin.adapter().is_none());
    assert!(model.conv.adapter().is_none());

    let layers = adapted_layers(&model);
    assert_eq!(layers.len(), 7);
    let adapter_params: usize = layers.iter().map(|l| l.adapter_params).sum();
    assert_eq!(adapter_params, report.params());

    // Applying again leaves existing adapters alone.
    let (_, again) = plan.apply(model);
    assert_eq!(again.count(), 0);
    assert_eq!(again.skipped.len(), 4);
}

#[test]
fn conv_layers_take_the_conv_config() {
    let device = Default::default();
    let plan = LoraPlan::new(LoraConfig::new(4))
        .unwrap()
        .with_conv(LokrConfig::new(2).with_decompose_w2(true))
        .unwrap();
    let (model, report) = plan.apply(net(plain_net::<B>(&device)));
    assert_eq!(report.count(), 7);
    let conv = model.conv.adapter().unwrap();
    assert_eq!((conv.kind(), conv.rank()), (AdapterKind::Lokr, Some(2)));
    assert_eq!(
        model.blocks[0].qkv.adapter().unwrap().kind(),
        AdapterKind::Lora
    );
}

#[test]
fn attaching_leaves_lazy_base_weights_uninitialised() {
    let device = Default::default();
    let model = net(plain_net::<B>(&device));
    let (model, report) = LoraPlan::new(LoraConfig::new(4)).unwrap().apply(model);
    assert_eq!(report.count(), 7);
    assert!(!model.blocks[0].qkv.base().weight.is_initialized());
    assert!(!model.conv.base().weight.is_initialized());
}

#[test]
fn a_fresh_adapter_leaves_the_output_unchanged() {
    let device = Default::default();
    B::seed(&device, 1);
    let model = net(plain_net::<B>(&device));
    let x = input::<B>(&device);
    let before = model.forward(x.clone()).into_data();
    let plan = LoraPlan::new(LoraConfig::new(4)).unwrap();
    let (model, _) = plan.apply(model);
    model.forward(x).into_data().assert_eq(&before, true);
}

#[test]
fn merged_forward_equals_adapter_forward_and_unmerge_restores() {
    let device = Default::default();
    B::seed(&device, 2);
    let plan = LoraPlan::new(LoraConfig::new(4).with_alpha(Some(3.0)))
        .unwrap()
        .with_conv(LokrConfig::new(2).with_decompose_w2(true))
        .unwrap()
        .exclude("norm")
        .unwrap();
    let model = net(plain_net::<B>(&device));
    let x = input::<B>(&device);
    let base_out = model.forward(x.clone()).into_data();
    let (model, _) = plan.apply(model);
    let model = randomize(model, 0.0);
    let qkv_before = model.blocks[0].qkv.base().weight.val().into_data();
    let adapted = model.forward(x.clone()).into_data();
    assert!(rel_err(&adapted, &base_out) > 0.01);

    let merged = merge(model);
    assert!(merged.blocks[0].qkv.is_merged() && merged.conv.is_merged());
    let err = rel_err(&merged.forward(x.clone()).into_data(), &adapted);
    assert!(err <= 1e-5, "merged vs adapter: {err}");

    let unmerged = unmerge(merged);
    assert!(!unmerged.blocks[0].qkv.is_merged());
    let restored = unmerged.blocks[0].qkv.base().weight.val().into_data();
    assert!(rel_err(&restored, &qkv_before) <= 1e-6);
    let err = rel_err(&unmerged.forward(x).into_data(), &adapted);
    assert!(err <= 1e-5, "unmerged vs adapter: {err}");
}

#[test]
fn multiplier_scales_the_update_and_is_what_merge_bakes() {
    let device = Default::default();
    B::seed(&device, 3);
    let layer: LoraLinear<B> = LinearConfig::new(8, 6).init(&device).into();
    let layer = layer
        .attach(&LoraConfig::new(3).with_alpha(Some(6.0)).into())
        .unwrap();
    let layer = randomize(layer, 5.0);
    let x = Tensor::<B, 2>::random([4, 8], Distribution::Default, &device);
    let base = layer.base().forward(x.clone());
    let full = layer.forward(x.clone());
    let half = set_multiplier(layer, 0.5);
    assert_eq!(half.multiplier(), 0.5);
    let expected = (base.clone() + full) / 2.0;
    let err = rel_err(
        &half.forward(x.clone()).into_data(),
        &expected.clone().into_data(),
    );
    assert!(err <= 1e-6, "{err}");
    let merged = half.merge();
    let err = rel_err(
        &merged.forward(x.clone()).into_data(),
        &expected.into_data(),
    );
    assert!(err <= 1e-6, "{err}");
    // Unmerging restores the base weight up to rounding.
    let off = set_multiplier(merged.unmerge(), 0.0);
    let err = rel_err(&off.forward(x).into_data(), &base.into_data());
    assert!(err <= 1e-6, "{err}");
}

#[test]
fn dropout_acts_only_when_training() {
    let device = Default::default();
    AB::seed(&device, 4);
    let layer: LoraLinear<AB> = LinearConfig::new(16, 16).init(&device).into();
    let config = LoraConfig::new(4).with_dropout(0.5);
    let layer = randomize(layer.attach(&config.into()).unwrap(), 1.0);
    let x = Tensor::<AB, 2>::random([8, 16], Distribution::Default, &device);
    let a = layer.forward(x.clone()).into_data();
    let b = layer.forward(x.clone()).into_data();
    assert!(
        rel_err(&a, &b) > 1e-3,
        "dropout should differ between calls"
    );

    // Without autodiff (inference), no dropout: base + scale · x · ΔWᵀ.
    let valid = layer.valid();
    let x = x.inner();
    let adapter = valid.adapter().unwrap();
    let expected = valid.base().forward(x.clone())
        + x.clone().matmul(adapter.product().transpose()) * adapter.scale();
    let err = rel_err(&valid.forward(x).into_data(), &expected.into_data());
    assert!(err <= 1e-6, "{err}");
}

#[test]
fn adapters_are_born_in_the_base_dtype_or_the_configured_one() {
    let device = Default::default();
    let linear: Linear<B> = LinearConfig::new(8, 8).init(&device);
    let linear = Linear {
        weight: Param::from_tensor(linear.weight.val().cast(DType::BF16)),
        bias: linear
            .bias
            .map(|b| Param::from_tensor(b.val().cast(DType::BF16))),
    };
    let layer: LoraLinear<B> = linear.into();
    let x = Tensor::<B, 2>::random([2, 8], Distribution::Default, &device).cast(DType::BF16);

    let born = layer.clone().attach(&LoraConfig::new(4).into()).unwrap();
    assert_eq!(born.adapter().unwrap().dtype(), DType::BF16);
    assert_eq!(born.forward(x.clone()).dtype(), DType::BF16);

    let f32_adapter = LoraConfig::new(4).with_dtype(Some(DType::F32));
    let layer = randomize(layer.attach(&f32_adapter.into()).unwrap(), 2.0);
    assert_eq!(layer.adapter().unwrap().dtype(), DType::F32);
    let y = layer.forward(x);
    assert_eq!(y.dtype(), DType::BF16);
}

#[derive(Module, Debug)]
struct Small<B: Backend> {
    conv: LoraConv2d<B>,
    fc: LoraLinear<B>,
}

impl<B: burn_kernels::Kernels> Small<B> {
    fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        self.fc.forward(self.conv.forward(x).permute([0, 2, 3, 1]))
    }

    fn new(device: &B::Device) -> Self {
        Small {
            conv: Conv2dConfig::new([2, 4], [3, 3])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device)
                .into(),
            fc: LinearConfig::new(4, 3).init(device).into(),
        }
    }
}

/// Fits a target made by a known rank-2 update of the same base: the loss falls, gradients
/// reach only adapter parameters, and only adapter parameters change.
#[test]
fn adapters_train_and_the_base_stays_frozen() {
    let device = Default::default();
    AB::seed(&device, 7);
    // Materialise the lazy parameters so teacher and student share the base weights.
    let base = Small::<AB>::new(&device).to_device(&device);
    let x = Tensor::<AB, 4>::random([8, 2, 6, 6], Distribution::Normal(0.0, 1.0), &device);

    let teacher_plan = LoraPlan::new(LoraConfig::new(2)).unwrap();
    let (teacher, _) = teacher_plan.apply(base.clone());
    let target = randomize(teacher, 3.0).forward(x.clone()).detach();

    let plan = LoraPlan::new(LoraConfig::new(4).with_alpha(Some(4.0))).unwrap();
    let (student, report) = plan.apply(base);
    assert_eq!(report.count(), 2);
    // Round trip through the inner backend keeps the base frozen.
    let student: Small<AB> = student.valid().train();
    let before = Params::collect(&student, None).found;

    let mut optim = AdamWConfig::new().with_weight_decay(0.0).init();
    let mut model = student;
    let mut losses = Vec::new();
    for step in 0..200 {
        let loss = (model.forward(x.clone()) - target.clone())
            .powi_scalar(2)
            .mean();
        losses.push(loss.clone().into_scalar() as f64);
        let grads = loss.backward();
        if step == 0 {
            let with_grad = Params::collect(&model, Some(&grads)).with_grad;
            for (path, has) in &with_grad {
                let adapter = path.contains(".lora.");
                assert_eq!(*has, adapter, "{path}: gradient {has}");
            }
            assert_eq!(with_grad.iter().filter(|(_, g)| *g).count(), 4);
        }
        let grads = GradientsParams::from_grads(grads, &model);
        model = optim.step(2e-2, model, grads);
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    eprintln!(
        "loss {first:.3e} -> {last:.3e} after {} AdamW steps",
        losses.len()
    );
    assert!(last < 0.01 * first, "loss {first} -> {last}");
    assert!(losses[50] < first && losses[150] < losses[50]);

    let after = Params::collect(&model, None).found;
    for ((path, a), (_, b)) in before.iter().zip(&after) {
        if path.contains(".lora.") {
            assert!(rel_err(b, a) > 1e-3, "{path} did not train");
        } else {
            assert_eq!(a, b, "{path} changed");
        }
    }
}
