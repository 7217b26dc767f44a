//! A small LoRA-style network and a training loop written once, generic over the backend, so
//! that a model on `Autodiff<Offload<Flex>>` and the same model on `Autodiff<Flex>` run the very
//! same code.

#![allow(dead_code)]

use burn::module::{AutodiffModule, Module, Param, ParamId};
use burn::nn::Linear;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::tensor::activation::gelu;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData};

/// A frozen base layer plus a trainable low-rank update: `base(x) + x·A·B`.
#[derive(Module, Debug)]
pub struct LoraLinear<B: Backend> {
    pub base: Linear<B>,
    pub a: Param<Tensor<B, 2>>,
    pub b: Param<Tensor<B, 2>>,
}

impl<B: Backend> LoraLinear<B> {
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.base.forward(x.clone()) + x.matmul(self.a.val()).matmul(self.b.val())
    }
}

/// An MLP block with a frozen projection in front (applied to the block's input) and LoRA on
/// both MLP layers.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub proj: Linear<B>,
    pub fc1: LoraLinear<B>,
    pub fc2: LoraLinear<B>,
}

impl<B: Backend> Block<B> {
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = self.proj.forward(x.clone());
        x + self.fc2.forward(gelu(self.fc1.forward(h)))
    }
}

#[derive(Module, Debug)]
pub struct Net<B: Backend> {
    pub blocks: Vec<Block<B>>,
}

/// Which blocks a forward pass runs: all, or all but one (a different order of weight uses).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Path {
    All,
    Skip(usize),
}

impl<B: Backend> Net<B> {
    pub fn forward(&self, x: Tensor<B, 2>, path: Path) -> Tensor<B, 2> {
        self.active(path).fold(x, |x, block| block.forward(x))
    }

    pub fn active(&self, path: Path) -> impl Iterator<Item = &Block<B>> {
        self.blocks
            .iter()
            .enumerate()
            .filter(move |(i, _)| path != Path::Skip(*i))
            .map(|(_, b)| b)
    }

    /// The trainable parameters, in a fixed order.
    pub fn adapters(&self) -> Vec<&Param<Tensor<B, 2>>> {
        self.blocks
            .iter()
            .flat_map(|b| [&b.fc1.a, &b.fc1.b, &b.fc2.a, &b.fc2.b])
            .collect()
    }

    /// The frozen matrices, in a fixed order.
    pub fn frozen(&self) -> Vec<&Param<Tensor<B, 2>>> {
        self.blocks
            .iter()
            .flat_map(|b| [&b.proj.weight, &b.fc1.base.weight, &b.fc2.base.weight])
            .collect()
    }
}

pub const DIM: usize = 16;
pub const HIDDEN: usize = 40;
pub const RANK: usize = 4;
pub const TOKENS: usize = 12;
pub const BLOCKS: usize = 3;

/// Deterministic values in about [-scale, scale].
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

pub fn data(seed: u64, shape: [usize; 2], scale: f32, dtype: DType) -> TensorData {
    TensorData::new(values(seed, shape[0] * shape[1], scale), shape).convert_dtype(dtype)
}

fn param<B: Backend, const D: usize>(data: TensorData, device: &B::Device) -> Param<Tensor<B, D>> {
    Param::from_tensor(Tensor::from_data(data, device))
}

fn linear<B: Backend>(
    seed: u64,
    d_in: usize,
    d_out: usize,
    dtype: DType,
    device: &B::Device,
) -> Linear<B> {
    let scale = 1.0 / (d_in as f32).sqrt();
    let weight = param(data(seed, [d_in, d_out], scale, dtype), device);
    let bias = TensorData::new(values(seed + 1, d_out, 0.1), [d_out]).convert_dtype(dtype);
    Linear {
        weight,
        bias: Some(param(bias, device)),
    }
    .no_grad()
}

fn lora<B: Backend>(
    seed: u64,
    d_in: usize,
    d_out: usize,
    dtype: DType,
    device: &B::Device,
) -> LoraLinear<B> {
    LoraLinear {
        base: linear(seed, d_in, d_out, dtype, device),
        a: param(data(seed + 2, [d_in, RANK], 0.3, dtype), device),
        b: param(data(seed + 3, [RANK, d_out], 0.3, dtype), device),
    }
}

/// The network with deterministic weights (frozen bases, trainable adapters).
pub fn net<B: Backend>(dtype: DType, device: &B::Device) -> Net<B> {
    Net {
        blocks: (0..BLOCKS as u64)
            .map(|i| Block {
                proj: linear(100 * i + 10, DIM, DIM, dtype, device),
                fc1: lora(100 * i + 20, DIM, HIDDEN, dtype, device),
                fc2: lora(100 * i + 30, HIDDEN, DIM, dtype, device),
            })
            .collect(),
    }
}

