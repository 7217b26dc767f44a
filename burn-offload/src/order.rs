//! How work queued on a CUDA stream of our own (the cuBLAS products, the NVRTC attention
//! kernels) keeps its place in CubeCL's compute stream, whose handle CubeCL 0.10 does not hand
//! out.
//!
//! Device order (the default): a one-unit kernel on the compute stream raises a flag to `n`;
//! the other stream waits for it (`cuStreamWaitValue32`), runs the work, then sets a second
//! flag to `n` (`cuStreamWriteValue32`, behind a memory barrier); a one-unit kernel on the
//! compute stream runs until it sees `n`, so nothing queued after it starts before the work is
//! done. The host never waits for the GPU. It waits only, before queuing the other stream's
//! wait, until CubeCL's device thread has handed the raising kernel to the driver
//! ([`ComputeClient::exclusive`]): two streams may share one hardware queue, where a wait queued
//! ahead of the write it waits for would never end. The flags are kept per thread (CubeCL gives
//! each thread a stream of its own) and per device (`flag_kernel.rs` holds the kernels).
//!
//! Host order (`BURN_LORA_ORDER=host`, and the fallback once a stream-memory operation has
//! failed): the compute stream is drained before the work and the other stream synchronized
//! after it; the GPU idles while the host queues the kernels that follow.

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cubecl::server::Handle;
use cudarc::driver::sys::{self, CUresult, CUstreamWaitValue_flags, CUstreamWriteValue_flags};
use cudarc::driver::{CudaContext, CudaStream};

use crate::cuda::{address, drain};
use crate::flag_kernel::{DONE, RAISED, flags, raise, wait_for};

/// How the two streams are kept in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Flags in device memory; the host does not wait.
    Device,
    /// Host synchronization on both sides.
    Host,
}

fn chosen() -> Order {
    static ORDER: OnceLock<Order> = OnceLock::new();
    *ORDER.get_or_init(|| {
        if matches!(std::env::var("BURN_LORA_ORDER").as_deref(), Ok("host")) {
            tracing::info!("cuBLAS and attention kernels ordered by host waits (BURN_LORA_ORDER=host)");
            Order::Host
        } else {
            tracing::info!(
                "cuBLAS and attention kernels ordered on the device (BURN_LORA_ORDER=host waits on the host instead)"
            );
            Order::Device
        }
    })
}

/// Set once a stream-memory operation has failed: later work is host-ordered.
static DEVICE_FAILED: AtomicBool = AtomicBool::new(false);

/// One thread's flags on one device, and the last value raised.
struct Flags {
    /// The two flags.
    buffer: Handle,
    /// Device address of the first flag (the second follows it).
    address: u64,
    value: u32,
}

thread_local! {
    /// This thread's flags, by device ordinal.
    static FLAGS: RefCell<HashMap<usize, Flags>> = RefCell::new(HashMap::new());
}

/// The next value to raise with this thread's flags on `ctx`'s device, the flags' buffer and
/// its address; `None` when CubeCL cannot give a new buffer's address.
fn next(client: &ComputeClient<CudaRuntime>, ctx: &CudaContext) -> Option<(u32, Handle, u64)> {
    FLAGS.with(|all| {
        let mut all = all.borrow_mut();
        let entry = match all.entry(ctx.ordinal()) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => {
                let buffer = flags(client);
                let address = address(client, &buffer)?;
                // The zeros must be in place before another stream first reads the flags.
                drain(client);
                entry.insert(Flags {
                    buffer,
                    address,
                    value: 0,
                })
            }
        };
        entry.value = entry.value.wrapping_add(1);
        Some((entry.value, entry.buffer.clone(), entry.address))
    })
}

fn checked(result: CUresult, what: &str) -> Result<(), String> {
    match result {
        CUresult::CUDA_SUCCESS => Ok(()),
        error => Err(format!("{what}: {error:?}")),
    }
}

/// Runs `work`, which queues device work on `stream` outside CubeCL's order, as if it were
/// queued on the calling thread's compute stream at this point: it starts after every kernel
/// queued before, and every kernel queued after starts after it. An error of `work` is
/// returned once `stream` has finished what it queued.
pub(crate) fn ordered(
    client: &ComputeClient<CudaRuntime>,
    ctx: &CudaContext,
    stream: &CudaStream,
    work: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let flags = (chosen() == Order::Device && !DEVICE_FAILED.load(Ordering::Relaxed))
        .then(|| next(client, ctx))
        .flatten();
    let Some((value, buffer, base)) = flags else {
        return host_ordered(client, stream, work);
    };
    let raised = base + (RAISED * size_of::<u32>()) as u64;
    let done = base + (DONE * size_of::<u32>()) as u64;
    raise(client, &buffer, value);
    client
        .exclusive(|| ())
        .map_err(|e| format!("waiting for CubeCL's device thread: {e:?}"))?;
    // SAFETY: `raised` is the address of a live `u32` in device memory (the thread's flags).
    let waiting = unsafe {
        sys::cuStreamWaitValue32_v2(
            stream.cu_stream(),
            raised,
            value,
            CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
        )
    };
    if let Err(reason) = checked(waiting, "cuStreamWaitValue32") {
        fall_back(&reason);
        return host_ordered(client, stream, work);
    }
    if let Err(reason) = work() {
        stream.synchronize().map_err(|e| e.to_string())?;
        return Err(reason);
    }
    // SAFETY: `done` is the address of a live `u32` in device memory (the thread's flags).
    let setting = unsafe {
        sys::cuStreamWriteValue32_v2(
            stream.cu_stream(),
            done,
            value,
            CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
        )
    };
    if let Err(reason) = checked(setting, "cuStreamWriteValue32") {
        fall_back(&reason);
        return stream.synchronize().map_err(|e| e.to_string());
    }
    wait_for(client, &buffer, value);
    Ok(())
}

/// Host order from now on, after a stream-memory operation failed.
fn fall_back(reason: &str) {
    tracing::warn!("device-side ordering failed ({reason}); host waits from now on");
    DEVICE_FAILED.store(true, Ordering::Relaxed);
}

/// `work` between a drain of the compute stream and a synchronization of `stream`.
fn host_ordered(
    client: &ComputeClient<CudaRuntime>,
    stream: &CudaStream,
    work: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    drain(client);
    work()?;
    stream.synchronize().map_err(|e| e.to_string())
}
