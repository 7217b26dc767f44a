//! Block-level gradient checkpointing on the FLUX.1 and Wan transformers: the gradients of every
//! parameter equal those of plain backpropagation (Autodiff<Flex>, f32), with the separate ops:
//! every parameter is trained here, q/k norm scales included, so the tracked path declines the
//! fused norm-and-rotation that the untracked block forward would take.

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Distribution, FloatDType, Tensor, TensorData};
use burn_diffusion::flux::{Flux, FluxInput, linear_keys};
use burn_diffusion::wan::{WanInput, WanTransformer3D};
use burn_diffusion::{BlockTape, Checkpointing};

type Ad = Autodiff<Flex>;

fn input(model: &Flux<Ad>) -> (FluxInput<Ad>, Tensor<Ad, 3>) {
    let device = Default::default();
    let config = model.config();
    let (batch, img_len, txt_len) = (2, 6, 3);
    let normal = Distribution::Normal(0.0, 1.0);
    let positions =
        |n: usize| TensorData::new((0..n * 3).map(|i| (i % 7) as f32).collect(), [n, 3]);
    let input = FluxInput {
        img: Tensor::random([batch, img_len, config.in_channels], normal, &device),
        txt: Tensor::random([batch, txt_len, config.context_in_dim], normal, &device),
        y: Tensor::random([batch, config.vec_in_dim], normal, &device),
        timesteps: Tensor::from_floats([0.3, 0.9], &device),
        guidance: Some(Tensor::from_floats([3.5, 1.0], &device)),
        img_ids: positions(img_len),
        txt_ids: positions(txt_len),
    };
    let target = Tensor::random([batch, img_len, config.out_channels], normal, &device);
    (input, target)
}

/// Every parameter's gradient, in visiting order (panics if one is missing).
fn all_grads<M: Module<Ad>>(model: &M, grads: &GradientsParams) -> Vec<(String, Vec<f32>)> {
    struct Collect<'a>(&'a GradientsParams, Vec<String>, Vec<(String, Vec<f32>)>);
    impl ModuleVisitor<Ad> for Collect<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.1.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.1.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
            let path = self.1.join(".");
            let grad = self
                .0
                .get::<Flex, D>(param.id)
                .unwrap_or_else(|| panic!("no gradient for {path}"));
            self.2.push((path, grad.into_data().to_vec().unwrap()));
        }
    }
    let mut collect = Collect(grads, Vec::new(), Vec::new());
    model.visit(&mut collect);
    collect.2
}

fn grads(model: &Flux<Ad>, checkpointing: Checkpointing) -> (f32, Vec<(String, Vec<f32>)>) {
    let (input, target) = input(model);
    let mut tape = BlockTape::new(checkpointing);
    let loss = (model.forward_with(input, &mut tape) - target)
        .powi_scalar(2)
        .mean();
    let value = loss.to_data().to_vec::<f32>().unwrap()[0];
    let grads = GradientsParams::from_grads(tape.backward(&loss, model), model);
    (value, all_grads(model, &grads))
}

/// Makes every parameter trainable (the projections' base weights start frozen, as LoRA wants).
fn unfreeze<M: Module<Ad>>(model: M) -> M {
    struct Unfreeze;
    impl ModuleMapper<Ad> for Unfreeze {
        fn map_float<const D: usize>(
            &mut self,
            param: Param<Tensor<Ad, D>>,
        ) -> Param<Tensor<Ad, D>> {
            param.set_require_grad(true)
        }
    }
    model.map(&mut Unfreeze)
}

#[test]
fn checkpointed_flux_gradients_equal_plain_backprop() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/flux/guidance");
    let model = unfreeze(Flux::<Ad>::load(&path, &Default::default(), FloatDType::F32).unwrap());
    let _separate = burn_kernels::KernelOptions::separate_ops().install();
    // Same seed for both runs, so that the inputs are the same.
    <Ad as burn::tensor::backend::Backend>::seed(&Default::default(), 7);
    let (plain_loss, plain) = grads(&model, Checkpointing::Off);
    <Ad as burn::tensor::backend::Backend>::seed(&Default::default(), 7);
    let (loss, checkpointed) = grads(&model, Checkpointing::Blocks);

    assert_eq!(loss, plain_loss);
    let config = model.config();
    let tensors = 2 * linear_keys(config).len() + 4 * config.depth + 2 * config.depth_single_blocks;
    assert_eq!(plain.len(), tensors);
    assert_same_gradients(&plain, &checkpointed);
}

#[test]
fn checkpointed_wan_gradients_equal_plain_backprop() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/wan");
    let device = Default::default();
    let model = unfreeze(WanTransformer3D::<Ad>::load(&path, &device, FloatDType::F32).unwrap());
    let _separate = burn_kernels::KernelOptions::separate_ops().install();
    let config = model.config().clone();
    let normal = Distribution::Normal(0.0, 1.0);
    let latent = [2, config.in_channels, 3, 4, 4];
    let input = WanInput {
        hidden_states: Tensor::random(latent, normal, &device),
        timestep: Tensor::from_floats([300.0, 900.0], &device),
        encoder_hidden_states: Tensor::random([2, 5, config.text_dim], normal, &device),
    };
    let target = Tensor::<Ad, 5>::random(latent, normal, &device);
    let grads = |checkpointing| {
        let mut tape = BlockTape::new(checkpointing);
        let loss = (model.forward_with(input.clone(), &mut tape) - target.clone())
            .powi_scalar(2)
            .mean();
        let value = loss.to_data().to_vec::<f32>().unwrap()[0];
        let grads = GradientsParams::from_grads(tape.backward(&loss, &model), &model);
        (value, all_grads(&model, &grads))
    };
    let (plain_loss, plain) = grads(Checkpointing::Off);
    let (loss, checkpointed) = grads(Checkpointing::Blocks);
    assert_eq!(loss, plain_loss);
    assert_same_gradients(&plain, &checkpointed);
}

/// Each gradient of `checkpointed` equals `plain`'s within f32 rounding, and none is zero.
fn assert_same_gradients(plain: &[(String, Vec<f32>)], checkpointed: &[(String, Vec<f32>)]) {
    assert_eq!(plain.len(), checkpointed.len());
    for ((path, expected), (_, actual)) in plain.iter().zip(checkpointed) {
        let norm = expected
            .iter()
            .map(|v| (*v as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let diff = expected
            .iter()
            .zip(actual)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        assert!(norm > 0.0, "{path}: zero gradient");
        assert!(
            diff <= 1e-5 * norm,
            "{path}: relative difference {:.2e}",
            diff / norm
        );
    }
}
