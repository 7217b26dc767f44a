//! A FLUX.2 transformer whose Linear weights are made in host memory (`random_placed`) and
//! streamed through burn-offload's ring of two slots (poisoned as soon as a slot may be reused)
//! trains with block-level checkpointing to the same loss and LoRA gradients, bit for bit, as the
//! same weights resident: what `random:flux2-dev` does on a GPU, at a size the CPU runs.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, FloatDType, Tensor, TensorData};
use burn_diffusion::flux2::{Flux2, Flux2Config, Flux2Input};
use burn_diffusion::{BlockTape, Checkpointing, random_placed};
use burn_lora::{LoraConfig, LoraPlan};
use burn_offload::{Offload, OffloadConfig, WeightStream};

type B = Autodiff<Offload<Flex>>;

fn tiny() -> Flux2Config {
    Flux2Config::new(16, 16, 24, 32, 2, 2, 2, vec![4; 4], true)
}

/// The model with its Linear weights from `random_placed` handed to `place`, adapted.
fn model(place: &mut burn_diffusion::PlaceWeight<'_, B>) -> Flux2<B> {
    let device = Default::default();
    B::seed(&device, 3);
    let model = random_placed(tiny().init::<B>(&device), FloatDType::F32, 11, place)
        .unwrap()
        .no_grad();
    let plan = LoraPlan::new(LoraConfig::new(4)).unwrap();
    let (model, _) = plan.apply(model);
    model
}

/// Loss and the gradient of every LoRA parameter after one checkpointed step.
fn step(model: &Flux2<B>) -> (f32, Vec<Vec<f32>>) {
    let device = Default::default();
    Flex::seed(&Default::default(), 5);
    let normal = Distribution::Normal(0.0, 1.0);
    let host = |shape: [usize; 3]| {
        Tensor::<B, 3>::from_data(
            Tensor::<Flex, 3>::random(shape, normal, &Default::default()).into_data(),
            &device,
        )
    };
    let input = Flux2Input {
        img: host([1, 9, 16]),
        txt: host([1, 3, 24]),
        timesteps: Tensor::from_floats([0.4], &device),
        guidance: Some(Tensor::from_floats([2.5], &device)),
        img_ids: TensorData::new((0..36).map(|i| (i % 7) as f32).collect(), [9, 4]),
        txt_ids: TensorData::new((0..12).map(|i| (i % 3) as f32).collect(), [3, 4]),
    };
    let target = host([1, 9, 16]);
    let mut tape = BlockTape::new(Checkpointing::Blocks);
    let loss = (model.forward_with(input, &mut tape) - target)
        .powi_scalar(2)
        .mean();
    let value = loss.clone().into_scalar();
    let grads = GradientsParams::from_grads(tape.backward(&loss, model), model);
    struct Collect<'a>(&'a GradientsParams, Vec<Vec<f32>>);
    impl ModuleVisitor<B> for Collect<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.0.get::<Offload<Flex>, D>(param.id) {
                self.1.push(grad.into_data().to_vec::<f32>().unwrap());
            }
        }
    }
    let mut collect = Collect(&grads, Vec::new());
    model.visit(&mut collect);
    (value, collect.1)
}

#[test]
fn streamed_host_made_weights_train_as_resident_ones() {
    let device = Default::default();
    let mut resident_place =
        |_: &str, data: TensorData| Ok(Tensor::<B, 2>::from_data(data, &device));
    let resident = model(&mut resident_place);
    let (loss, grads) = step(&resident);

    let config = OffloadConfig::default()
        .with_ring_slots(2)
        .with_direct_threshold(0)
        .with_poisoning(true);
    let stream = WeightStream::<B>::new(&device, config).unwrap();
    let mut placed = Vec::new();
    let mut stream_place = |name: &str, data: TensorData| {
        placed.push(name.to_string());
        stream.streamed_tensor::<2>(name, data).map_err(Into::into)
    };
    let streamed = model(&mut stream_place);
    let streamed = stream.stream_frozen(streamed).unwrap();
    // Every Linear of the model: 2 embedders × 2, 2 inputs, 3 modulations, 2 double blocks × 8,
    // 2 single blocks × 2, the final layer's 2.
    assert_eq!(placed.len(), 4 + 2 + 3 + 16 + 4 + 2);
    for _ in 0..2 {
        stream.begin_step();
        let (streamed_loss, streamed_grads) = step(&streamed);
        let stats = stream.end_step();
        assert!(stats.bytes_uploaded > 0);
        assert_eq!(streamed_loss.to_bits(), loss.to_bits());
        assert_eq!(streamed_grads.len(), grads.len());
        assert_eq!(streamed_grads, grads);
    }
    assert!(loss.is_finite() && !grads.is_empty());
}
