//! The wgpu mechanism (`CubeBackend<WgpuRuntime>`, Burn's `Wgpu` without fusion): correct
//! first. Host payloads stay in ordinary memory; a fill decodes the weight on the host and
//! uploads it through Burn's own path into a buffer of its own, which the slot then holds (a
//! tensor still reading the slot's previous weight keeps that buffer alive), and waits until
//! the upload is on the device. Fences are CubeCL's `sync`, as on CUDA.

use std::sync::Mutex;

use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
use cubecl::Runtime;
use cubecl::server::ServerError;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
use cubecl_common::future::{DynFut, block_on};

use crate::error::OffloadError;
use crate::target::{StreamTarget, downloads_read_at_once};
use crate::weight::{HostMemory, HostWeight};

/// The slots of a ring: the tensor each holds since its last fill, none after a poisoning.
pub struct WgpuRing {
    device: WgpuDevice,
    slots: Vec<Mutex<Option<CubeTensor<WgpuRuntime>>>>,
}

fn device_error(action: &'static str) -> impl Fn(ServerError) -> OffloadError {
    move |e| OffloadError::Device {
        action,
        reason: format!("{e:?}"),
    }
}

impl<F: FloatElement, I: IntElement, BT: BoolElement> StreamTarget
    for CubeBackend<WgpuRuntime, F, I, BT>
{
    type Ring = WgpuRing;
    type Fence = DynFut<Result<(), ServerError>>;

    fn host_memory(
        bytes: Vec<u8>,
        _device: &WgpuDevice,
    ) -> Result<Box<dyn HostMemory>, OffloadError> {
        Ok(Box::new(bytes))
    }

    /// The decoded weight.
    fn slot_bytes(weight: &HostWeight) -> usize {
        weight.device_bytes()
    }

    fn new_ring(
        device: &WgpuDevice,
        slots: usize,
        _slot_bytes: usize,
    ) -> Result<WgpuRing, OffloadError> {
        Ok(WgpuRing {
            device: device.clone(),
            slots: (0..slots).map(|_| Mutex::new(None)).collect(),
        })
    }

    fn fill(ring: &WgpuRing, slot: usize, weight: &HostWeight) -> Result<(), OffloadError> {
        let tensor = Self::upload(weight, &ring.device)?;
        block_on(WgpuRuntime::client(&ring.device).sync())
            .map_err(device_error("waiting for a weight upload"))?;
        *ring.slots[slot].lock().unwrap() = Some(tensor);
        Ok(())
    }

    /// Empties the slot: a read of it before the next fill panics.
    fn poison(ring: &WgpuRing, slot: usize) -> Result<(), OffloadError> {
        *ring.slots[slot].lock().unwrap() = None;
        Ok(())
    }

    fn view(
        ring: &WgpuRing,
        slot: usize,
        _weight: &HostWeight,
        _device: &WgpuDevice,
    ) -> FloatTensor<Self> {
        ring.slots[slot]
            .lock()
            .unwrap()
            .clone()
            .expect("a slot is read only between its fill and its release")
    }

    /// Each fill uploads a tensor of its own, which the view already is.
    fn keep(
        view: FloatTensor<Self>,
        _weight: &HostWeight,
        _device: &WgpuDevice,
    ) -> Result<FloatTensor<Self>, OffloadError> {
        Ok(view)
    }

    fn upload(weight: &HostWeight, device: &WgpuDevice) -> Result<FloatTensor<Self>, OffloadError> {
        Ok(Self::float_from_data(weight.decode(), device))
    }

    fn fence(device: &WgpuDevice) -> Option<Self::Fence> {
        Some(WgpuRuntime::client(device).sync())
    }

    fn wait(fence: Self::Fence) {
        block_on(fence).unwrap_or_else(|e| panic!("waiting for a compute fence: {e:?}"));
    }

    fn memory_in_use(device: &WgpuDevice) -> Option<u64> {
        WgpuRuntime::client(device)
            .memory_usage()
            .ok()
            .map(|usage| usage.bytes_in_use)
    }

    downloads_read_at_once!();
}
