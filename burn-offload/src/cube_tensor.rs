//! What the CubeCL kernels' launches share: a contiguous tensor's buffer as an array argument,
//! and a fresh output.

use burn::tensor::Shape;
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

/// The buffer of a contiguous tensor as an array argument.
pub fn array<R: CubeRuntime>(tensor: &CubeTensor<R>) -> ArrayArg<R> {
    let len = tensor.meta.shape().num_elements();
    // SAFETY: a contiguous tensor's handle starts at its first element and holds `len` of them;
    // every caller passes a tensor `into_contiguous` returned or one it allocated.
    unsafe { ArrayArg::from_raw_parts(tensor.handle.clone(), len) }
}

/// A new contiguous tensor shaped and typed like `like`.
pub fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(like.meta.shape().to_vec()),
        like.dtype,
    )
}
