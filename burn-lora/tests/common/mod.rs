//! The tiny model of the fixtures (`make_fixtures.py`), ported to Burn with adapted layers, and
//! helpers to read fixtures and compare outputs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{Linear, PaddingConfig2d};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor, TensorData, activation};
use burn_lora::{LoraConv2d, LoraLinear};
use safetensors::SafeTensors;

pub type B = Flex;

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Reads tensors of a safetensors file as f64 `TensorData`.
pub struct Fixture {
    bytes: Vec<u8>,
}

impl Fixture {
    pub fn open(name: &str) -> Self {
        Self::open_path(&fixture(name))
    }

    pub fn open_path(path: &Path) -> Self {
        Self {
            bytes: std::fs::read(path).unwrap(),
        }
    }

    pub fn get(&self, key: &str) -> TensorData {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let view = st
            .tensor(key)
            .unwrap_or_else(|_| panic!("fixture key {key}"));
        let dtype = match view.dtype() {
            safetensors::Dtype::F64 => DType::F64,
            safetensors::Dtype::F32 => DType::F32,
            safetensors::Dtype::BF16 => DType::BF16,
            other => panic!("{other:?}"),
        };
        TensorData::from_bytes_vec(view.data().to_vec(), view.shape().to_vec(), dtype)
    }

    pub fn keys(&self) -> Vec<String> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let mut keys: Vec<String> = st.names().into_iter().map(String::from).collect();
        keys.sort();
        keys
    }

    pub fn tensor<const D: usize>(&self, key: &str) -> Tensor<B, D> {
        let data = self.get(key).convert_dtype(DType::F32);
        Tensor::from_data(data, &Default::default())
    }
}

#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    pub fc1: LoraLinear<B>,
    pub fc2: LoraLinear<B>,
}

/// conv 3→6 (3×3, padding 1) → channels last → 2 residual MLP blocks → head 6→5.
#[derive(Module, Debug)]
pub struct Tiny<B: Backend> {
    pub conv: LoraConv2d<B>,
    pub blocks: Vec<Block<B>>,
    pub head: LoraLinear<B>,
}

impl<B: burn_kernels::Kernels> Tiny<B> {
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let mut h = self.conv.forward(x).permute([0, 2, 3, 1]);
        for block in &self.blocks {
            h = h.clone() + block.fc2.forward(activation::tanh(block.fc1.forward(h)));
        }
        self.head.forward(h)
    }
}

fn linear(reference: &Fixture, name: &str) -> LoraLinear<B> {
    let weight: Tensor<B, 2> = reference.tensor(&format!("base.{name}.weight"));
    Linear {
        weight: Param::from_tensor(weight.transpose()),
        bias: Some(Param::from_tensor(
            reference.tensor(&format!("base.{name}.bias")),
        )),
    }
    .into()
}

/// The fixture's tiny model with its base weights (PyTorch layout converted to Burn's).
pub fn tiny_model() -> Tiny<B> {
    let reference = Fixture::open("tiny_reference.safetensors");
    let device = Default::default();
    let conv: Conv2d<B> = Conv2dConfig::new([3, 6], [3, 3])
        .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
        .init(&device);
    let conv = Conv2d {
        weight: Param::from_tensor(reference.tensor("base.conv.weight")),
        bias: Some(Param::from_tensor(reference.tensor("base.conv.bias"))),
        ..conv
    };
    Tiny {
        conv: conv.into(),
        blocks: (0..2)
            .map(|i| Block {
                fc1: linear(&reference, &format!("blocks.{i}.fc1")),
                fc2: linear(&reference, &format!("blocks.{i}.fc2")),
            })
            .collect(),
        head: linear(&reference, "head"),
    }
}

pub fn reference_input() -> Tensor<B, 4> {
    Fixture::open("tiny_reference.safetensors").tensor("x")
}

pub fn reference_output(name: &str) -> TensorData {
    Fixture::open("tiny_reference.safetensors").get(name)
}

/// Largest absolute difference over the largest absolute reference value.
pub fn rel_err(actual: &TensorData, expected: &TensorData) -> f64 {
    assert_eq!(actual.shape, expected.shape);
    let a: Vec<f64> = actual.clone().convert_dtype(DType::F64).into_vec().unwrap();
    let e: Vec<f64> = expected
        .clone()
        .convert_dtype(DType::F64)
        .into_vec()
        .unwrap();
    let scale = e.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&e)
        .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// Every float parameter of a module with its path, as visited by Burn.
pub struct Params<'a, B: AutodiffBackend> {
    path: Vec<String>,
    grads: Option<&'a B::Gradients>,
    /// Parameter values by path.
    pub found: Vec<(String, TensorData)>,
    /// Whether each parameter has a gradient (when gradients were given).
    pub with_grad: Vec<(String, bool)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Params<'_, B> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let path = self.path.join(".");
        if let Some(grads) = self.grads {
            self.with_grad
                .push((path.clone(), param.grad(grads).is_some()));
        }
        self.found.push((path, param.to_data()));
    }
}

impl<'a, B: AutodiffBackend> Params<'a, B> {
    pub fn collect<M: Module<B>>(module: &M, grads: Option<&'a B::Gradients>) -> Self {
        let mut visitor = Params {
            path: Vec::new(),
            grads,
            found: Vec::new(),
            with_grad: Vec::new(),
        };
        module.visit(&mut visitor);
        visitor
    }
}

/// Paths and container types of every float parameter, on any backend.
#[derive(Default)]
pub struct Paths {
    path: Vec<(String, String)>,
    pub found: Vec<(String, String)>,
}

impl<B: Backend> ModuleVisitor<B> for Paths {
    fn enter_module(&mut self, name: &str, container: &str) {
        self.path.push((name.to_string(), container.to_string()));
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<B, D>>) {
        let path: Vec<&str> = self.path.iter().map(|(n, _)| n.as_str()).collect();
        let container = self.path.last().map(|(_, c)| c.clone()).unwrap_or_default();
        self.found.push((path.join("."), container));
    }
}

pub fn param_paths<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, String)> {
    let mut paths = Paths::default();
    module.visit(&mut paths);
    paths.found
}