/// How backward gets the activations it needs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Recompute {
    /// Autodiff keeps every activation of the forward pass.
    Off,
    /// Block-level gradient checkpointing: the forward pass runs without a graph and keeps
    /// only block inputs; backward re-runs each block (a second forward use of every weight)
    /// before its backward.
    Blocks,
}

/// Bit patterns, for exact comparison.
pub fn bits(data: TensorData) -> Vec<u32> {
    data.convert_dtype(DType::F32)
        .to_vec::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// What one training step produced.
#[derive(Debug, PartialEq)]
pub struct StepRecord {
    pub output: Vec<u32>,
    pub loss: Vec<u32>,
    pub grads: Vec<Option<Vec<u32>>>,
    pub adapters: Vec<Vec<u32>>,
}

fn loss<B: Backend>(out: Tensor<B, 2>, target: Tensor<B, 2>) -> Tensor<B, 1> {
    let diff = out - target;
    (diff.clone() * diff).mean()
}

/// Gradients of the adapters for one step, and the network's output and loss.
fn gradients<A: AutodiffBackend>(
    net: &Net<A>,
    x: Tensor<A, 2>,
    target: Tensor<A, 2>,
    path: Path,
    recompute: Recompute,
) -> (Tensor<A, 2>, Tensor<A, 1>, GradientsParams) {
    match recompute {
        Recompute::Off => {
            let out = net.forward(x, path);
            let loss = loss(out.clone(), target);
            let grads = loss.backward();
            (out, loss, GradientsParams::from_grads(grads, net))
        }
        Recompute::Blocks => {
            let blocks: Vec<&Block<A>> = net.active(path).collect();
            let mut inputs = vec![x.inner()];
            for block in &blocks {
                let next = block.valid().forward(inputs.last().unwrap().clone());
                inputs.push(next);
            }
            let out = Tensor::<A, 2>::from_inner(inputs.pop().unwrap()).require_grad();
            let loss = loss(out.clone(), target);
            let mut grad = out.grad(&loss.backward()).unwrap();
            let mut params = GradientsParams::new();
            for (block, input) in blocks.iter().zip(inputs).rev() {
                let input = Tensor::<A, 2>::from_inner(input).require_grad();
                let y = block.forward(input.clone());
                let mut grads = (y * Tensor::from_inner(grad)).sum().backward();
                grad = input.grad(&grads).unwrap();
                let mut block_params = GradientsParams::from_module(&mut grads, *block);
                for p in [&block.fc1.a, &block.fc1.b, &block.fc2.a, &block.fc2.b] {
                    let g = block_params.remove::<A::InnerBackend, 2>(p.id).unwrap();
                    params.register(p.id, g);
                }
            }
            (out, loss, params)
        }
    }
}

/// Runs `steps` AdamW steps on fixed data, calling `around(true)` before and `around(false)`
/// after each step; `path(step)` picks the blocks each step runs.
pub fn train<A: AutodiffBackend>(
    mut net: Net<A>,
    dtype: DType,
    steps: usize,
    recompute: Recompute,
    path: impl Fn(usize) -> Path,
    mut around: impl FnMut(bool),
) -> (Net<A>, Vec<StepRecord>) {
    let device = net.blocks[0].fc1.a.val().device();
    let x = Tensor::<A, 2>::from_data(data(7, [TOKENS, DIM], 1.0, dtype), &device);
    let target = Tensor::<A, 2>::from_data(data(8, [TOKENS, DIM], 1.0, dtype), &device);
    let mut optim = AdamWConfig::new().init::<A, Net<A>>();
    let mut records = Vec::new();
    for step in 0..steps {
        around(true);
        let (out, loss, grads) = gradients(&net, x.clone(), target.clone(), path(step), recompute);
        around(false);
        let ids: Vec<ParamId> = net.adapters().iter().map(|p| p.id).collect();
        let grad_bits = ids
            .iter()
            .map(|id| {
                grads
                    .get::<A::InnerBackend, 2>(*id)
                    .map(|g| bits(g.into_data()))
            })
            .collect();
        net = optim.step(1e-2, net, grads);
        records.push(StepRecord {
            output: bits(out.into_data()),
            loss: bits(loss.into_data().convert_dtype(DType::F32)),
            grads: grad_bits,
            adapters: net
                .adapters()
                .iter()
                .map(|p| bits(p.val().into_data()))
                .collect(),
        });
    }
    (net, records)
}
