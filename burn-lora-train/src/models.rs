//! What every family's models share: the weight stream's configuration, the float dtype,
//! creating lazily initialized parameters, and random models built on the CPU.

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_diffusion::{PlaceWeight, materialize};
use burn_offload::{OffloadConfig, WireFormat};
use burn_quant::Fp8Format;
use half::bf16;
use rayon::prelude::*;

use crate::config::TrainPlan;

/// The weight stream's configuration, or `None` when every weight stays on the device.
pub(crate) fn offload_config(plan: &TrainPlan) -> Option<OffloadConfig> {
    let model = &plan.model;
    if model.vram_budget_bytes.is_none() && model.wire.is_none() {
        return None;
    }
    let wire = match model.wire {
        None => WireFormat::Native,
        Some(Fp8Format::E5M2) => WireFormat::E5M2,
        Some(Fp8Format::E4M3) => WireFormat::E4M3,
    };
    Some(
        OffloadConfig::default()
            .with_vram_budget(model.vram_budget_bytes.unwrap_or(u64::MAX))
            .with_ring_slots(model.ring_slots)
            .with_wire(wire),
    )
}

/// The base model's float dtype.
pub(crate) fn float_dtype(plan: &TrainPlan) -> FloatDType {
    match plan.model.dtype {
        DType::BF16 => FloatDType::BF16,
        DType::F16 => FloatDType::F16,
        _ => FloatDType::F32,
    }
}

/// Creates every lazily initialized parameter of `module` now.
pub(crate) fn initialize<B: Backend, M: Module<B>>(module: &M) {
    struct Touch;
    impl<B: Backend> ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}

/// `target` with the parameter values `build` gives on the CPU from `seed`, in `dtype`: a model
/// whose random values must not depend on the backend (each backend's generator draws its own
/// numbers for the same seed) is built with `Flex`'s and copied over. `build` makes a module of
/// the same structure as `target`; the parameters keep `target`'s ids and gradient flags.
pub(crate) fn built_on_host<B: Backend, M: Module<B>, H: Module<Flex>>(
    seed: u64,
    dtype: FloatDType,
    build: impl FnOnce(&FlexDevice) -> H,
    target: M,
) -> M {
    Flex::seed(&FlexDevice, seed);
    let host = materialize(build(&FlexDevice), dtype);
    struct Collect(Vec<TensorData>);
    impl ModuleVisitor<Flex> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Flex, D>>) {
            self.0.push(param.val().into_data());
        }
    }
    struct Replace<B: Backend>(std::vec::IntoIter<TensorData>, B::Device);
    impl<B: Backend> ModuleMapper<B> for Replace<B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let data = self
                .0
                .next()
                .expect("the host module has the same parameters");
            param.map(|tensor| {
                assert_eq!(
                    tensor.dims().to_vec(),
                    data.shape.to_vec(),
                    "the host module's shapes"
                );
                Tensor::from_data(data, &self.1).set_require_grad(tensor.is_require_grad())
            })
        }
    }
    let mut values = Collect(Vec::new());
    host.visit(&mut values);
    drop(host);
    let device = target
        .devices()
        .into_iter()
        .next()
        .expect("a module on a device");
    let mut replace = Replace::<B>(values.0.into_iter(), device);
    let target = target.map(&mut replace);
    assert!(
        replace.0.next().is_none(),
        "the target module has the same parameters"
    );
    target
}

/// `module` (lazily initialized) with every parameter created now in `dtype`: each `Linear`
/// weight from random values made on the host and handed to `place` (into host memory for
/// streaming, never through the device), uniform in `±1/√d_input` as Burn's default `Linear`
/// initialization, drawn from `seed` and the parameter's position; every other parameter on
/// the device. This is how a `random:` model larger than the device is built.
pub(crate) fn random_matrices_placed<B: Backend, M: Module<B>>(
    module: M,
    dtype: FloatDType,
    seed: u64,
    place: &mut PlaceWeight<'_, B>,
) -> Result<M, Box<dyn std::error::Error + Send + Sync>> {
    struct Random<'p, 'q, B: Backend> {
        dtype: FloatDType,
        seed: u64,
        index: u64,
        path: Vec<(String, String)>,
        place: &'p mut PlaceWeight<'q, B>,
        error: Option<Box<dyn std::error::Error + Send + Sync>>,
    }
    impl<B: Backend> ModuleMapper<B> for Random<'_, '_, B> {
        fn enter_module(&mut self, name: &str, container: &str) {
            self.path.push((name.to_string(), container.to_string()));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let shape = param.lazy_shape().as_slice().to_vec();
            self.index += 1;
            let linear_weight = matches!(
                self.path.as_slice(),
                [.., (field, container)] if container == "Struct:Linear" && field == "weight"
            );
            if !linear_weight || self.error.is_some() {
                let dtype = self.dtype;
                return param.map(|tensor| tensor.cast(dtype));
            }
            let data = uniform_matrix(
                &shape,
                self.dtype,
                self.seed ^ self.index.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            let name: Vec<&str> = self.path.iter().map(|(n, _)| n.as_str()).collect();
            match (self.place)(&name.join("."), data) {
                Ok(matrix) => {
                    let id = param.id;
                    param.transform_for_load(Tensor::from_primitive(matrix.into_primitive()), id)
                }
                Err(error) => {
                    self.error = Some(error);
                    param
                }
            }
        }
    }
    let mut random = Random {
        dtype,
        seed,
        index: 0,
        path: Vec::new(),
        place,
        error: None,
    };
    let module = module.map(&mut random);
    match random.error {
        Some(error) => Err(error),
        None => Ok(module),
    }
}

/// A `[d_input, d_output]` matrix uniform in `±1/√d_input`, in `dtype` (bf16 or f32), from
/// `seed`: rows of 4096 values each from their own SplitMix64 stream, in parallel.
fn uniform_matrix(shape: &[usize], dtype: FloatDType, seed: u64) -> TensorData {
    const CHUNK: usize = 4096;
    let numel: usize = shape.iter().product();
    let bound = (shape[0] as f32).sqrt().recip();
    let fill = |chunk: usize, out: &mut dyn FnMut(usize, f32)| {
        let mut state = seed ^ (chunk as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        for i in 0..CHUNK.min(numel - chunk * CHUNK) {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let unit = (z >> 40) as f32 / (1u64 << 24) as f32;
            out(i, (2.0 * unit - 1.0) * bound);
        }
    };
    match dtype {
        FloatDType::BF16 => {
            let mut values = vec![bf16::ZERO; numel];
            values
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, out)| fill(c, &mut |i, v| out[i] = bf16::from_f32(v)));
            TensorData::new(values, shape.to_vec())
        }
        _ => {
            let mut values = vec![0f32; numel];
            values
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, out)| fill(c, &mut |i, v| out[i] = v));
            TensorData::new(values, shape.to_vec())
        }
    }
}
