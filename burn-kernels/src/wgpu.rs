//! [`FusedOps`] for Burn's wgpu backend: the CubeCL elementwise kernels; attention and the
//! products stay with Burn's ops (wgpu has no vendor BLAS, and the fused attention kernels are
//! CUDA C++).

use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::wgpu::WgpuRuntime;

use crate::cube::elementwise_ops;
use crate::fused::{FusedOps, no_fused_attention};

impl<F: FloatElement, I: IntElement, BT: BoolElement> FusedOps
    for CubeBackend<WgpuRuntime, F, I, BT>
{
    no_fused_attention!();

    elementwise_ops!();
}
