//! `FloatTensorOps`: forwarded to the inner backend. A streamed weight is materialized by any
//! of these ops, except those that only look at it: its device, its values (read from host
//! memory), detaching and gradient flags, and a move to its own device.

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{
    BoolTensor, Device, FloatTensor, FloatTensorOps, GridSampleOptions, IntTensor,
};
use burn::tensor::{
    BoolDType, Distribution, FloatDType, IndexingUpdateOp, IntDType, Scalar, Shape, Slice,
    TensorData,
};

use super::{forward, keep, lift, lift_first, lower, lower_vec};
use crate::backend::{Offload, PrefetchPolicy};
use crate::target::StreamTarget;
use burn_kernels::{KernelOptions, products};

impl<B: StreamTarget, P: PrefetchPolicy> FloatTensorOps<Self> for Offload<B, P> {
    fn float_into_data(
        tensor: FloatTensor<Self>,
    ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send {
        tensor.into_data()
    }

    fn float_matmul(lhs: FloatTensor<Self>, rhs: FloatTensor<Self>) -> FloatTensor<Self> {
        lift(products::matmul::<B>(
            lower(lhs),
            lower(rhs),
            &KernelOptions::current(),
        ))
    }

    fn float_device(tensor: &FloatTensor<Self>) -> Device<Self> {
        tensor.device()
    }

    fn float_to_device(tensor: FloatTensor<Self>, device: &Device<Self>) -> FloatTensor<Self> {
        if tensor.is_streamed() && tensor.device() == *device {
            return tensor;
        }
        lift(B::float_to_device(lower(tensor), device))
    }

    fn float_detach(tensor: FloatTensor<Self>) -> FloatTensor<Self> {
        if tensor.is_streamed() {
            return tensor;
        }
        lift(B::float_detach(lower(tensor)))
    }

    fn float_set_require_grad(tensor: FloatTensor<Self>, require_grad: bool) -> FloatTensor<Self> {
        if tensor.is_streamed() {
            return tensor;
        }
        lift(B::float_set_require_grad(lower(tensor), require_grad))
    }

    fn float_is_require_grad(tensor: &FloatTensor<Self>) -> bool {
        tensor.as_inner().is_some_and(B::float_is_require_grad)
    }

    fn float_from_data(data: TensorData, device: &Device<Self>) -> FloatTensor<Self> {
        lift(B::upload_data(data, device))
    }

    forward! {
        lift fn float_random(
            keep shape: Shape,
            keep distribution: Distribution,
            keep device: &Device<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        lift fn float_zeros(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        lift fn float_ones(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        lift fn float_full(
            keep shape: Shape,
            keep fill_value: Scalar,
            keep device: &Device<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        keep fn float_into_int(
            lower tensor: FloatTensor<Self>,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        lift fn float_empty(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        lift fn float_repeat_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep times: usize,
        ) -> FloatTensor<Self>;
        lift fn float_add(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_add_scalar(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_clamp_min(
            lower tensor: FloatTensor<Self>,
            keep min: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_clamp_max(
            lower tensor: FloatTensor<Self>,
            keep max: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_clamp(
            lower tensor: FloatTensor<Self>,
            keep min: Scalar,
            keep max: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_sub(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_sub_scalar(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_mul(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_mul_scalar(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_div(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_div_scalar(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_remainder(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_remainder_scalar(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_cross(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift fn float_neg(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_recip(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_transpose(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_swap_dims(
            lower tensor: FloatTensor<Self>,
            keep dim1: usize,
            keep dim2: usize,
        ) -> FloatTensor<Self>;
        lift fn float_permute(
            lower tensor: FloatTensor<Self>,
            keep axes: &[usize],
        ) -> FloatTensor<Self>;
        lift fn float_flip(
            lower tensor: FloatTensor<Self>,
            keep axes: &[usize],
        ) -> FloatTensor<Self>;
        lift fn float_reshape(
            lower tensor: FloatTensor<Self>,
            keep shape: Shape,
        ) -> FloatTensor<Self>;
        lift fn float_gather(
            keep dim: usize,
            lower tensor: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_scatter_add(
            keep dim: usize,
            lower tensor: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
            lower value: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_scatter_nd(
            lower data: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
            lower values: FloatTensor<Self>,
            keep reduction: IndexingUpdateOp,
        ) -> FloatTensor<Self>;
        lift fn float_gather_nd(
            lower data: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_select(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_select_add(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
            lower value: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_slice(
            lower tensor: FloatTensor<Self>,
            keep slices: &[Slice],
        ) -> FloatTensor<Self>;
        lift fn float_slice_assign(
            lower tensor: FloatTensor<Self>,
            keep slices: &[Slice],
            lower value: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_mask_where(
            lower tensor: FloatTensor<Self>,
            keep mask: BoolTensor<Self>,
            lower value: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_mask_fill(
            lower tensor: FloatTensor<Self>,
            keep mask: BoolTensor<Self>,
            keep value: Scalar,
        ) -> FloatTensor<Self>;
        keep fn float_equal(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_not_equal(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_equal_elem(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_not_equal_elem(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_greater(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_greater_elem(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_greater_equal(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_greater_equal_elem(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_lower(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_lower_elem(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_lower_equal(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_lower_equal_elem(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        lift fn float_sum(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_sum_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift fn float_prod(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_prod_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift fn float_mean(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_mean_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift fn float_cumsum(lower tensor: FloatTensor<Self>, keep dim: usize) -> FloatTensor<Self>;
        lift fn float_cumprod(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift fn float_cummin(lower tensor: FloatTensor<Self>, keep dim: usize) -> FloatTensor<Self>;
        lift fn float_cummax(lower tensor: FloatTensor<Self>, keep dim: usize) -> FloatTensor<Self>;
        lift fn float_cast(
            lower tensor: FloatTensor<Self>,
            keep dtype: FloatDType,
        ) -> FloatTensor<Self>;
        lift fn float_exp(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_log(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_log1p(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_powf(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_powi(
            lower lhs: FloatTensor<Self>,
            keep rhs: IntTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_powi_scalar(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_powi_scalar_impl(
            lower lhs: FloatTensor<Self>,
            keep rhs: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_powf_scalar(
            lower tensor: FloatTensor<Self>,
            keep value: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_powf_scalar_impl(
            lower tensor: FloatTensor<Self>,
            keep value: Scalar,
        ) -> FloatTensor<Self>;
        lift fn float_sqrt(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_abs(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_cos(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_sin(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_tan(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_cosh(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_sinh(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_tanh(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_acos(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_acosh(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_asin(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_asinh(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_atan(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_atanh(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_atan2(
            lower lhs: FloatTensor<Self>,
            lower rhs: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn float_round(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_floor(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_ceil(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_trunc(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_erf(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_cat(
            lower_vec tensors: Vec<FloatTensor<Self>>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        keep fn float_argmax(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        keep fn float_argtopk(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep k: usize,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        lift fn float_topk(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep k: usize,
        ) -> FloatTensor<Self>;
        keep fn float_argmin(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        lift fn float_max(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_max_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift_first fn float_max_dim_with_indices(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep indices_dtype: IntDType,
        ) -> (FloatTensor<Self>, IntTensor<Self>);
        lift fn float_min(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_min_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        lift_first fn float_min_dim_with_indices(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep indices_dtype: IntDType,
        ) -> (FloatTensor<Self>, IntTensor<Self>);
        lift fn float_max_abs(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_max_abs_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
        ) -> FloatTensor<Self>;
        keep fn float_any(
            lower tensor: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_any_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_all(
            lower tensor: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_all_dim(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        lift fn float_sign(lower tensor: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn float_expand(
            lower tensor: FloatTensor<Self>,
            keep shape: Shape,
        ) -> FloatTensor<Self>;
        lift fn float_sort(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep descending: bool,
        ) -> FloatTensor<Self>;
        lift_first fn float_sort_with_indices(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep descending: bool,
            keep indices_dtype: IntDType,
        ) -> (FloatTensor<Self>, IntTensor<Self>);
        keep fn float_argsort(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep descending: bool,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        lift fn float_grid_sample_2d(
            lower tensor: FloatTensor<Self>,
            lower grid: FloatTensor<Self>,
            keep options: GridSampleOptions,
        ) -> FloatTensor<Self>;
        lift fn float_unfold(
            lower tensor: FloatTensor<Self>,
            keep dim: usize,
            keep size: usize,
            keep step: usize,
        ) -> FloatTensor<Self>;
        keep fn float_is_nan(
            lower tensor: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn float_is_inf(
            lower tensor: FloatTensor<Self>,
            keep out_dtype: BoolDType,
        ) -> BoolTensor<Self>;
    }
}
