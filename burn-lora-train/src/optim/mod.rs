//! AdamW for the trainable parameters of a Burn module, with f32 or block-wise 8-bit moments,
//! global-norm gradient clipping, the learning-rate schedule, and a state that is saved and
//! restored bit for bit.
//!
//! # Why not `burn::optim::AdamW`
//! Burn's optimizer keys its state by [`ParamId`](burn::module::ParamId), which is random for each model built, so a
//! LoRA reloaded from its file on resume could not find its moments; its clipping is per tensor,
//! not by global norm; and it has no 8-bit state. [`AdamW`] keys its state by module path
//! (`blocks.0.attn.qkv.lora.down`), which is the same in every process that builds the model.
//!
//! # The update
//! For each parameter `p` with gradient `g` (after clipping), at optimizer step `t ≥ 1`:
//! ```text
//! m ← β₁·m + (1 − β₁)·g          v ← β₂·v + (1 − β₂)·g²
//! p ← p·(1 − lr·λ) − lr · (m / (1 − β₁ᵗ)) / (sqrt(v / (1 − β₂ᵗ)) + ε)
//! ```
//! (PyTorch's `AdamW`). Parameters stored in a 16-bit dtype get an f32 master copy in the
//! optimizer state; the parameter is the master copy rounded to its dtype after each step.
//!
//! # 8-bit moments ([`OptimizerKind::AdamW8bit`])
//! Moments are kept in blocks of [`BLOCK`] values with one f32 absmax scale per block, as
//! bitsandbytes' block-wise `AdamW8bit`. Instead of its "dynamic" 8-bit code map (a table of
//! 256 values searched at quantization), the code is a power-law companding that plain Burn
//! tensor ops compute and invert on any backend, with no table and no search:
//! - first moment, signed: `q = round(127 · sign(y) · |y|^(1/4))` with `y = m / absmax`, in `i8`
//!   (the fourth root as two square roots, the fourth power as two squares);
//! - second moment, through `w = sqrt(v)` (whose dynamic range is that of `|g|`, half the
//!   exponent range of `v`), unsigned: `q = round(255 · y^(1/4))` with `y = w / absmax`, in `u8`,
//!   and `q ≥ 1` whenever `w > 0`, so a small `v` never dequantizes to 0 (which would turn
//!   `m / (sqrt(v) + ε)` into a huge step).
//!
//! The relative error of a value at ratio `y` to its block's absmax is at most
//! `(1 + 1 / (2 · 127 · y^(1/4)))⁴ − 1` for `m` (1.6 % at `y = 1`, 2.8 % at `10⁻¹`, 5.1 % at
//! `10⁻²`, 9.2 % at `10⁻³`) and the same with 255 levels for `sqrt(v)` (0.8 %, 1.4 %, 2.5 %,
//! 4.5 %); the smallest non-zero `|m|` is `3.8·10⁻⁹`
//! of the absmax. The dynamic map is finer right at the top of a block (0.7 % at `y = 1`) and
//! coarser below `y ≈ 0.3` (7 % at `10⁻¹`). The power 4 was chosen on the reference problem of
//! `tests/optim.rs` (powers 2 to 8 tried: 4 gave the smallest error). Tensors of fewer than
//! [`MIN_8BIT_NUMEL`] values keep f32 moments (bitsandbytes' `min_8bit_size`). State memory:
//! 2 bytes + 8 bytes per 256 values, against 8 bytes for f32 moments.
//!
//! # Where the state lives ([`StatePlacement`])
//! [`OnDevice`] keeps the moments and master copies beside the parameters and updates them
//! there. [`OnHost`] keeps them in host memory and runs the update on the CPU, one pass per
//! chunk on all cores with the same operations value by value: each step takes the gradients
//! to the host in their dtype (or finds them there, summed by burn-offload's gradient sink:
//! [`AdamW::step_with_host_gradients`]) and moves the updated parameters back in theirs. The
//! host sums the gradients' squares in f64, the device in f32, so the two clip by factors that
//! may differ in their last bits, and agree to f32 rounding.

use std::collections::{BTreeMap, BTreeSet};
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use burn::backend::Flex;
use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend, BackendTypes};
use burn::tensor::{DType, ElementConversion, FloatDType, Tensor, TensorData};

use burn_offload::HostGradient;

use crate::checkpoint::StateTensor;
use crate::config::{OptimizerKind, OptimizerState, SchedulerKind, TrainSettings};

mod chunk;
mod host;

use chunk::{Chunk, Member, Moment, Part, UpdateStep, Which, gather, member_values, plan_chunks};

/// The 8-bit code stores `levels · y^(1 / CODE_POWER)` for a value at ratio `y` of its block's
/// absmax (the root taken as two square roots, the power as two squares).
pub const CODE_POWER: f64 = 4.0;

/// Values per quantization block of the 8-bit moments.
pub const BLOCK: usize = 256;

/// Parameters with fewer values keep f32 moments under `AdamW8bit`.
pub const MIN_8BIT_NUMEL: usize = 4096;

/// A problem with a saved optimizer state.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A tensor of the saved state is missing, malformed or does not fit the module.
    #[error("optimizer state `{key}`: {message}")]
    State {
        /// The tensor key (`<module path>.<part>`).
        key: String,
        /// What is wrong.
        message: String,
    },
}

fn state_error(key: impl Into<String>, message: impl Into<String>) -> OptimError {
    OptimError::State {
        key: key.into(),
        message: message.into(),
    }
}

