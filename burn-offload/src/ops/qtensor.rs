//! `QTensorOps`: forwarded to the inner backend (quantized tensors never stream; FP8 payloads
//! of streamed weights are decoded by the engine, not by these ops).

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{BoolTensor, Device, FloatTensor, IntTensor, QTensorOps, QuantizedTensor};
use burn::tensor::quantization::{QuantScheme, QuantizationParametersPrimitive};
use burn::tensor::{
    BoolDType, FloatDType, IntDType, Scalar, Shape, Slice, TensorData, TensorPrimitive,
};

use super::{forward, keep, lift, lift_prim, lower, lower_prim, lower_qparams};
use crate::backend::{Offload, PrefetchPolicy};
use crate::target::StreamTarget;

impl<B: StreamTarget, P: PrefetchPolicy> QTensorOps<Self> for Offload<B, P> {
    forward! {
        keep fn q_from_data(
            keep data: TensorData,
            keep device: &Device<Self>,
        ) -> QuantizedTensor<Self>;
        keep fn quantize(
            lower tensor: FloatTensor<Self>,
            keep scheme: &QuantScheme,
            lower_qparams qparams: QuantizationParametersPrimitive<Self>,
        ) -> QuantizedTensor<Self>;
        keep fn quantize_dynamic(
            lower tensor: FloatTensor<Self>,
            keep scheme: &QuantScheme,
        ) -> QuantizedTensor<Self>;
        lift fn dequantize(
            keep tensor: QuantizedTensor<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        keep fn q_device(keep tensor: &QuantizedTensor<Self>) -> Device<Self>;
        keep fn q_to_device(
            keep tensor: QuantizedTensor<Self>,
            keep device: &Device<Self>,
        ) -> QuantizedTensor<Self>;
        keep fn q_reshape(
            keep tensor: QuantizedTensor<Self>,
            keep shape: Shape,
        ) -> QuantizedTensor<Self>;
        keep fn q_into_data(
            keep tensor: QuantizedTensor<Self>,
        ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send;
        keep fn q_detach(keep tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        keep fn q_set_require_grad(
            keep tensor: QuantizedTensor<Self>,
            keep require_grad: bool,
        ) -> QuantizedTensor<Self>;
        keep fn q_is_require_grad(keep tensor: &QuantizedTensor<Self>) -> bool;
        keep fn q_expand(
            keep tensor: QuantizedTensor<Self>,
            keep shape: Shape,
        ) -> QuantizedTensor<Self>;
        keep fn q_transpose(keep tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        keep fn q_swap_dims(
            keep tensor: QuantizedTensor<Self>,
            keep dim1: usize,
            keep dim2: usize,
        ) -> QuantizedTensor<Self>;
        keep fn q_permute(
            keep tensor: QuantizedTensor<Self>,
            keep axes: &[usize],
        ) -> QuantizedTensor<Self>;
        keep fn q_flip(
            keep tensor: QuantizedTensor<Self>,
            keep axes: &[usize],
        ) -> QuantizedTensor<Self>;
        keep fn q_select(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
        ) -> QuantizedTensor<Self>;
        keep fn q_slice(
            keep tensor: QuantizedTensor<Self>,
            keep slices: &[Slice],
        ) -> QuantizedTensor<Self>;
        keep fn q_gather(
            keep dim: usize,
            keep tensor: QuantizedTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> QuantizedTensor<Self>;
        keep fn q_repeat_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep times: usize,
        ) -> QuantizedTensor<Self>;
        lift_prim fn q_add(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: QuantizedTensor<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_add_scalar(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_clamp_min(
            keep tensor: QuantizedTensor<Self>,
            keep min: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_clamp_max(
            keep tensor: QuantizedTensor<Self>,
            keep max: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_clamp(
            keep tensor: QuantizedTensor<Self>,
            keep min: Scalar,
            keep max: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_sub(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: QuantizedTensor<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_sub_scalar(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_mul(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: QuantizedTensor<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_mul_scalar(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_div(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: QuantizedTensor<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_div_scalar(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_matmul(
            lower_prim lhs: TensorPrimitive<Self>,
            lower_prim rhs: TensorPrimitive<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_neg(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_recip(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_sum(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_sum_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_prod(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_prod_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_mean(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_mean_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_cumsum(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_cumprod(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_cummin(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_cummax(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_exp(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_log(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_log1p(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_powf(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: QuantizedTensor<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_powi(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_powi_scalar(
            keep lhs: QuantizedTensor<Self>,
            keep rhs: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_powf_scalar(
            keep tensor: QuantizedTensor<Self>,
            keep value: Scalar,
        ) -> TensorPrimitive<Self>;
        lift_prim fn q_sqrt(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        keep fn q_abs(keep tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        lift_prim fn q_cos(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_sin(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_tan(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_cosh(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_sinh(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_tanh(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        lift_prim fn q_erf(keep tensor: QuantizedTensor<Self>) -> TensorPrimitive<Self>;
        keep fn q_cat(
            keep tensors: Vec<QuantizedTensor<Self>>,
            keep dim: usize,
        ) -> QuantizedTensor<Self>;
        keep fn q_argmax(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn q_argtopk(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep k: usize,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn q_topk(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep k: usize,
        ) -> QuantizedTensor<Self>;
        keep fn q_argmin(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn q_max(keep tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        keep fn q_max_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> QuantizedTensor<Self>;
        keep fn q_max_dim_with_indices(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep out_dtype: IntDType,
        ) -> (QuantizedTensor<Self>, IntTensor<Self>);
        keep fn q_min(keep tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        keep fn q_min_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> QuantizedTensor<Self>;
        keep fn q_min_dim_with_indices(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep out_dtype: IntDType,
        ) -> (QuantizedTensor<Self>, IntTensor<Self>);
        keep fn q_max_abs(keep tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self>;
        keep fn q_max_abs_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
        ) -> QuantizedTensor<Self>;
        keep fn q_any(
            keep tensor: QuantizedTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn q_any_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn q_all(
            keep tensor: QuantizedTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn q_all_dim(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn q_sort(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep descending: bool,
        ) -> QuantizedTensor<Self>;
        keep fn q_sort_with_indices(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep descending: bool,
            keep out_dtype: IntDType,
        ) -> (QuantizedTensor<Self>, IntTensor<Self>);
        keep fn q_argsort(
            keep tensor: QuantizedTensor<Self>,
            keep dim: usize,
            keep descending: bool,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
    }
}
