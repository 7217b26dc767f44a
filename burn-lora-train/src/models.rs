//! What every family's models share: the weight stream's configuration, the float dtype, and
//! creating lazily initialized parameters.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor};
use burn_offload::{OffloadConfig, WireFormat};
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