/// AdamW hyperparameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// f32 or block-wise 8-bit moments.
    pub kind: OptimizerKind,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to `sqrt(v̂)`.
    pub epsilon: f64,
    /// Decoupled weight decay `λ`.
    pub weight_decay: f64,
    /// Global-norm clipping threshold; `None`: no clipping.
    pub max_grad_norm: Option<f64>,
}

impl AdamWConfig {
    /// PyTorch's defaults (`β = (0.9, 0.999)`, `ε = 10⁻⁸`) with the given moments and decay,
    /// no clipping.
    pub fn new(kind: OptimizerKind, weight_decay: f64) -> Self {
        Self {
            kind,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay,
            max_grad_norm: None,
        }
    }

    /// The optimizer of a validated `train` section.
    pub fn from_settings(train: &TrainSettings) -> Self {
        Self {
            max_grad_norm: train.max_grad_norm,
            ..Self::new(train.optimizer, train.weight_decay)
        }
    }
}

/// What an optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// `false` when the norm was not finite: parameters and state were left untouched.
    pub applied: bool,
}

/// Where the optimizer state of parameters on backend `B` lives and is updated.
pub trait StatePlacement<B: Backend>: Clone + std::fmt::Debug + Send + 'static {
    /// The backend holding the state.
    type State: Backend;

    /// The state's device for parameters on `device`.
    fn state_device(device: &B::Device) -> <Self::State as BackendTypes>::Device;

    /// `tensor` (a gradient, or a parameter's first value) on the state's device, in its dtype.
    fn to_state(tensor: Tensor<B, 1>) -> Tensor<Self::State, 1>;

    /// An updated parameter value back on `device`, in its dtype.
    fn to_model(tensor: Tensor<Self::State, 1>, device: &B::Device) -> Tensor<B, 1>;

    /// The f32 master copy of a chunk's values, on the state's device.
    fn master(values: Tensor<B, 1>) -> Tensor<Self::State, 1> {
        Self::to_state(values).cast(FloatDType::F32)
    }

    /// A chunk's gradient `g` on the state's device, and its squared L2 norm as one f32 value
    /// on `g`'s device.
    fn gradient(g: Tensor<B, 1>) -> (Tensor<Self::State, 1>, Tensor<B, 1>);

    /// [`gradient`](Self::gradient) of a chunk's gradient in host memory (flat, in the
    /// parameters' dtype), its norm on `device`.
    fn host_gradient(g: TensorData, device: &B::Device) -> (Tensor<Self::State, 1>, Tensor<B, 1>);

    /// One step of `chunk` with its gradient `g` (in the parameters' dtype, on the state's
    /// device); returns the new values in the parameters' dtype. By default Burn's tensor ops
    /// on the state's backend.
    #[doc(hidden)]
    fn update(
        chunk: &mut Chunk<Self::State>,
        step: &UpdateStep,
        g: Tensor<Self::State, 1>,
    ) -> Tensor<Self::State, 1> {
        chunk.update(step, g)
    }
}

/// The state beside the parameters, updated on their device.
#[derive(Clone, Copy, Debug, Default)]
pub struct OnDevice;

impl<B: Backend> StatePlacement<B> for OnDevice {
    type State = B;

    fn state_device(device: &B::Device) -> B::Device {
        device.clone()
    }

    fn to_state(tensor: Tensor<B, 1>) -> Tensor<B, 1> {
        tensor
    }

    fn to_model(tensor: Tensor<B, 1>, _device: &B::Device) -> Tensor<B, 1> {
        tensor
    }

    fn gradient(g: Tensor<B, 1>) -> (Tensor<B, 1>, Tensor<B, 1>) {
        let sum = g.clone().cast(FloatDType::F32).square().sum();
        (g, sum)
    }

    fn host_gradient(g: TensorData, device: &B::Device) -> (Tensor<B, 1>, Tensor<B, 1>) {
        Self::gradient(upload(g, device))
    }
}

/// The state in host memory, updated on the CPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct OnHost;

impl<B: Backend> StatePlacement<B> for OnHost {
    type State = Flex;

    fn state_device(_device: &B::Device) -> <Flex as BackendTypes>::Device {
        Default::default()
    }

    fn to_state(tensor: Tensor<B, 1>) -> Tensor<Flex, 1> {
        upload(tensor.into_data(), &Default::default())
    }

    fn to_model(tensor: Tensor<Flex, 1>, device: &B::Device) -> Tensor<B, 1> {
        upload(tensor.into_data(), device)
    }

    /// Converted on all cores.
    fn master(values: Tensor<B, 1>) -> Tensor<Flex, 1> {
        upload(host::to_f32(values.into_data()), &Default::default())
    }

    /// The norm on the host, on all cores, in a fixed order.
    fn gradient(g: Tensor<B, 1>) -> (Tensor<Flex, 1>, Tensor<B, 1>) {
        let device = g.device();
        Self::host_gradient(g.into_data(), &device)
    }

    fn host_gradient(g: TensorData, device: &B::Device) -> (Tensor<Flex, 1>, Tensor<B, 1>) {
        let sum = host::square_sum(&g);
        (
            upload(g, &Default::default()),
            upload(TensorData::new(vec![sum], [1]), device),
        )
    }

    fn update(chunk: &mut Chunk<Flex>, step: &UpdateStep, g: Tensor<Flex, 1>) -> Tensor<Flex, 1> {
        host::update(chunk, step, g)
    }
}

fn tensor_bytes(len: usize, dtype: DType) -> usize {
    len * dtype.size()
}

