//! The CubeCL kernels, for any CubeCL runtime (run on CUDA, tested on wgpu): the elementwise
//! ops (`unary.rs`, `norm_rope.rs`), the flags that order other CUDA streams (`flag.rs`), and
//! what their launches share: operands made contiguous in the dtype a kernel reads, their
//! buffers as array arguments (of values or of vectors), fresh outputs, and the launch size for
//! one unit per item. [`elementwise_ops!`] writes a CubeCL backend's elementwise
//! [`FusedOps`](crate::FusedOps) methods.

#[cfg(any(feature = "cuda", all(test, feature = "wgpu")))]
pub(crate) mod flag;
pub(crate) mod norm_rope;
pub(crate) mod unary;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::calculate_cube_count_elemwise;
use cubecl::client::ComputeClient;
use cubecl::prelude::*;

/// `tensor` contiguous and in `dtype` (copied or cast only when it is not already).
pub fn contiguous_as<R: CubeRuntime>(tensor: CubeTensor<R>, dtype: DType) -> CubeTensor<R> {
    let tensor = into_contiguous(tensor);
    if tensor.dtype == dtype {
        tensor
    } else {
        cast(tensor, dtype)
    }
}

/// The buffer of a contiguous tensor as an array argument.
pub fn array<R: CubeRuntime>(tensor: &CubeTensor<R>) -> ArrayArg<R> {
    vector_array(tensor, 1)
}

/// The buffer of a contiguous tensor as an array of vectors of `width` values, for a kernel
/// launched with vector size `width`; `width` must divide the tensor's size.
pub fn vector_array<R: CubeRuntime>(tensor: &CubeTensor<R>, width: usize) -> ArrayArg<R> {
    let elements = tensor.meta.shape().num_elements();
    assert!(
        width > 0 && elements.is_multiple_of(width),
        "vectors of {width} do not tile {elements} values"
    );
    // SAFETY: a contiguous tensor's handle starts at its first element and holds `elements` of
    // them; every caller passes a tensor `into_contiguous` returned or one it allocated. The
    // length is in values (the launch divides it by the vector size). A handle starts at a
    // multiple of the runtime's memory alignment (burn-cubecl's slices copy otherwise), which
    // is a multiple of any vector's size.
    unsafe { ArrayArg::from_raw_parts(tensor.handle.clone(), elements) }
}

/// The widest vector `client` loads in one access for values of `dtype` that `fits` accepts.
pub fn widest_vector<R: CubeRuntime>(
    client: &ComputeClient<R>,
    dtype: DType,
    fits: impl Fn(usize) -> bool,
) -> Option<usize> {
    client
        .io_optimized_vector_sizes(dtype.size())
        .filter(|&width| fits(width))
        .max()
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

/// Cubes and units for a launch with one unit per item, `n` items.
pub fn one_unit_each<R: CubeRuntime>(client: &ComputeClient<R>, n: usize) -> (CubeCount, CubeDim) {
    let cube_dim = CubeDim::new(client, n);
    (calculate_cube_count_elemwise(client, n, cube_dim), cube_dim)
}

/// Whether the fused elementwise kernels take `x`: a plain (not quantized) f32, bf16 or f16
/// tensor.
pub fn elementwise_input<R: CubeRuntime>(x: &CubeTensor<R>) -> bool {
    matches!(x.dtype, DType::F32 | DType::BF16 | DType::F16) && x.qparams.is_none()
}

/// The elementwise methods of [`FusedOps`](crate::FusedOps) for a `CubeBackend`, through the
/// kernels of `unary.rs` and `norm_rope.rs`.
macro_rules! elementwise_ops {
    () => {
        fn fused_unary(
            op: $crate::UnaryOp,
            x: &burn::tensor::ops::FloatTensor<Self>,
            _options: &$crate::KernelOptions,
        ) -> Option<burn::tensor::ops::FloatTensor<Self>> {
            $crate::cube::elementwise_input(x).then(|| $crate::cube::unary::unary(op, x.clone()))
        }

        fn fused_unary_backward(
            op: $crate::UnaryOp,
            x: &burn::tensor::ops::FloatTensor<Self>,
            grad: burn::tensor::ops::FloatTensor<Self>,
        ) -> burn::tensor::ops::FloatTensor<Self> {
            $crate::cube::unary::unary_backward(op, x.clone(), grad)
        }

        fn fused_norm_rope(
            o: &$crate::NormRope<Self>,
            _options: &$crate::KernelOptions,
        ) -> Option<burn::tensor::ops::FloatTensor<Self>> {
            $crate::cube::elementwise_input(&o.x).then(|| {
                $crate::cube::norm_rope::norm_rope(
                    o.x.clone(),
                    o.scale.clone(),
                    o.cos.clone(),
                    o.sin.clone(),
                    o.eps,
                )
            })
        }

        fn fused_norm_rope_backward(
            o: &$crate::NormRope<Self>,
            grad: burn::tensor::ops::FloatTensor<Self>,
        ) -> burn::tensor::ops::FloatTensor<Self> {
            $crate::cube::norm_rope::norm_rope_backward(
                o.x.clone(),
                o.scale.clone(),
                o.cos.clone(),
                o.sin.clone(),
                grad,
                o.eps,
            )
        }
    };
}
pub(crate) use elementwise_ops;
