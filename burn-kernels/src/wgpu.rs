//! [`FusedOps`] for Burn's wgpu backend: the CubeCL elementwise kernels; attention and the
//! products stay with Burn's ops (wgpu has no vendor BLAS, and the fused attention kernels are
//! CUDA C++).

use burn::tensor::ops::FloatTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::wgpu::WgpuRuntime;

use crate::cube::elementwise_ops;
use crate::fused::{FusedOps, NoKernel};
use crate::options::KernelOptions;

impl<F: FloatElement, I: IntElement, BT: BoolElement> FusedOps
    for CubeBackend<WgpuRuntime, F, I, BT>
{
    type Attention = NoKernel;

    fn fused_attention(
        _q: &FloatTensor<Self>,
        _k: &FloatTensor<Self>,
        _v: &FloatTensor<Self>,
        _scale: f32,
        _options: &KernelOptions,
    ) -> Option<(FloatTensor<Self>, NoKernel)> {
        None
    }

    fn fused_attention_backward(
        _qkv: [&FloatTensor<Self>; 3],
        saved: &NoKernel,
        _grad: FloatTensor<Self>,
        _scale: f32,
    ) -> [FloatTensor<Self>; 3] {
        match *saved {}
    }

    elementwise_ops!();
}