/// A tensor with exactly the saved values and dtype.
fn upload<B: Backend, K: burn::tensor::BasicOps<B>>(
    data: TensorData,
    device: &B::Device,
) -> Tensor<B, 1, K> {
    let dtype = data.dtype;
    Tensor::from_data(data, (device, dtype))
}

/// Values updated by one pass of the update's tensor ops, at most: parameters are gathered into
/// flat chunks of up to this many values (a parameter larger than that is a chunk of its own),
/// so that a step launches a few dozen kernels per chunk instead of per parameter, and the
/// chunk's f32 temporaries stay within 64 MiB each.
pub const CHUNK: usize = 1 << 24;

/// Bytes of updated parameters that a step uploads before they replace the old ones in the
/// module (the old ones are then freed): what the update holds twice at most.
const SWAP_BYTES: usize = 1 << 30;

/// A parameter's gradient, flattened.
enum Grad<'a, B: Backend> {
    /// On the parameters' device, in their dtype.
    Device(Tensor<B, 1>),
    /// Summed in host memory.
    Host(HostGradient<'a>),
}

/// A parameter the optimizer sees, in the module's visiting order.
struct Entry<'a, B: Backend> {
    path: String,
    dtype: DType,
    /// The parameter's values, flattened.
    value: Tensor<B, 1>,
    /// Its gradient, when it has one.
    grad: Option<Grad<'a, B>>,
}

/// AdamW over the parameters of a module that receive gradients, keyed by module path, with
/// its state where `P` puts it.
///
/// The parameters are updated in flat chunks of up to [`CHUNK`] values (the "multi-tensor"
/// AdamW of PyTorch's `foreach` path), so the number of kernels a step launches grows with the
/// chunks, not with the parameters. The arithmetic is per value, so the chunks do not change
/// it. A parameter without a gradient in a step is left as it is when no parameter of its
/// chunk has one, and otherwise takes a step with a zero gradient (its moments decay).
///
/// ```
/// use burn::backend::{Autodiff, Flex};
/// use burn::nn::LinearConfig;
/// use burn::optim::GradientsParams;
/// use burn::tensor::Tensor;
/// use burn_lora_train::config::OptimizerKind;
/// use burn_lora_train::optim::{AdamW, AdamWConfig};
///
/// type B = Autodiff<Flex>;
/// let device = Default::default();
/// let model = LinearConfig::new(4, 2).init::<B>(&device);
/// let loss = model.forward(Tensor::<B, 2>::ones([3, 4], &device)).sum();
/// let grads = GradientsParams::from_grads(loss.backward(), &model);
/// let mut optimizer = AdamW::<Flex>::new(AdamWConfig::new(OptimizerKind::AdamW, 0.01));
/// let (model, report) = optimizer.step(model, grads, 1e-3);
/// assert!(report.applied);
/// ```
#[derive(Clone, Debug)]
pub struct AdamW<B: Backend, P: StatePlacement<B> = OnDevice> {
    config: AdamWConfig,
    /// Optimizer steps taken (`t` of the bias correction).
    steps: u64,
    /// The state, chunk by chunk, in the order the parameters were first seen.
    chunks: Vec<Chunk<P::State>>,
    /// Values per chunk at most ([`CHUNK`]).
    chunk_values: usize,
    /// Bytes of new values uploaded before they replace the old ones ([`Swap`]).
    swap_bytes: usize,
    placement: PhantomData<P>,
}

/// Module paths, maintained through `enter_module` / `exit_module`.
#[derive(Default)]
struct PathStack(Vec<String>);

impl PathStack {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }

    fn exit(&mut self) {
        self.0.pop();
    }

    fn current(&self) -> String {
        self.0.join(".")
    }
}

/// The float parameters of a module in visiting order: those with a gradient in `grads` or,
/// failing that, in `host` (which are taken out of them), or those at the `wanted` paths.
struct Entries<'a, B: Backend> {
    path: PathStack,
    grads: Option<&'a mut GradientsParams>,
    host: BTreeMap<&'a str, HostGradient<'a>>,
    wanted: Option<&'a BTreeSet<String>>,
    entries: Vec<Entry<'a, B>>,
}

impl<AB: AutodiffBackend> ModuleVisitor<AB> for Entries<'_, AB::InnerBackend> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AB, D>>) {
        let path = self.path.current();
        let grad = match &mut self.grads {
            Some(grads) => match grads.remove::<AB::InnerBackend, D>(param.id) {
                Some(grad) => Some(Grad::Device(flat(grad))),
                None => match self.host.remove(path.as_str()) {
                    Some(sum) => Some(Grad::Host(sum)),
                    None => return,
                },
            },
            None => None,
        };
        if self.wanted.is_some_and(|wanted| !wanted.contains(&path)) {
            return;
        }
        let value = param.val().inner();
        self.entries.push(Entry {
            path,
            dtype: value.dtype(),
            value: flat(value),
            grad,
        });
    }
}

/// `tensor`'s values as a vector.
fn flat<B: Backend, const D: usize>(tensor: Tensor<B, D>) -> Tensor<B, 1> {
    let numel = tensor.shape().num_elements();
    tensor.reshape([numel])
}

/// Sets parameters to new flat values (cast to each parameter's dtype), by path.
struct SetValues<B: Backend> {
    path: PathStack,
    values: BTreeMap<String, Tensor<B, 1>>,
}

impl<AB: AutodiffBackend> ModuleMapper<AB> for SetValues<AB::InnerBackend> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.enter(name);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AB, D>>) -> Param<Tensor<AB, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(values) = self.values.remove(&self.path.current()) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let inner = tensor.inner();
        let mut tensor = Tensor::from_inner(values.cast(inner.dtype()).reshape(inner.shape()));
        if require_grad {
            tensor = tensor.require_grad();
        }
        Param::from_mapped_value(id, tensor, mapper)
    }
}

