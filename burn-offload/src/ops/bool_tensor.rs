//! `BoolTensorOps`: forwarded to the inner backend.

use burn::tensor::backend::ExecutionError;
use burn::tensor::ops::{BoolTensor, BoolTensorOps, Device, FloatTensor, IntTensor};
use burn::tensor::{BoolDType, FloatDType, IntDType, Scalar, Shape, Slice, TensorData};

use super::{forward, keep, lift};
use crate::backend::{Offload, PrefetchPolicy};
use crate::target::StreamTarget;

impl<B: StreamTarget, P: PrefetchPolicy> BoolTensorOps<Self> for Offload<B, P> {
    forward! {
        keep fn bool_empty(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn bool_zeros(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn bool_ones(
            keep shape: Shape,
            keep device: &Device<Self>,
            keep dtype: BoolDType,
        ) -> BoolTensor<Self>;
        keep fn bool_into_data(
            keep tensor: BoolTensor<Self>,
        ) -> impl Future<Output = Result<TensorData, ExecutionError>> + Send;
        keep fn bool_from_data(
            keep data: TensorData,
            keep device: &Device<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_into_int(
            keep tensor: BoolTensor<Self>,
            keep out_dtype: IntDType,
        ) -> IntTensor<Self>;
        lift fn bool_into_float(
            keep tensor: BoolTensor<Self>,
            keep out_dtype: FloatDType,
        ) -> FloatTensor<Self>;
        keep fn bool_device(keep tensor: &BoolTensor<Self>) -> Device<Self>;
        keep fn bool_to_device(
            keep tensor: BoolTensor<Self>,
            keep device: &Device<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_reshape(keep tensor: BoolTensor<Self>, keep shape: Shape) -> BoolTensor<Self>;
        keep fn bool_slice(
            keep tensor: BoolTensor<Self>,
            keep slices: &[Slice],
        ) -> BoolTensor<Self>;
        keep fn bool_slice_assign(
            keep tensor: BoolTensor<Self>,
            keep slices: &[Slice],
            keep value: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_mask_where(
            keep tensor: BoolTensor<Self>,
            keep mask: BoolTensor<Self>,
            keep value: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_mask_fill(
            keep tensor: BoolTensor<Self>,
            keep mask: BoolTensor<Self>,
            keep value: Scalar,
        ) -> BoolTensor<Self>;
        keep fn bool_gather(
            keep dim: usize,
            keep tensor: BoolTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_scatter_or(
            keep dim: usize,
            keep tensor: BoolTensor<Self>,
            keep indices: IntTensor<Self>,
            keep value: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_select(
            keep tensor: BoolTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_select_or(
            keep tensor: BoolTensor<Self>,
            keep dim: usize,
            keep indices: IntTensor<Self>,
            keep value: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_repeat_dim(
            keep tensor: BoolTensor<Self>,
            keep dim: usize,
            keep times: usize,
        ) -> BoolTensor<Self>;
        keep fn bool_cat(keep tensors: Vec<BoolTensor<Self>>, keep dim: usize) -> BoolTensor<Self>;
        keep fn bool_equal(
            keep lhs: BoolTensor<Self>,
            keep rhs: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_not_equal(
            keep lhs: BoolTensor<Self>,
            keep rhs: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_equal_elem(keep lhs: BoolTensor<Self>, keep rhs: Scalar) -> BoolTensor<Self>;
        keep fn bool_not_equal_elem(
            keep lhs: BoolTensor<Self>,
            keep rhs: Scalar,
        ) -> BoolTensor<Self>;
        keep fn bool_not(keep tensor: BoolTensor<Self>) -> BoolTensor<Self>;
        keep fn bool_and(
            keep lhs: BoolTensor<Self>,
            keep rhs: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_or(keep lhs: BoolTensor<Self>, keep rhs: BoolTensor<Self>) -> BoolTensor<Self>;
        keep fn bool_xor(
            keep lhs: BoolTensor<Self>,
            keep rhs: BoolTensor<Self>,
        ) -> BoolTensor<Self>;
        keep fn bool_transpose(keep tensor: BoolTensor<Self>) -> BoolTensor<Self>;
        keep fn bool_swap_dims(
            keep tensor: BoolTensor<Self>,
            keep dim1: usize,
            keep dim2: usize,
        ) -> BoolTensor<Self>;
        keep fn bool_permute(
            keep tensor: BoolTensor<Self>,
            keep axes: &[usize],
        ) -> BoolTensor<Self>;
        keep fn bool_flip(keep tensor: BoolTensor<Self>, keep axes: &[usize]) -> BoolTensor<Self>;
        keep fn bool_any(keep tensor: BoolTensor<Self>) -> BoolTensor<Self>;
        keep fn bool_any_dim(keep tensor: BoolTensor<Self>, keep dim: usize) -> BoolTensor<Self>;
        keep fn bool_all(keep tensor: BoolTensor<Self>) -> BoolTensor<Self>;
        keep fn bool_all_dim(keep tensor: BoolTensor<Self>, keep dim: usize) -> BoolTensor<Self>;
        keep fn bool_argwhere(
            keep tensor: BoolTensor<Self>,
            keep out_dtype: IntDType,
        ) -> impl Future<Output = IntTensor<Self>> + 'static + Send;
        keep fn bool_expand(keep tensor: BoolTensor<Self>, keep shape: Shape) -> BoolTensor<Self>;
        keep fn bool_unfold(
            keep tensor: BoolTensor<Self>,
            keep dim: usize,
            keep size: usize,
            keep step: usize,
        ) -> BoolTensor<Self>;
    }
}
