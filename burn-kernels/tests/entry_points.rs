//! The entry points on the CPU: `Flex` and `Autodiff<Flex>` under both of Burn's checkpoint
//! strategies run the fused elementwise ops (counted), give the gradients the separate ops give,
//! decline attention (Flex has no fused attention), and return `None` when the installed
//! options switch a path off.

use burn::backend::Autodiff;
use burn::backend::Flex;
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor, TensorData, TensorPrimitive, Tolerance};
use burn_kernels::{
    KernelOptions, Kernels, LoraProducts, attention, counters, gelu_tanh, layer_norm, products,
    rms_norm, rms_norm_rope,
};

/// GELU (tanh) written as separate ops.
fn gelu_reference<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let inner = (x.clone() + x.clone() * x.clone() * x.clone() * 0.044715) * 0.797_884_560_8;
    x * (inner.tanh() + 1.0) * 0.5
}

/// RMS norm written as separate ops.
fn rms_norm_reference<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    x.clone() / (x.square().mean_dim(1) + 1e-6).sqrt()
}

/// Layer norm written as separate ops.
fn layer_norm_reference<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let centered = x.clone() - x.mean_dim(1);
    let var = centered.clone().square().mean_dim(1);
    centered / (var + 1e-6).sqrt()
}

fn close<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) {
    a.into_data()
        .assert_approx_eq::<f32>(&b.into_data(), Tolerance::absolute(1e-5));
}

/// The fused forward and the gradient it sends back equal the separate ops', and each fused
/// call is counted once.
fn fused_matches_separate<B: AutodiffBackend + Kernels>() {
    let device = Default::default();
    let data = Tensor::<B, 2>::random([3, 16], Distribution::Normal(0.0, 2.0), &device).into_data();
    for (name, fused, reference) in [
        (
            "gelu_tanh",
            (|x: &Tensor<B, 2>| gelu_tanh(x)) as fn(&Tensor<B, 2>) -> Option<Tensor<B, 2>>,
            gelu_reference::<B> as fn(Tensor<B, 2>) -> Tensor<B, 2>,
        ),
        (
            "layer_norm",
            |x| layer_norm(x, 1e-6),
            layer_norm_reference::<B>,
        ),
        ("rms_norm", |x| rms_norm(x, 1e-6), rms_norm_reference::<B>),
    ] {
        let x = Tensor::<B, 2>::from_data(data.clone(), &device).require_grad();
        let before = counters();
        let y = fused(&x).unwrap_or_else(|| panic!("{name}: no fused op"));
        assert_eq!(counters().since(before).fused_elementwise, 1, "{name}");
        let weights = Tensor::<B, 2>::random([3, 16], Distribution::Default, &device);
        let grad = x
            .grad(&(y.clone() * weights.clone()).sum().backward())
            .unwrap();

        let x2 = Tensor::<B, 2>::from_data(data.clone(), &device).require_grad();
        let y2 = reference(x2.clone());
        let grad2 = x2.grad(&(y2.clone() * weights).sum().backward()).unwrap();
        close(y, y2);
        close(grad, grad2);
    }
}

#[test]
fn resident_autodiff_runs_the_fused_elementwise_ops() {
    fused_matches_separate::<Autodiff<Flex>>();
    fused_matches_separate::<Autodiff<Flex, BalancedCheckpointing>>();
}

#[test]
fn the_norm_and_rotation_is_fused_unless_the_scale_needs_a_gradient() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    let x = Tensor::<B, 4>::random([1, 2, 3, 4], Distribution::Default, &device).require_grad();
    let table = Tensor::<B, 2>::ones([3, 4], &device);
    let scale = Tensor::<B, 1>::ones([4], &device);
    let out = rms_norm_rope(&x, &scale, &table, &table.zeros_like(), 1e-6).unwrap();
    // cos 1, sin 0: the rotation is the identity, the result the RMS norm.
    let rms = (x.clone().square().mean_dim(3) + 1e-6).sqrt();
    close(out, x.clone() / rms);
    let trained_scale = scale.require_grad();
    assert!(rms_norm_rope(&x, &trained_scale, &table, &table, 1e-6).is_none());
}