/// New parameter values on their way into a module: once `limit` bytes of them wait, they
/// replace the old values, which are then freed, so that an update holds at most that much
/// twice rather than every parameter.
struct Swap<B: Backend> {
    values: BTreeMap<String, Tensor<B, 1>>,
    pending: usize,
    limit: usize,
}

impl<B: Backend> Swap<B> {
    fn new(limit: usize) -> Self {
        Self {
            values: BTreeMap::new(),
            pending: 0,
            limit,
        }
    }

    /// Takes the `members`' new values from their chunk's flat tensor `flat`; returns
    /// `module`, with the waiting values in it once they reach the limit.
    fn add<AB, M>(&mut self, module: M, members: &[Member], flat: &Tensor<B, 1>) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        for member in members {
            self.values
                .insert(member.path.clone(), member_values(flat, member));
        }
        self.pending += tensor_bytes(flat.dims()[0], flat.dtype());
        if self.pending < self.limit {
            return module;
        }
        self.pending = 0;
        self.finish(module)
    }

    /// `module` with every waiting value in it.
    fn finish<AB, M>(&mut self, module: M) -> M
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        if self.values.is_empty() {
            return module;
        }
        module.map(&mut SetValues::<B> {
            path: PathStack::default(),
            values: std::mem::take(&mut self.values),
        })
    }
}

/// Concatenates saved tensors of one dtype into one flat tensor's data, with `len` values
/// (zeros after the last part's end and wherever `parts` leave a gap).
fn concat(parts: Vec<(usize, TensorData)>, len: usize, dtype: DType) -> TensorData {
    let size = dtype.size();
    let mut bytes = vec![0u8; len * size];
    for (offset, data) in parts {
        let part = data.as_bytes();
        bytes[offset * size..offset * size + part.len()].copy_from_slice(part);
    }
    TensorData::from_bytes_vec(bytes, [len], dtype)
}

impl<B: Backend, P: StatePlacement<B>> AdamW<B, P> {
    /// An optimizer with no state yet (moments are created at the first gradient).
    pub fn new(config: AdamWConfig) -> Self {
        Self {
            config,
            steps: 0,
            chunks: Vec::new(),
            chunk_values: CHUNK,
            swap_bytes: SWAP_BYTES,
            placement: PhantomData,
        }
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Optimizer steps applied so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes held by the state: moments, block scales and the master copies of 16-bit
    /// parameters (an f32 parameter's values are its own).
    pub fn state_bytes(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| {
                let master = if c.dtype == DType::F32 {
                    0
                } else {
                    tensor_bytes(c.len, DType::F32)
                };
                c.m.bytes() + c.v.bytes() + master
            })
            .sum()
    }

    /// Chunks for the parameters of `entries` that have no state yet: zero moments, master
    /// copies from their values.
    fn add_chunks(&mut self, entries: &[Entry<B>]) {
        let known: BTreeSet<&str> = self
            .chunks
            .iter()
            .flat_map(|c| c.members.iter().map(|m| m.path.as_str()))
            .collect();
        let new: Vec<&Entry<B>> = entries
            .iter()
            .filter(|e| !known.contains(e.path.as_str()))
            .collect();
        let Some(first) = new.first() else {
            return;
        };
        let device = P::state_device(&first.value.device());
        let layout: Vec<(String, DType, usize)> = new
            .iter()
            .map(|e| (e.path.clone(), e.dtype, e.value.shape().num_elements()))
            .collect();
        let values: BTreeMap<&str, &Tensor<B, 1>> =
            new.iter().map(|e| (e.path.as_str(), &e.value)).collect();
        for (dtype, quantized, members, len) in
            plan_chunks(&layout, self.config.kind, self.chunk_values)
        {
            let flat = gather(&members, len, dtype, |m| {
                Some(values[m.path.as_str()].clone())
            })
            .expect("every new member has values");
            self.chunks.push(Chunk {
                dtype,
                quantized,
                len,
                m: Moment::zeros(len, quantized, Which::First, &device),
                v: Moment::zeros(len, quantized, Which::Second, &device),
                master: P::master(flat),
                members,
            });
        }
    }

