//! Two experts that train one LoRA by turns (Wan 2.2 A14B, as musubi-tuner's `--dit_high_noise`
//! trains it): the transformer of `model.path` denoises from `train.timestep_boundary` up (the
//! high-noise expert), `model.transformer_2` below it (the low-noise expert).
//!
//! The model holds one expert's frozen parameters and the adapters; the other expert's frozen
//! parameters wait beside it ([`Experts`]), by parameter path. Each micro-batch draws a σ as the
//! objective would, which picks the expert; the two exchange their frozen parameters (handles
//! only: streamed weights stay in host memory, resident ones on the device) and the micro-batch
//! draws its timesteps within that expert's part, keeping the distribution's shape, as
//! musubi-tuner resamples a batch into the first sample's expert.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorMetadata, TensorPrimitive};

use crate::config::{TimestepRange, TrainPlan};
use crate::error::TrainError;
use crate::rng::Rng;

/// The plan that loads the second expert: `plan` with `model.transformer_2` as its source, and
/// another seed for the weights of `tiny` and `random:` models; `None` without a second expert.
pub fn second_plan(plan: &TrainPlan) -> Option<TrainPlan> {
    let source = plan.model.transformer_2.clone()?;
    let mut second = plan.clone();
    second.model.source = source;
    second.train.seed = plan.train.seed.wrapping_add(1);
    Some(second)
}

/// One of the two experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expert {
    /// The transformer of `model.path`: timesteps from the boundary up.
    HighNoise,
    /// `model.transformer_2`: timesteps below the boundary.
    LowNoise,
}

impl Expert {
    /// The expert's name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Expert::HighNoise => "high-noise expert",
            Expert::LowNoise => "low-noise expert",
        }
    }
}

/// The expert not in the model, and the plans each expert's micro-batches run with.
pub struct Experts<B: Backend> {
    /// The frozen parameters of the expert not in the model, by path.
    parked: BTreeMap<String, TensorPrimitive<B>>,
    active: Expert,
    high: TrainPlan,
    low: TrainPlan,
}

impl<B: Backend> Experts<B> {
    /// `second`'s frozen parameters, parked beside `model`, which holds the high-noise expert;
    /// an error naming `model.transformer_2` unless both have the same frozen parameters.
    pub fn new<M: Module<B>>(model: &M, second: M, plan: &TrainPlan) -> Result<Self, TrainError> {
        let (frozen, trainable) = Collect::split(model);
        let (mut parked, _) = Collect::split(&second);
        // The second expert's own adapters, if its type has any, are not the ones trained.
        parked.retain(|name, _| !trainable.contains(name));
        let differs = |message: String| TrainError::SecondExpert {
            file: plan.file.clone(),
            message,
        };
        for (name, ours) in &frozen {
            let Some(theirs) = parked.get(name) else {
                return Err(differs(format!("it has no `{name}`")));
            };
            let (theirs, ours) = (theirs.shape(), ours.shape());
            if theirs != ours {
                return Err(differs(format!(
                    "`{name}` is {:?} there but {:?} in model.path's",
                    theirs.as_slice(),
                    ours.as_slice()
                )));
            }
        }
        if let Some(name) = parked.keys().find(|k| !frozen.contains_key(*k)) {
            return Err(differs(format!("model.path's has no `{name}`")));
        }
        let range = plan.train.timestep_range;
        let boundary = plan.train.timestep_boundary;
        let within = |min: f64, max: f64| {
            let mut p = plan.clone();
            p.train.timestep_range = TimestepRange {
                min,
                max,
                preserve_shape: true,
            };
            p
        };
        Ok(Self {
            parked,
            active: Expert::HighNoise,
            high: within(boundary.max(range.min), range.max),
            low: within(range.min, boundary.min(range.max)),
        })
    }

    /// Draws which expert trains the next micro-batch: the expert of a σ drawn from `rng` as
    /// the objective draws one (`plan`'s sampling and range).
    pub fn choose(&self, plan: &TrainPlan, rng: &mut Rng) -> Expert {
        // The configuration refuses the one sampling that reads the token count.
        let sigma = plan
            .train
            .timestep_range
            .sample(plan.train.timestep, 0, rng);
        match sigma >= plan.train.timestep_boundary {
            true => Expert::HighNoise,
            false => Expert::LowNoise,
        }
    }

    /// The plan `expert`'s micro-batches run with: σ drawn within its timesteps.
    pub fn plan(&self, expert: Expert) -> &TrainPlan {
        match expert {
            Expert::HighNoise => &self.high,
            Expert::LowNoise => &self.low,
        }
    }

    /// `model` holding `expert`'s frozen parameters (its adapters unchanged), the other
    /// expert's parked.
    pub fn activate<M: Module<B>>(&mut self, model: M, expert: Expert) -> M {
        if expert == self.active {
            return model;
        }
        self.active = expert;
        model.map(&mut Swap {
            path: Vec::new(),
            parked: &mut self.parked,
        })
    }
}

/// A module's float parameters by path: the frozen ones with their tensors, and the paths of
/// the trainable ones.
struct Collect<B: Backend> {
    path: Vec<String>,
    frozen: BTreeMap<String, TensorPrimitive<B>>,
    trainable: Vec<String>,
}

