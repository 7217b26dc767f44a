//! How work queued on a CUDA stream of our own (the cuBLAS products, the NVRTC attention
//! kernels) keeps its place in CubeCL's compute stream, whose handle CubeCL 0.10 does not hand
//! out.
//!
//! Device order (the default): a one-unit kernel on the compute stream raises a flag to `n`;
//! on the other stream a one-unit kernel waits until it sees `n`, the work runs, and another
//! one-unit kernel sets a second flag to `n`; a one-unit kernel on the compute stream waits
//! until it sees that, so nothing queued after it starts before the work is done. The host never
//! waits for the GPU. It waits only, before queuing the other stream's wait, until CubeCL's
//! device thread has handed the raising kernel to the driver ([`ComputeClient::exclusive`]), so
//! that the driver always receives a flag's write before the wait for it; the work's buffers
//! are resolved to device addresses in that same round trip. The flags live in a
//! CubeCL buffer, kept per thread (CubeCL gives each thread a stream of its own) and per device;
//! `flag_kernel.rs` holds the compute stream's kernels, and the other stream's are compiled here
//! by NVRTC. (The driver's stream-memory operations, `cuStreamWaitValue32` and
//! `cuStreamWriteValue32`, would spare those two kernels, but reject CubeCL's buffers, which come
//! from the stream-ordered allocator: `CUDA_ERROR_INVALID_VALUE` on the H200.)
//!
//! Host order ([`StreamOrder::Host`], and the fallback of a call whose flag kernels cannot be
//! compiled or launched): the compute stream is drained before the work and the other stream synchronized
//! after it; the GPU idles while the host queues the kernels that follow.

use std::cell::RefCell;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;

use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cubecl::server::Handle;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::cube::flag::{DONE, RAISED, flags, raise, wait_for};
use crate::cuda::{SideContext, address, compile_module, drain};
use crate::error::{KernelError, fell_back};
use crate::options::StreamOrder;

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

/// The other stream's kernels: one waits until a flag reaches a value, one sets a flag.
const SIDE_KERNELS: &str = r#"
extern "C" __global__ void wait_flag(unsigned int* flag, unsigned int value) {
    while (atomicAdd(flag, 0u) < value) {
        __nanosleep(256);
    }
}
extern "C" __global__ void set_flag(unsigned int* flag, unsigned int value) {
    atomicExch(flag, value);
}
"#;

/// The other stream's flag kernels for one device.
pub(crate) struct FlagKernels {
    wait: CudaFunction,
    set: CudaFunction,
}

impl FlagKernels {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        let module = compile_module(ctx, "order_flags.cu", SIDE_KERNELS, Vec::new())?;
        let function = |name| {
            module
                .load_function(name)
                .map_err(KernelError::device("loading a flag kernel"))
        };
        Ok(Self {
            wait: function("wait_flag")?,
            set: function("set_flag")?,
        })
    }

    /// Queues `function` on `stream` with one thread, for the flag at `flag` and `value`.
    fn launch(
        function: &CudaFunction,
        stream: &CudaStream,
        flag: u64,
        value: u32,
    ) -> Result<(), KernelError> {
        let mut launch = stream.launch_builder(function);
        launch.arg(&flag).arg(&value);
        // SAFETY: the arguments match the kernels' parameters; `flag` is the address of a live
        // `u32` in device memory (the thread's flags).
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }
            .map(drop)
            .map_err(KernelError::device("launching a flag kernel"))
    }
}

/// Runs `work`, which queues device work on `stream` outside CubeCL's order, as if it were
/// queued on the calling thread's compute stream at this point: it starts after every kernel
/// queued before, and every kernel queued after starts after it. `work` gets the device
/// addresses of `buffers`, all resolved in the one round trip to CubeCL's device thread that
/// the ordering makes anyway. Under device `order`, a call whose flag kernels fail falls back to
/// host order (logged). A buffer CubeCL cannot resolve is an error, and nothing runs then; an
/// error of `work` is returned once `stream` has finished what it queued.
pub(crate) fn ordered<const N: usize>(
    client: &ComputeClient<CudaRuntime>,
    side: &SideContext,
    stream: &CudaStream,
    order: StreamOrder,
    buffers: [&Handle; N],
    work: impl FnOnce([u64; N]) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    let ctx = side.context();
    ctx.bind_to_thread()
        .map_err(KernelError::device("binding the CUDA context"))?;
    if order == StreamOrder::Host {
        return host_ordered(client, stream, buffers, work);
    }
    let kernels = match side.flag_kernels() {
        Ok(kernels) => kernels,
        Err(error) => {
            fell_back("device-side ordering", &error);
            return host_ordered(client, stream, buffers, work);
        }
    };
    let Some((value, buffer, base)) = next(client, ctx) else {
        return host_ordered(client, stream, buffers, work);
    };
    let raised = base + (RAISED * size_of::<u32>()) as u64;
    let done = base + (DONE * size_of::<u32>()) as u64;
    raise(client, &buffer, value);
    // Resolved on the device thread, once it has handed the raising kernel to the driver.
    let addresses = resolve(client, buffers)?;
    if let Err(error) = FlagKernels::launch(&kernels.wait, stream, raised, value) {
        fell_back("device-side ordering", &error);
        return host_ordered(client, stream, buffers, work);
    }
    if let Err(error) = work(addresses) {
        synchronize(stream)?;
        return Err(error);
    }
    if let Err(error) = FlagKernels::launch(&kernels.set, stream, done, value) {
        fell_back("device-side ordering", &error);
        return synchronize(stream);
    }
    wait_for(client, &buffer, value);
    Ok(())
}

/// The device addresses of `buffers`, resolved in one task on CubeCL's device thread (which
/// runs after everything the calling thread queued before).
fn resolve<const N: usize>(
    client: &ComputeClient<CudaRuntime>,
    buffers: [&Handle; N],
) -> Result<[u64; N], KernelError> {
    let resolved = client
        .exclusive(|| buffers.map(|buffer| address(client, buffer)))
        .map_err(|e| KernelError::Device {
            action: "waiting for CubeCL's device thread",
            reason: format!("{e:?}"),
        })?;
    let mut addresses = [0; N];
    for (slot, address) in addresses.iter_mut().zip(resolved) {
        *slot = address
            .ok_or_else(|| KernelError::Unsupported("a buffer CubeCL cannot resolve".into()))?;
    }
    Ok(addresses)
}

fn synchronize(stream: &CudaStream) -> Result<(), KernelError> {
    stream
        .synchronize()
        .map_err(KernelError::device("waiting for a side stream"))
}

/// `work` on `buffers`' addresses, between a drain of the compute stream and a synchronization
/// of `stream`.
fn host_ordered<const N: usize>(
    client: &ComputeClient<CudaRuntime>,
    stream: &CudaStream,
    buffers: [&Handle; N],
    work: impl FnOnce([u64; N]) -> Result<(), KernelError>,
) -> Result<(), KernelError> {
    drain(client);
    work(resolve(client, buffers)?)?;
    synchronize(stream)
}