    /// One step on every parameter of `module` that has a gradient in `grads`, at learning rate
    /// `lr`, after clipping the gradients to the global norm of the configuration.
    ///
    /// The global norm is read back to the host (one sync); when it is not finite the module
    /// and the state are returned unchanged and [`StepReport::applied`] is `false`.
    pub fn step<AB, M>(&mut self, module: M, grads: GradientsParams, lr: f64) -> (M, StepReport)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        self.step_with_host_gradients(module, grads, &[], lr, 1)
    }

    /// [`step`](Self::step) where the gradients of some parameters were summed in host memory
    /// instead (`host`: module paths and flat values, as burn-offload's `GradientSums` hands
    /// them over), and both are sums over `micro_batches` micro-batches, whose mean the update
    /// takes (clipped by the mean's norm). A gradient reaches the update in the parameter's
    /// dtype either way.
    pub fn step_with_host_gradients<AB, M>(
        &mut self,
        module: M,
        mut grads: GradientsParams,
        host: &[(&str, HostGradient<'_>)],
        lr: f64,
        micro_batches: usize,
    ) -> (M, StepReport)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let mut visitor = Entries::<B> {
            path: PathStack::default(),
            grads: Some(&mut grads),
            host: host.iter().copied().collect(),
            wanted: None,
            entries: Vec::new(),
        };
        module.visit(&mut visitor);
        let entries = visitor.entries;
        let Some(model_device) = entries.first().map(|e| e.value.device()) else {
            return (
                module,
                StepReport {
                    grad_norm: 0.0,
                    applied: true,
                },
            );
        };
        let started = Instant::now();
        self.add_chunks(&entries);
        let created = started.elapsed();
        let mut device_grads = BTreeMap::new();
        let mut host_grads = BTreeMap::new();
        for entry in entries {
            match entry.grad {
                Some(Grad::Device(g)) => {
                    device_grads.insert(entry.path, g);
                }
                Some(Grad::Host(sum)) => {
                    host_grads.insert(entry.path, sum);
                }
                None => {}
            }
        }
        // The gradients chunk by chunk on the state's device in the parameters' dtype, and
        // their squared norm (where `P` takes it).
        let mut flat_grads = Vec::with_capacity(self.chunks.len());
        let mut squares: Option<Tensor<B, 1>> = None;
        for chunk in &self.chunks {
            let on_device = gather(&chunk.members, chunk.len, chunk.dtype, |m| {
                device_grads.remove(&m.path)
            });
            let on_host =
                host::gather_sums(&chunk.members, chunk.len, chunk.dtype, &mut host_grads)
                    .map(|flat| P::host_gradient(flat, &model_device));
            // Members have a gradient in one place or the other: the two parts add up.
            let (flat, sum) = match (on_device.map(P::gradient), on_host) {
                (Some(part), None) | (None, Some(part)) => part,
                (Some((g, sum)), Some((h, host_sum))) => (g + h, sum + host_sum),
                (None, None) => {
                    flat_grads.push(None);
                    continue;
                }
            };
            squares = Some(match squares.take() {
                Some(total) => total + sum,
                None => sum,
            });
            flat_grads.push(Some(flat));
        }
        let mean = 1.0 / micro_batches as f64;
        let grad_norm = mean * squares.map_or(0.0, |s| s.sqrt().into_scalar().elem::<f64>());
        let gathered = started.elapsed();
        if !grad_norm.is_finite() {
            return (
                module,
                StepReport {
                    grad_norm,
                    applied: false,
                },
            );
        }
        // PyTorch's clip_grad_norm_: scale by max / (norm + 1e-6) when that is below 1.
        let grad_scale = mean
            * match self.config.max_grad_norm {
                Some(max) => (max / (grad_norm + 1e-6)).min(1.0),
                None => 1.0,
            };
        self.steps += 1;
        let step = UpdateStep {
            config: self.config,
            t: self.steps,
            lr,
            grad_scale,
        };
        let mut module = module;
        let mut swap = Swap::new(self.swap_bytes);
        let mut updating = Duration::ZERO;
        for (chunk, g) in self.chunks.iter_mut().zip(flat_grads) {
            if let Some(g) = g {
                let start = Instant::now();
                let new = P::update(chunk, &step, g);
                updating += start.elapsed();
                let out = P::to_model(new, &model_device);
                module = swap.add(module, &chunk.members, &out);
            }
        }
        let module = swap.finish(module);
        // Host times: where the state is on the device, they are the time to queue the work.
        tracing::debug!(
            "optimizer: state created {:.3} s, gradients and their norm {:.3} s, update {:.3} \
             s, new values into the model {:.3} s",
            created.as_secs_f64(),
            (gathered - created).as_secs_f64(),
            updating.as_secs_f64(),
            (started.elapsed() - gathered - updating).as_secs_f64(),
        );
        (
            module,
            StepReport {
                grad_norm,
                applied: true,
            },
        )
    }

    /// The state as named tensors, for a checkpoint: `<path>.m`, `<path>.v` (f32 moments) or
    /// `<path>.m.codes`, `<path>.m.absmax`, `<path>.v.codes`, `<path>.v.absmax` (8-bit moments
    /// of the parameter's whole blocks; `v.*` encodes `sqrt(v)`), and `<path>.master`, the
    /// exact f32 value of every optimized parameter (its master copy, or the parameter itself
    /// when it is f32), so that a resume is exact whatever dtype the LoRA file was saved in.
    /// Each tensor's values are read (from the device, where the state is there) only when a
    /// checkpoint writes it, so that the state is never copied whole.
    pub fn state_tensors(&self) -> Vec<StateTensor> {
        let mut out = Vec::new();
        for chunk in &self.chunks {
            for member in &chunk.members {
                let path = &member.path;
                for (which, moment) in [(Which::First, &chunk.m), (Which::Second, &chunk.v)] {
                    for (suffix, part) in moment.member(member).parts(which) {
                        out.push(lazy(format!("{path}.{suffix}"), part));
                    }
                }
                let master = Part::Float(member_values(&chunk.master, member));
                out.push(lazy(format!("{path}.master"), master));
            }
        }
        out
    }

    /// [`state_tensors`](Self::state_tensors) with their values, read now.
    pub fn to_tensors(&self) -> Vec<(String, TensorData)> {
        self.state_tensors()
            .into_iter()
            .map(StateTensor::into_named)
            .collect()
    }

    /// Restores a state saved with [`AdamW::to_tensors`] after `steps` steps: checks every
    /// tensor against the parameters of `module` (same paths, sizes and moment format), and
    /// returns `module` with each optimized parameter set to its saved value.
    pub fn restore<AB, M>(
        &mut self,
        module: M,
        steps: u64,
        tensors: Vec<(String, TensorData)>,
    ) -> Result<M, OptimError>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        let mut tensors: BTreeMap<String, TensorData> = tensors.into_iter().collect();
        let paths: BTreeSet<String> = tensors
            .keys()
            .filter_map(|k| k.strip_suffix(".master").map(str::to_string))
            .collect();
        let mut visitor = Entries::<B> {
            path: PathStack::default(),
            grads: None,
            host: BTreeMap::new(),
            wanted: Some(&paths),
            entries: Vec::new(),
        };
        module.visit(&mut visitor);
        let entries = visitor.entries;
        if let Some(path) = paths
            .iter()
            .find(|p| !entries.iter().any(|e| &e.path == *p))
        {
            return Err(state_error(path, "no such parameter in the model"));
        }
        let Some(model_device) = entries.first().map(|e| e.value.device()) else {
            return Ok(module);
        };
        let device = P::state_device(&model_device);
        let layout: Vec<(String, DType, usize)> = entries
            .iter()
            .map(|e| (e.path.clone(), e.dtype, e.value.shape().num_elements()))
            .collect();
        let mut take = |key: String, len: usize, dtype: DType| -> Result<TensorData, OptimError> {
            let data = tensors.remove(&key).ok_or_else(|| {
                state_error(&key, "missing (saved with another optimizer or model?)")
            })?;
            if data.shape.num_elements() != len || data.dtype != dtype {
                return Err(state_error(
                    &key,
                    format!(
                        "is {:?} {:?}, expected {dtype:?} with {len} values",
                        data.dtype, data.shape
                    ),
                ));
            }
            Ok(data)
        };
        let mut chunks = Vec::new();
        let mut module = module;
        let mut swap = Swap::new(self.swap_bytes);
        for (dtype, quantized, members, len) in
            plan_chunks(&layout, self.config.kind, self.chunk_values)
        {
            let mut moment = |which: Which| -> Result<Moment<P::State>, OptimError> {
                let name = which.name();
                let mut parts = |suffix: &str, per: usize, dtype: DType| {
                    members
                        .iter()
                        .map(|m| {
                            let key = format!("{}.{suffix}", m.path);
                            Ok((m.offset / per, take(key, m.span(quantized) / per, dtype)?))
                        })
                        .collect::<Result<Vec<_>, OptimError>>()
                };
                Ok(if quantized {
                    let code = DType::from(which.code_dtype());
                    let codes = parts(&format!("{name}.codes"), 1, code)?;
                    let absmax = parts(&format!("{name}.absmax"), BLOCK, DType::F32)?;
                    Moment::Q8 {
                        codes: upload(concat(codes, len, code), &device),
                        absmax: upload(concat(absmax, len / BLOCK, DType::F32), &device),
                    }
                } else {
                    Moment::F32(upload(
                        concat(parts(name, 1, DType::F32)?, len, DType::F32),
                        &device,
                    ))
                })
            };
            let m = moment(Which::First)?;
            let v = moment(Which::Second)?;
            let masters = members
                .iter()
                .map(|m| {
                    Ok((
                        m.offset,
                        take(format!("{}.master", m.path), m.numel, DType::F32)?,
                    ))
                })
                .collect::<Result<Vec<_>, OptimError>>()?;
            let master: Tensor<P::State, 1> = upload(concat(masters, len, DType::F32), &device);
            module = swap.add(
                module,
                &members,
                &P::to_model(master.clone(), &model_device),
            );
            chunks.push(Chunk {
                dtype,
                quantized,
                members,
                len,
                m,
                v,
                master,
            });
        }
        if let Some(key) = tensors.keys().next() {
            return Err(state_error(
                key,
                "not part of an AdamW state for this model",
            ));
        }
        self.steps = steps;
        self.chunks = chunks;
        Ok(swap.finish(module))
    }
}

