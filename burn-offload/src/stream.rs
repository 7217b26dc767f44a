//! The public handle of one device's engine: it turns frozen parameters into streamed weights
//! and brackets training steps.

use std::sync::Arc;

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use crate::backend::{OffloadBackend, OffloadTensor};
use crate::config::OffloadConfig;
use crate::engine::Engine;
use crate::error::OffloadError;
use crate::policy::Route;
use crate::stats::{MemoryPlan, StepStats};
use crate::target::{MemoryProbe, StreamTarget};
use crate::weight::{HostWeight, Payload};

/// The frozen weights of one device, their ring, and their schedule.
///
/// Tensors made by [`WeightStream::stream_frozen`] and [`WeightStream::streamed_tensor`] keep
/// the engine alive; the loader thread stops when the handle and all of them are dropped. Use
/// one `WeightStream` per device, and call [`WeightStream::begin_step`] /
/// [`WeightStream::end_step`] around each training step from the thread that runs it: the
/// first step records the order of weight uses, later steps prefetch by replaying it.
pub struct WeightStream<B: OffloadBackend> {
    engine: Arc<Engine<B::Target>>,
    device: B::Device,
}

impl<B: OffloadBackend> WeightStream<B> {
    /// An engine for `device` with `config`.
    pub fn new(device: &B::Device, config: OffloadConfig) -> Result<Self, OffloadError> {
        config.validate()?;
        Ok(Self {
            engine: Arc::new(Engine::new(B::target_device(device), config)),
            device: device.clone(),
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> OffloadConfig {
        self.engine.config()
    }

    /// Replaces the configuration; the plan is recomputed, the ring resized at the next step.
    /// A new wire format applies to weights streamed afterwards.
    ///
    /// A configuration with an activation headroom is refused with
    /// [`OffloadError::BudgetTooSmall`] when its budget cannot hold the headroom beside the
    /// two-slot ring of a plan that streams every weight registered so far; the configuration
    /// in force then stays. A budget that holds fewer ring slots than asked for keeps that many
    /// (read them back from [`WeightStream::config`]).
    pub fn reconfigure(&self, config: OffloadConfig) -> Result<(), OffloadError> {
        config.validate()?;
        self.engine
            .configure(config)
            .map_err(|short| OffloadError::BudgetTooSmall {
                budget: short.budget,
                headroom: short.headroom,
                ring: short.ring,
                needed: short.needed(),
            })
    }

    /// Reads the device memory in use from `probe` instead of asking the backend
    /// ([`StreamTarget::memory_in_use`]), for the statistics and
    /// [`WeightStream::memory_beyond_weights`].
    pub fn with_memory_probe(self, probe: Arc<dyn MemoryProbe>) -> Self {
        self.engine.set_probe(probe);
        self
    }

    /// Device memory in use now beyond this stream's weights (resident copies and ring):
    /// parameters that stay on the device, activations, gradients, optimizer state. `None`
    /// where the backend does not report its memory (the CPU) and no probe was given.
    pub fn memory_beyond_weights(&self) -> Option<u64> {
        self.engine.memory_beyond_weights()
    }

    /// Device memory the backend's allocator has handed out now beyond this stream's weights
    /// ([`StreamTarget::memory_handed_out`], or the probe's reading): what a step leaves behind
    /// for the next, such as the optimizer state, shows as a difference of two of these.
    pub fn handed_out_beyond_weights(&self) -> Option<u64> {
        self.engine.handed_out_beyond_weights()
    }

    /// How the plan in force divides the budget: headroom, resident weights (as planned: each
    /// is uploaded at its first use), streamed weights and ring.
    pub fn memory_plan(&self) -> MemoryPlan {
        self.engine.memory_plan()
    }

    /// Turns every frozen float parameter of rank 2 or more (those that do not require
    /// gradients: on a backend without autodiff, all of them) into a streamed weight. Trainable
    /// parameters, vectors (biases, norm scales) and parameters already streamed are left as
    /// they are.
    ///
    /// The values are read from the device once, encoded in the configured wire format and kept
    /// in host memory (page-locked on CUDA); the device copies are dropped.
    pub fn stream_frozen<M: Module<B>>(&self, module: M) -> Result<M, OffloadError> {
        let mut mapper = FrozenMapper {
            stream: self,
            path: Vec::new(),
            weights: Vec::new(),
            error: None,
        };
        let module = module.map(&mut mapper);
        if let Some(error) = mapper.error {
            return Err(error);
        }
        self.engine.register(&mapper.weights);
        Ok(module)
    }

    /// `module` on this stream's device, its streamed weights (another stream's, of any
    /// device) streamed by this one from the same host memory, without a copy: how several
    /// devices train replicas of one model with one host copy of its frozen weights. Its other
    /// parameters move to this device, keeping their ids and whether they require gradients.
    pub fn adopt<M: Module<B>>(&self, module: M) -> M {
        let mut mapper = AdoptMapper {
            stream: self,
            weights: Vec::new(),
        };
        let module = module.map(&mut mapper);
        self.engine.register(&mapper.weights);
        module
    }

    /// A streamed weight made from host values, without going through the device (how a
    /// loader brings a model larger than the device's memory).
    pub fn streamed_tensor<const D: usize>(
        &self,
        name: &str,
        data: TensorData,
    ) -> Result<Tensor<B, D>, OffloadError> {
        if data.shape.num_dims() != D {
            return Err(OffloadError::RankMismatch {
                name: name.to_string(),
                shape: data.shape.to_vec(),
                rank: D,
            });
        }
        let expected = data.shape.num_elements() * data.dtype.size();
        if data.bytes.len() != expected {
            return Err(OffloadError::SizeMismatch {
                name: name.to_string(),
                shape: data.shape.to_vec(),
                dtype: data.dtype,
                expected,
                found: data.bytes.len(),
            });
        }
        let weight = self.host_weight(name, data)?;
        self.engine.register(std::slice::from_ref(&weight));
        Ok(self.tensor(weight))
    }

    fn host_weight(&self, name: &str, data: TensorData) -> Result<Arc<HostWeight>, OffloadError> {
        let config = self.engine.config();
        let (shape, dtype) = (data.shape.clone(), data.dtype);
        let payload = Payload::encode(name, data, config.wire, config.direct_threshold)?;
        let memory = <B::Target as StreamTarget>::host_memory(payload.bytes, self.engine.device())?;
        Ok(HostWeight::new(
            name.to_string(),
            shape,
            dtype,
            payload.encoding,
            memory,
        ))
    }

    fn tensor<const D: usize>(&self, weight: Arc<HostWeight>) -> Tensor<B, D> {
        let offload = OffloadTensor::streamed(weight, self.engine.clone());
        Tensor::from_primitive(TensorPrimitive::Float(B::from_offload(offload)))
    }

    /// Starts a training step: replays the recorded order of weight uses (the loader starts
    /// prefetching at once), or records it on the first step.
    pub fn begin_step(&self) {
        self.engine.begin_step();
    }

    /// Ends the step, replans after a recording, and returns the step's statistics (also
    /// logged through `tracing` at level info).
    pub fn end_step(&self) -> StepStats {
        self.engine.end_step()
    }

    /// Where each streamed weight comes from, by parameter path, in the order they were
    /// streamed.
    pub fn routes(&self) -> Vec<(String, Route)> {
        self.engine.routes()
    }
}

struct FrozenMapper<'a, B: OffloadBackend> {
    stream: &'a WeightStream<B>,
    path: Vec<String>,
    weights: Vec<Arc<HostWeight>>,
    error: Option<OffloadError>,
}

impl<B: OffloadBackend> ModuleMapper<B> for FrozenMapper<'_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let primitive = tensor.into_primitive();
        let already = match &primitive {
            TensorPrimitive::Float(t) => B::as_offload(t).is_streamed(),
            TensorPrimitive::QFloat(_) => true,
        };
        let tensor = Tensor::from_primitive(primitive);
        if D < 2 || tensor.is_require_grad() || already || self.error.is_some() {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let name = self.path.join(".");
        let streamed = tensor
            .clone()
            .try_into_data()
            .map_err(|e| OffloadError::Read {
                name: name.clone(),
                reason: e.to_string(),
            })
            .and_then(|data| self.stream.host_weight(&name, data));
        match streamed {
            Ok(weight) => {
                self.weights.push(weight.clone());
                Param::from_mapped_value(id, self.stream.tensor(weight), mapper)
            }
            Err(error) => {
                self.error = Some(error);
                Param::from_mapped_value(id, tensor, mapper)
            }
        }
    }
}

struct AdoptMapper<'a, B: OffloadBackend> {
    stream: &'a WeightStream<B>,
    weights: Vec<Arc<HostWeight>>,
}

impl<B: OffloadBackend> ModuleMapper<B> for AdoptMapper<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let weight = match param.val().into_primitive() {
            TensorPrimitive::Float(t) => B::as_offload(&t).as_streamed().map(|s| s.weight.clone()),
            TensorPrimitive::QFloat(_) => None,
        };
        match weight {
            Some(weight) => {
                self.weights.push(weight.clone());
                let (id, _, mapper) = param.consume();
                Param::from_mapped_value(id, self.stream.tensor(weight), mapper)
            }
            None => param.fork(&self.stream.device),
        }
    }
}
