//! What every family's models share: the weight stream and its configuration, the float dtype,
//! creating lazily initialized parameters, and random models built on the CPU.

use std::sync::Arc;

use burn::backend::Flex;
use burn::backend::flex::FlexDevice;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use burn_diffusion::materialize;
use burn_offload::{
    MemoryProbe, OffloadBackend, OffloadConfig, OffloadError, WeightStream, WireFormat,
};
use burn_quant::Fp8Format;

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
            .with_decode_ahead(model.decode_ahead)
            .with_wire(wire),
    )
}

/// The weight stream of `plan` on `device`, or `None` when every weight stays on the device;
/// with a `probe`, it reads the device memory there instead of asking the backend.
///
/// Where the run's budget is measured ([`measured_budget`]), the stream starts with budget 0:
/// every frozen weight streams until a step has been measured and the weights are planned
/// within the budget beside what the step needed (burn-offload/DESIGN.md, "A budget for the
/// whole run").
pub(crate) fn weight_stream<B: OffloadBackend>(
    plan: &TrainPlan,
    device: &B::Device,
    probe: Option<Arc<dyn MemoryProbe>>,
) -> Result<Option<WeightStream<B>>, OffloadError> {
    let Some(config) = offload_config(plan) else {
        return Ok(None);
    };
    let mut stream = WeightStream::<B>::new(device, config)?;
    if let Some(probe) = probe {
        stream = stream.with_memory_probe(probe);
    }
    if measured_budget(plan, &stream).is_some() {
        stream.reconfigure(stream.config().with_vram_budget(0))?;
    }
    Ok(Some(stream))
}

/// The budget the weights are planned within once a step has been measured: `plan`'s, where it
/// bounds anything (given, and not 0) and `stream` can read the device's memory. `None`
/// otherwise: the plan made from the budget alone then stays, which on a device that reports
/// no memory (the CPU) bounds the resident weights and the ring only.
pub(crate) fn measured_budget<B: OffloadBackend>(
    plan: &TrainPlan,
    stream: &WeightStream<B>,
) -> Option<u64> {
    plan.model
        .vram_budget_bytes
        .filter(|&budget| budget > 0 && stream.memory_beyond_weights().is_some())
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