impl<B: Backend> Collect<B> {
    fn split<M: Module<B>>(module: &M) -> (BTreeMap<String, TensorPrimitive<B>>, Vec<String>) {
        let mut collect = Self {
            path: Vec::new(),
            frozen: BTreeMap::new(),
            trainable: Vec::new(),
        };
        module.visit(&mut collect);
        (collect.frozen, collect.trainable)
    }
}

impl<B: Backend> ModuleVisitor<B> for Collect<B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let name = self.path.join(".");
        if tensor.is_require_grad() {
            self.trainable.push(name);
            return;
        }
        self.frozen.insert(name, tensor.into_primitive());
    }
}

/// Exchanges a module's frozen float parameters with the parked ones of the same paths.
struct Swap<'a, B: Backend> {
    path: Vec<String>,
    parked: &'a mut BTreeMap<String, TensorPrimitive<B>>,
}

impl<B: Backend> ModuleMapper<B> for Swap<'_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        if tensor.is_require_grad() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let name = self.path.join(".");
        let other = self
            .parked
            .remove(&name)
            .unwrap_or_else(|| panic!("no parked `{name}`: the experts were checked alike"));
        self.parked.insert(name, tensor.into_primitive());
        Param::from_mapped_value(id, Tensor::from_primitive(other), mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};
    use burn::module::Module;
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{Distribution, TensorData};

    type A = Autodiff<Flex>;

    /// A frozen layer and a trainable matrix beside it, as an adapted model has.
    #[derive(Module, Debug)]
    struct Net<B: Backend> {
        layer: Linear<B>,
        adapter: Param<Tensor<B, 2>>,
    }

    impl<B: Backend> Net<B> {
        fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
            self.layer.forward(x.clone()) + x.matmul(self.adapter.val())
        }
    }

    fn frozen(seed: u64, d_out: usize) -> Net<A> {
        let device = Default::default();
        A::seed(&device, seed);
        Net {
            layer: LinearConfig::new(4, d_out).init(&device),
            adapter: Param::from_tensor(Tensor::zeros([4, d_out], &device)),
        }
        .no_grad()
    }

    fn adapted(seed: u64) -> Net<A> {
        let net = frozen(seed, 4);
        let device = Default::default();
        let adapter = Tensor::random([4, 4], Distribution::Normal(0.0, 1.0), &device);
        Net {
            adapter: Param::from_tensor(adapter.require_grad()),
            ..net
        }
    }

    fn output(net: &Net<A>) -> TensorData {
        let x = Tensor::<A, 2>::from_data([[1.0, -2.0, 0.5, 3.0]], &Default::default());
        net.forward(x).into_data()
    }

    fn plan() -> TrainPlan {
        let yaml = "name: t\nnetwork: {type: lora, linear: 4}\nmodel: {arch: wan, path: tiny, \
                    transformer_2: tiny}\ndatasets: [{folder_path: .}]\n";
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("tokenizer")).unwrap();
        let file = dir.path().join("t.yaml");
        std::fs::write(&file, yaml).unwrap();
        TrainPlan::load(&file).unwrap()
    }

    #[test]
    fn activating_an_expert_swaps_its_frozen_parameters_and_keeps_the_adapters() {
        let plan = plan();
        assert_eq!(plan.train.timestep_boundary, 0.875);
        let model = adapted(1);
        let second = frozen(2, 4);
        let low = Net {
            adapter: model.adapter.clone(),
            ..second.clone()
        };
        let (high_out, low_out) = (output(&model), output(&low));
        assert_ne!(high_out, low_out);
        let adapter = (model.adapter.id, model.adapter.val().into_data());

        let mut experts = Experts::new(&model, second, &plan).unwrap();
        let model = experts.activate(model, Expert::LowNoise);
        assert_eq!(output(&model), low_out);
        assert_eq!((model.adapter.id, model.adapter.val().into_data()), adapter);
        assert!(model.adapter.val().is_require_grad());
        let model = experts.activate(model, Expert::LowNoise);
        assert_eq!(output(&model), low_out);
        let model = experts.activate(model, Expert::HighNoise);
        assert_eq!(output(&model), high_out);

        // Each expert draws within its own part of the timesteps.
        assert_eq!(
            experts.plan(Expert::HighNoise).train.timestep_range.min,
            0.875
        );
        assert_eq!(
            experts.plan(Expert::LowNoise).train.timestep_range.max,
            0.875
        );
        let mut rng = Rng::seeded(7);
        let chosen: Vec<Expert> = (0..200).map(|_| experts.choose(&plan, &mut rng)).collect();
        let high = chosen.iter().filter(|e| **e == Expert::HighNoise).count();
        // Wan's default sampling shifts a uniform u by 3 towards noise: σ ≥ 0.875 for u ≥ 0.7.
        assert!((40..80).contains(&high), "{high} of 200");
    }

    #[test]
    fn a_second_expert_of_another_shape_is_refused_by_name() {
        let error = Experts::new(&adapted(1), frozen(2, 3), &plan())
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("model.transformer_2"), "{error}");
        assert!(
            error.contains("`layer.bias` is [3] there but [4] in"),
            "{error}"
        );
    }
}