/// A saved tensor whose values `part` reads when the checkpoint writes it.
fn lazy<B: Backend>(name: String, part: Part<B>) -> StateTensor {
    StateTensor::lazy(name, part.dtype(), vec![part.len()], move || part.to_data())
}

/// An [`AdamW`] whose state is on the device or in host memory, as chosen at run time.
#[derive(Clone, Debug)]
pub enum PlacedAdamW<B: Backend> {
    /// The state beside the parameters.
    Device(AdamW<B, OnDevice>),
    /// The state in host memory, updated on the CPU.
    Host(AdamW<B, OnHost>),
}

impl<B: Backend> PlacedAdamW<B> {
    /// An optimizer with no state yet, its state where `placement` says.
    pub fn new(config: AdamWConfig, placement: OptimizerState) -> Self {
        match placement {
            OptimizerState::Device => Self::Device(AdamW::new(config)),
            OptimizerState::Host => Self::Host(AdamW::new(config)),
        }
    }

    /// [`AdamW::step_with_host_gradients`].
    pub fn step<AB, M>(
        &mut self,
        module: M,
        grads: GradientsParams,
        host: &[(&str, HostGradient<'_>)],
        lr: f64,
        micro_batches: usize,
    ) -> (M, StepReport)
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        match self {
            Self::Device(o) => o.step_with_host_gradients(module, grads, host, lr, micro_batches),
            Self::Host(o) => o.step_with_host_gradients(module, grads, host, lr, micro_batches),
        }
    }

    /// [`AdamW::steps`].
    pub fn steps(&self) -> u64 {
        match self {
            Self::Device(o) => o.steps(),
            Self::Host(o) => o.steps(),
        }
    }

    /// [`AdamW::state_tensors`].
    pub fn state_tensors(&self) -> Vec<StateTensor> {
        match self {
            Self::Device(o) => o.state_tensors(),
            Self::Host(o) => o.state_tensors(),
        }
    }

    /// [`AdamW::restore`].
    pub fn restore<AB, M>(
        &mut self,
        module: M,
        steps: u64,
        tensors: Vec<(String, TensorData)>,
    ) -> Result<M, OptimError>
    where
        AB: AutodiffBackend<InnerBackend = B>,
        M: AutodiffModule<AB>,
    {
        match self {
            Self::Device(o) => o.restore(module, steps, tensors),
            Self::Host(o) => o.restore(module, steps, tensors),
        }
    }
}

/// The learning rate at each optimizer step: linear warm-up from 0, then constant, linear
/// decay to 0 or half-cosine decay to 0 at the last step (the curves of diffusers'
/// `get_scheduler`, which ai-toolkit uses).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub peak: f64,
    /// Steps of warm-up.
    pub warmup: u64,
    /// Total optimizer steps.
    pub total: u64,
    /// Curve after warm-up.
    pub kind: SchedulerKind,
}

