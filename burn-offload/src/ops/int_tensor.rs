//! `IntTensorOps`: forwarded to the inner backend (integer tensors never stream).

use std::ops::Range;

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{BoolTensor, Device, FloatTensor, IntTensor, IntTensorOps};
use burn::tensor::{
    BoolDType, Distribution, FloatDType, IndexingUpdateOp, IntDType, Scalar, Shape, Slice,
    TensorData,
};

use super::{forward, keep, lift};
use crate::backend::{Offload, PrefetchPolicy};
use crate::target::StreamTarget;

impl<B: StreamTarget, P: PrefetchPolicy> IntTensorOps<Self> for Offload<B, P> {
    forward! {
        keep fn int_empty(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_into_data(
            keep tensor: IntTensor<Self>,
        ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send;
        keep fn int_from_data(keep data: TensorData, keep device: &Device<Self>) -> IntTensor<Self>;
        keep fn int_device(keep tensor: &IntTensor<Self>) -> Device<Self>;
        keep fn int_to_device(
            keep tensor: IntTensor<Self>,
            keep device: &Device<Self>,
        ) -> IntTensor<Self>;
        keep fn int_reshape(keep tensor: IntTensor<Self>, keep shape: Shape) -> IntTensor<Self>;
        keep fn int_slice(keep tensor: IntTensor<Self>, keep slices: &[Slice]) -> IntTensor<Self>;
        keep fn int_slice_assign(
            keep tensor: IntTensor<Self>,
            keep slices: &[Slice],
            keep value: IntTensor<Self>,
        ) -> IntTensor<Self>;
        lift fn int_into_float(
            keep tensor: IntTensor<Self>,
            keep out_dtype: FloatDType,
        ) -> FloatTensor<Self>;
        keep fn int_mask_where(
            keep tensor: IntTensor<Self>,
            keep mask: BoolTensor<Self>,
            keep value: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_mask_fill(
            keep tensor: IntTensor<Self>,
            keep mask: BoolTensor<Self>,
            keep value: Scalar,
        ) -> IntTensor<Self>;
        keep fn int_gather(
            keep dim: usize,
            keep tensor: IntTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_scatter_add(
            keep dim: usize,
            keep tensor: IntTensor<Self>,
            keep indices: IntTensor<Self>,
            keep value: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_scatter_nd(
            keep data: IntTensor<Self>,
            keep indices: IntTensor<Self>,
            keep values: IntTensor<Self>,
            keep reduction: IndexingUpdateOp,
        ) -> IntTensor<Self>;
        keep fn int_gather_nd(
            keep data: IntTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_select(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_select_add(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
            keep value: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_repeat_dim(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep times: usize,
        ) -> IntTensor<Self>;
        keep fn int_cat(keep tensors: Vec<IntTensor<Self>>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_equal(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_not_equal(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_equal_elem(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_not_equal_elem(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_greater(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_greater_elem(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_greater_equal(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_greater_equal_elem(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_lower(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_lower_elem(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_lower_equal(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_lower_equal_elem(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_add(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_add_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn int_powi(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_powi_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn int_powi_scalar_impl(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
        ) -> IntTensor<Self>;
        keep fn int_clamp_min(keep tensor: IntTensor<Self>, keep min: Scalar) -> IntTensor<Self>;
        keep fn int_clamp_max(keep tensor: IntTensor<Self>, keep max: Scalar) -> IntTensor<Self>;
        keep fn int_clamp(
            keep tensor: IntTensor<Self>,
            keep min: Scalar,
            keep max: Scalar,
        ) -> IntTensor<Self>;
        keep fn int_sub(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_sub_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn int_mul(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_mul_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn int_div(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_div_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn int_remainder(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn int_remainder_scalar(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
        ) -> IntTensor<Self>;
        keep fn int_matmul(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_neg(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_zeros(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_ones(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_full(
            keep shape: Shape,
            keep fill_value: Scalar,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_sum(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_sum_dim(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_prod(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_prod_dim(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_mean(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_mean_dim(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_cumsum(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_cumprod(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_cummin(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_cummax(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_argmax(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_argtopk(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep k: usize,
        ) -> IntTensor<Self>;
        keep fn int_topk(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep k: usize,
        ) -> IntTensor<Self>;
        keep fn int_argmin(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_max(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_max_dim(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_max_dim_with_indices(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
        ) -> (IntTensor<Self>, IntTensor<Self>);
        keep fn int_max_abs(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_max_abs_dim(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_min(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_min_dim(keep tensor: IntTensor<Self>, keep dim: usize) -> IntTensor<Self>;
        keep fn int_min_dim_with_indices(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
        ) -> (IntTensor<Self>, IntTensor<Self>);
        keep fn int_abs(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_transpose(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_swap_dims(
            keep tensor: IntTensor<Self>,
            keep dim1: usize,
            keep dim2: usize,
        ) -> IntTensor<Self>;
        keep fn int_permute(keep tensor: IntTensor<Self>, keep axes: &[usize]) -> IntTensor<Self>;
        keep fn int_flip(keep tensor: IntTensor<Self>, keep axes: &[usize]) -> IntTensor<Self>;
        keep fn int_random(
            keep shape: Shape,
            keep distribution: Distribution,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_arange_step(
            keep range: Range<i64>,
            keep step: usize,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_arange(
            keep range: Range<i64>,
            keep device: &Device<Self>,
            keep dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn int_any(
            keep tensor: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_any_dim(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_all(
            keep tensor: IntTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_all_dim(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn int_sign(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn int_expand(keep tensor: IntTensor<Self>, keep shape: Shape) -> IntTensor<Self>;
        keep fn int_sort(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep descending: bool,
        ) -> IntTensor<Self>;
        keep fn int_sort_with_indices(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep descending: bool,
        ) -> (IntTensor<Self>, IntTensor<Self>);
        keep fn int_argsort(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep descending: bool,
        ) -> IntTensor<Self>;
        keep fn bitwise_and(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn bitwise_and_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn bitwise_or(keep lhs: IntTensor<Self>, keep rhs: IntTensor<Self>) -> IntTensor<Self>;
        keep fn bitwise_or_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn bitwise_xor(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn bitwise_xor_scalar(keep lhs: IntTensor<Self>, keep rhs: Scalar) -> IntTensor<Self>;
        keep fn bitwise_not(keep tensor: IntTensor<Self>) -> IntTensor<Self>;
        keep fn bitwise_left_shift(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn bitwise_left_shift_scalar(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
        ) -> IntTensor<Self>;
        keep fn bitwise_right_shift(
            keep lhs: IntTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> IntTensor<Self>;
        keep fn bitwise_right_shift_scalar(
            keep lhs: IntTensor<Self>,
            keep rhs: Scalar,
        ) -> IntTensor<Self>;
        keep fn int_cast(keep tensor: IntTensor<Self>, keep dtype: IntDType) -> IntTensor<Self>;
        keep fn int_unfold(
            keep tensor: IntTensor<Self>,
            keep dim: usize,
            keep size: usize,
            keep step: usize,
        ) -> IntTensor<Self>;
    }
}
