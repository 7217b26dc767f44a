//! Two one-unit CubeCL kernels that let a CUDA stream outside CubeCL's order take its place in
//! CubeCL's stream, through a pair of `u32` flags in device memory: [`raise`] writes a value to
//! the first flag once every kernel queued before it has run, and [`wait_for`] holds the stream
//! until the second flag reaches a value. The mechanism behind the device order of `order.rs`;
//! runtime-generic, tested on wgpu.

use burn_cubecl::CubeRuntime;
use cubecl::client::ComputeClient;
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Index of the flag CubeCL's stream raises.
pub const RAISED: usize = 0;
/// Index of the flag the other stream sets when its work is done.
pub const DONE: usize = 1;

#[cube(launch)]
fn raise_kernel(flags: &mut Array<Atomic<u32>>, value: u32) {
    flags[RAISED].store(value);
}

#[cube(launch)]
fn wait_kernel(flags: &Array<Atomic<u32>>, value: u32) {
    loop {
        if flags[DONE].load() >= value {
            break;
        }
    }
}

/// One unit, one cube.
fn single() -> (CubeCount, CubeDim) {
    (CubeCount::Static(1, 1, 1), CubeDim::new_1d(1))
}

/// The two flags' buffer, both zero.
pub fn flags<R: CubeRuntime>(client: &ComputeClient<R>) -> Handle {
    client.create_from_slice(&[0u8; 2 * size_of::<u32>()])
}

/// Queues, on the calling thread's stream, the write of `value` to the [`RAISED`] flag.
pub fn raise<R: CubeRuntime>(client: &ComputeClient<R>, flags: &Handle, value: u32) {
    let (count, dim) = single();
    // SAFETY: `flags` holds two `u32` values.
    let arg = unsafe { ArrayArg::from_raw_parts(flags.clone(), 2) };
    raise_kernel::launch(client, count, dim, arg, value);
}

/// Queues, on the calling thread's stream, a kernel that runs until the [`DONE`] flag is at
/// least `value`; nothing queued after it starts before.
pub fn wait_for<R: CubeRuntime>(client: &ComputeClient<R>, flags: &Handle, value: u32) {
    let (count, dim) = single();
    // SAFETY: `flags` holds two `u32` values.
    let arg = unsafe { ArrayArg::from_raw_parts(flags.clone(), 2) };
    wait_kernel::launch(client, count, dim, arg, value);
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    fn read(client: &ComputeClient<WgpuRuntime>, flags: &Handle) -> [u32; 2] {
        let bytes = client.read_one_unchecked(flags.clone());
        let values: &[u32] = bytemuck::cast_slice(&bytes);
        [values[0], values[1]]
    }

    /// `raise` writes the first flag only; `wait_for` returns once the second one is high
    /// enough (set here from the host, as the other stream's write would be).
    #[test]
    fn raise_writes_the_first_flag_and_wait_returns_when_the_second_is_reached() {
        let client = WgpuRuntime::client(&WgpuDevice::default());
        let flags = flags(&client);
        assert_eq!(read(&client, &flags), [0, 0]);
        raise(&client, &flags, 7);
        assert_eq!(read(&client, &flags), [7, 0]);
        raise(&client, &flags, 9);
        assert_eq!(read(&client, &flags), [9, 0]);

        let done = client.create_from_slice(bytemuck::cast_slice(&[3u32, 5]));
        wait_for(&client, &done, 5);
        wait_for(&client, &done, 4);
        raise(&client, &done, 6);
        assert_eq!(read(&client, &done), [6, 5]);
    }
}