impl LrSchedule {
    /// The schedule of a validated `train` section.
    pub fn from_settings(train: &TrainSettings) -> Self {
        Self {
            peak: train.lr,
            warmup: train.lr_warmup_steps,
            total: train.steps,
            kind: train.lr_scheduler,
        }
    }

    /// The learning rate of optimizer step `step`, counted from 0.
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = (step - self.warmup) as f64 / span;
        let factor = match self.kind {
            SchedulerKind::Constant => 1.0,
            SchedulerKind::Linear => (1.0 - progress).max(0.0),
            SchedulerKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos()),
        };
        self.peak * factor
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;

    type B = Flex;

    fn data_f32(t: Tensor<B, 1>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// The largest relative error of rounding a value at ratio `y` of the absmax to the code:
    /// half a code step, raised to the code's power (plus f32 rounding).
    fn half_step_error(levels: f64, y: f64) -> f64 {
        (1.0 + 0.5 / (levels * y.powf(1.0 / CODE_POWER))).powf(CODE_POWER) - 1.0 + 1e-6
    }

    #[test]
    fn quantized_moments_round_trip_within_the_stated_bound() {
        let device = Default::default();
        // Magnitudes spread over five decades in each block, both signs.
        let values: Vec<f32> = (0..4 * BLOCK)
            .map(|i| {
                let decade = (i % 5) as f32;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * 10f32.powf(-decade) * (1.0 + (i % 7) as f32 / 7.0)
            })
            .collect();
        let x = Tensor::<B, 1>::from_floats(values.as_slice(), &device);
        let m = Moment::<B>::quantize(x.clone(), Which::First);
        let back = data_f32(m.values(Which::First));
        let absmax: Vec<f32> = values
            .chunks(BLOCK)
            .map(|c| c.iter().fold(0f32, |a, v| a.max(v.abs())))
            .collect();
        for (i, (&x, &y)) in values.iter().zip(&back).enumerate() {
            let ratio = (x.abs() / absmax[i / BLOCK]) as f64;
            let bound = half_step_error(127.0, ratio);
            let err = ((y - x) / x).abs() as f64;
            assert!(err <= bound, "m[{i}] = {x}: got {y}, error {err} > {bound}");
            assert_eq!(x.signum(), y.signum());
        }
        // The second moment is encoded through its square root.
        let v: Vec<f32> = values.iter().map(|x| x * x).collect();
        let q = Moment::<B>::quantize(Tensor::from_floats(v.as_slice(), &device), Which::Second);
        let back = data_f32(q.values(Which::Second));
        for (i, (&x, &y)) in v.iter().zip(&back).enumerate() {
            let ratio = (x.sqrt() / absmax[i / BLOCK]) as f64;
            let bound_sqrt = half_step_error(255.0, ratio);
            let err = ((y.sqrt() - x.sqrt()) / x.sqrt()).abs() as f64;
            assert!(err <= bound_sqrt, "v[{i}] = {x}: got {y}");
        }
    }

    #[test]
    fn tiny_second_moments_never_decode_to_zero() {
        let device = Default::default();
        let mut v = vec![0f32; BLOCK];
        v[0] = 1.0;
        v[1] = 1e-30;
        let q = Moment::<B>::quantize(Tensor::from_floats(v.as_slice(), &device), Which::Second);
        let back = data_f32(q.values(Which::Second));
        assert!(back[1] > 0.0);
        assert_eq!(back[2], 0.0);
        let Moment::Q8 { codes, .. } = q else {
            unreachable!()
        };
        assert_eq!(codes.dtype(), DType::U8);
    }

    #[test]
    fn chunks_group_consecutive_parameters_of_one_format_and_pad_8bit_ones() {
        let e = |path: &str, dtype, numel| (path.to_string(), dtype, numel);
        let entries = [
            e("a", DType::BF16, 4500),
            e("b", DType::BF16, 5000),
            e("c", DType::F32, 7),
            e("d", DType::BF16, 15),
            e("e", DType::BF16, 9000),
        ];
        let layout = |kind, limit| {
            plan_chunks(&entries, kind, limit)
                .into_iter()
                .map(|(dtype, q, members, len)| {
                    let members: Vec<(String, usize)> =
                        members.into_iter().map(|m| (m.path, m.offset)).collect();
                    (dtype, q, members, len)
                })
                .collect::<Vec<_>>()
        };
        let at = |path: &str, offset| (path.to_string(), offset);
        // 8-bit: a and b padded to whole blocks (4608, 5120); c and d keep f32 moments.
        assert_eq!(
            layout(OptimizerKind::AdamW8bit, CHUNK),
            vec![
                (DType::BF16, true, vec![at("a", 0), at("b", 4608)], 9728),
                (DType::F32, false, vec![at("c", 0)], 7),
                (DType::BF16, false, vec![at("d", 0)], 15),
                (DType::BF16, true, vec![at("e", 0)], 9216),
            ]
        );
        // A limit below two parameters' length splits them; one larger than it stands alone.
        assert_eq!(
            layout(OptimizerKind::AdamW, 9000)
                .iter()
                .map(|(_, _, members, len)| (members.len(), *len))
                .collect::<Vec<_>>(),
            vec![(1, 4500), (1, 5000), (1, 7), (1, 15), (1, 9000)]
        );
        assert_eq!(
            layout(OptimizerKind::AdamW, 9500)
                .iter()
                .map(|(_, _, members, len)| (members.len(), *len))
                .collect::<Vec<_>>(),
            vec![(2, 9500), (1, 7), (2, 9015)]
        );
    }

    #[derive(burn::module::Module, Debug)]
    struct Net<B: Backend> {
        a: Param<Tensor<B, 2>>,
        b: Param<Tensor<B, 1>>,
        c: Param<Tensor<B, 2>>,
        d: Param<Tensor<B, 2>>,
    }

    type AD = burn::backend::Autodiff<Flex>;

    fn net() -> Net<AD> {
        let device = Default::default();
        let param = |shape: [usize; 2], dtype: DType, seed: f32| {
            let n = shape[0] * shape[1];
            let values: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
            let t = Tensor::<AD, 1>::from_floats(values.as_slice(), &device)
                .reshape(shape)
                .cast(dtype);
            Param::from_tensor(t.detach().require_grad())
        };
        Net {
            a: param([9, 500], DType::BF16, 1.0),
            b: Param::from_tensor(
                Tensor::<AD, 1>::from_floats([0.5, -0.25, 2.0, 1.0, -1.5, 0.1, 0.0], &device)
                    .require_grad(),
            ),
            c: param([3, 5], DType::BF16, 2.0),
            d: param([10, 500], DType::BF16, 3.0),
        }
    }

    /// Steps of `optimizer` on a loss whose gradients differ per value and per step.
    fn train(net: Net<AD>, optimizer: &mut AdamW<Flex>, steps: usize) -> Net<AD> {
        let mut net = net;
        for step in 0..steps {
            let f = |p: &Param<Tensor<AD, 2>>| {
                let x = p.val().cast(DType::F32);
                (x.clone() * x.add_scalar(step as f64).sin()).sum()
            };
            let loss = f(&net.a) + f(&net.c) + f(&net.d) + net.b.val().powi_scalar(3).sum();
            let grads = GradientsParams::from_grads(loss.backward(), &net);
            net = optimizer.step(net, grads, 1e-2).0;
        }
        net
    }

    /// The saved state's keys, dtypes and bytes.
    fn bytes(state: &[(String, TensorData)]) -> Vec<(String, DType, Vec<u8>)> {
        state
            .iter()
            .map(|(k, d)| (k.clone(), d.dtype, d.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn chunking_changes_no_value_of_the_update_or_the_saved_state() {
        for kind in [OptimizerKind::AdamW, OptimizerKind::AdamW8bit] {
            let optimizer = |chunk_values: usize| {
                let mut optimizer = AdamW::<Flex>::new(AdamWConfig::new(kind, 0.1));
                optimizer.chunk_values = chunk_values;
                optimizer
            };
            // One parameter per chunk, each swapped into the module on its own, against every
            // parameter of a format in one chunk.
            let mut each = optimizer(1);
            each.swap_bytes = 1;
            train(net(), &mut each, 3);
            let mut together = optimizer(CHUNK);
            let net_together = train(net(), &mut together, 3);
            // a | b | c d, or with 8-bit moments a | b | c | d (c keeps f32 moments).
            let grouped = if kind == OptimizerKind::AdamW { 3 } else { 4 };
            assert_eq!(
                (each.chunks.len(), together.chunks.len()),
                (4, grouped),
                "{kind:?}"
            );
            let state = each.to_tensors();
            assert_eq!(bytes(&state), bytes(&together.to_tensors()), "{kind:?}");
            // Restored into the other chunking, the run goes on as if never interrupted.
            train(net_together, &mut together, 2);
            let mut resumed = optimizer(CHUNK);
            let restored = resumed.restore(net(), 3, state).unwrap();
            train(restored, &mut resumed, 2);
            assert_eq!(
                bytes(&resumed.to_tensors()),
                bytes(&together.to_tensors()),
                "{kind:?}"
            );
        }
    }

    #[test]
    fn schedules_follow_the_diffusers_curves() {
        let s = |kind| LrSchedule {
            peak: 1.0,
            warmup: 10,
            total: 110,
            kind,
        };
        let constant = s(SchedulerKind::Constant);
        assert_eq!(constant.lr(0), 0.0);
        assert_eq!(constant.lr(5), 0.5);
        assert_eq!(constant.lr(10), 1.0);
        assert_eq!(constant.lr(109), 1.0);
        let linear = s(SchedulerKind::Linear);
        assert_eq!(linear.lr(60), 0.5);
        assert!((linear.lr(109) - 0.01).abs() < 1e-12);
        let cosine = s(SchedulerKind::Cosine);
        assert!((cosine.lr(60) - 0.5).abs() < 1e-12);
        assert!((cosine.lr(35) - 0.5 * (1.0 + (std::f64::consts::PI * 0.25).cos())).abs() < 1e-12);
        assert!(cosine.lr(110).abs() < 1e-12);
    }
}