#[test]
fn flex_declines_attention_and_nothing_is_counted() {
    fn check<B: Kernels>() {
        let device = Default::default();
        let [q, k, v] = [0.0, 1.0, 2.0].map(|mean| {
            Tensor::<B, 4>::random([1, 2, 5, 8], Distribution::Normal(mean, 1.0), &device)
        });
        let before = counters();
        assert!(attention(&q, &k, &v, 0.5).is_none());
        assert_eq!(counters().since(before), Default::default());
    }
    check::<Flex>();
    check::<Autodiff<Flex>>();
}

#[test]
fn options_switch_paths_off_for_the_installing_thread_only() {
    let x = Tensor::<Flex, 1>::from_data(TensorData::from([0.5f32, -1.0]), &Default::default());
    assert!(gelu_tanh(&x).is_some());
    let off = KernelOptions {
        fused_elementwise: false,
        ..KernelOptions::fast()
    };
    {
        let _off = off.install();
        assert!(gelu_tanh(&x).is_none());
        assert!(layer_norm(&x, 1e-6).is_none());
        assert!(rms_norm(&x, 1e-6).is_none());
        let other = std::thread::spawn(|| {
            let x = Tensor::<Flex, 1>::from_data([1.0f32], &Default::default());
            gelu_tanh(&x).is_some()
        });
        assert!(
            other.join().unwrap(),
            "another thread keeps its own options"
        );
    }
    assert!(gelu_tanh(&x).is_some());
}

/// The LoRA layer's gradients product by product (`products::lora_backward`, the fallback of
/// the one-ordering backward) equal what autodiff gives for `x · w + alpha · (x · d) · u`
/// written as separate ops, for a transposed down factor as a LoRA layer passes it.
#[test]
fn lora_gradients_product_by_product_match_autodiff() {
    type A = Autodiff<Flex>;
    let device = Default::default();
    let random = |shape: [usize; 2]| {
        Tensor::<Flex, 2>::random(shape, Distribution::Normal(0.0, 1.0), &device)
    };
    let x = Tensor::<Flex, 3>::random([2, 5, 12], Distribution::Normal(0.0, 1.0), &device);
    let (weight, down, up, grad) = (
        random([12, 7]),
        random([4, 12]),
        random([4, 7]),
        random([10, 7]),
    );
    let grad = grad.reshape([2, 5, 7]);
    let alpha = 0.75;

    let leaf = |t: &Tensor<Flex, 2>| Tensor::<A, 2>::from_data(t.to_data(), &device).require_grad();
    let (xa, da, ua) = (
        Tensor::<A, 3>::from_data(x.to_data(), &device).require_grad(),
        leaf(&down),
        leaf(&up),
    );
    let wa = Tensor::<A, 2>::from_data(weight.to_data(), &device);
    let y = xa.clone().matmul(wa.unsqueeze())
        + xa.clone()
            .matmul(da.clone().transpose().unsqueeze())
            .matmul(ua.clone().unsqueeze())
            * alpha;
    let grads = (y * Tensor::<A, 3>::from_data(grad.to_data(), &device))
        .sum()
        .backward();

    let h = x.clone().matmul(down.clone().transpose().unsqueeze());
    let products = LoraProducts {
        x: x.into_primitive().tensor(),
        weight: weight.into_primitive().tensor(),
        down: down.transpose().into_primitive().tensor(),
        up: up.into_primitive().tensor(),
        alpha: alpha as f32,
    };
    let [dx, d_down, d_up] = products::lora_backward::<Flex>(
        &products,
        h.into_primitive().tensor(),
        grad.into_primitive().tensor(),
        &KernelOptions::default(),
    );
    let tensor = |t| Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(t));
    close(
        Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(dx)),
        xa.grad(&grads).unwrap(),
    );
    close(tensor(d_down).transpose(), da.grad(&grads).unwrap());
    close(tensor(d_up), ua.grad(&grads).unwrap());
}
