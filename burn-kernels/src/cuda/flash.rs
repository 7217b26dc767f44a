//! Fused attention on CUDA: the kernels of `flash_attention.cu`, compiled by NVRTC on first use
//! for the device and head size, run on Burn-owned buffers. The mechanism behind
//! [`attention`](crate::attention); ordered against CubeCL's stream as the cuBLAS products are
//! (`order.rs`).

use std::sync::Arc;

use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::counters::count_dnn_attention;
use crate::cuda::flash_plan::{
    TILE, backward_shared, backward_stages, forward_query_tiles, forward_rows, forward_shared,
};
use crate::cuda::order::ordered;
use crate::cuda::sdpa::{self, AttentionShape};
use crate::cuda::{SideContext, compile_module, compute_capability};
use crate::error::{KernelError, fell_back};
use crate::options::{AttentionRoute, KernelOptions, StreamOrder};

/// Threads per block of the two main kernels.
const THREADS: u32 = 128;

/// Element strides of one `[batch, heads, rows, head_dim]` operand (the last is 1).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Strides {
    batch: i64,
    head: i64,
    row: i64,
}

// SAFETY: plain old data laid out as the kernels' `struct Strides`.
unsafe impl DeviceRepr for Strides {}

/// The kernels for one device and head size, with the stream they run on.
pub(crate) struct FlashKernels {
    stream: Arc<CudaStream>,
    forward: CudaFunction,
    delta: CudaFunction,
    backward: CudaFunction,
    dq: CudaFunction,
    /// Query tiles per warp of `forward`, as compiled for this device.
    query_tiles: usize,
    /// Dynamic shared memory of `backward`, as compiled for this device.
    backward_shared: usize,
}

impl FlashKernels {
    pub(crate) fn new(ctx: &Arc<CudaContext>, head_dim: usize) -> Result<Self, KernelError> {
        let stream = ctx
            .new_stream()
            .map_err(KernelError::device("creating the attention stream"))?;
        let (major, minor) = compute_capability(ctx)?;
        if major < 8 {
            return Err(KernelError::Unsupported(format!(
                "compute capability {major}.{minor} has no bf16 tensor cores"
            )));
        }
        let shared = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(KernelError::device("reading the shared memory per block"))?
            as usize;
        let plan = backward_stages(head_dim, shared).zip(forward_query_tiles(head_dim, shared));
        let (stages, query_tiles) = plan.ok_or_else(|| {
            KernelError::Unsupported(format!(
                "{shared} bytes of shared memory per block are too few"
            ))
        })?;
        let module = compile_module(
            ctx,
            "flash_attention.cu",
            include_str!("flash_attention.cu"),
            vec![
                format!("-DHEAD_DIM={head_dim}"),
                format!("-DSTAGES={stages}"),
                format!("-DQUERY_TILES={query_tiles}"),
                "--std=c++17".into(),
            ],
        )?;
        let function = |name: &str, shared: usize| -> Result<CudaFunction, KernelError> {
            let f = module
                .load_function(name)
                .map_err(KernelError::device("loading an attention kernel"))?;
            f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared as i32,
            )
            .map_err(KernelError::device(
                "setting an attention kernel's shared memory",
            ))?;
            Ok(f)
        };
        let backward_bytes = backward_shared(head_dim, stages);
        Ok(Self {
            forward: function("flash_forward", forward_shared(head_dim, query_tiles))?,
            delta: function("flash_backward_delta", 0)?,
            backward: function("flash_backward", backward_bytes)?,
            dq: function("flash_backward_dq", 0)?,
            query_tiles,
            backward_shared: backward_bytes,
            stream,
        })
    }
}

/// `[batch, heads, rows, head_dim]` of a bf16 tensor the kernels can read in place (unit stride
/// on the head dimension, the others multiples of 8 elements for 16-byte loads), and its strides.
fn operand(t: &CubeTensor<CudaRuntime>) -> Option<([usize; 4], Strides)> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    if t.dtype != DType::BF16 || t.qparams.is_some() || shape.len() != 4 || strides[3] != 1 {
        return None;
    }
    if strides[..3].iter().any(|s| s % 8 != 0) {
        return None;
    }
    let stride = |i: usize| i64::try_from(strides[i]).ok();
    Some((
        [shape[0], shape[1], shape[2], shape[3]],
        Strides {
            batch: stride(0)?,
            head: stride(1)?,
            row: stride(2)?,
        },
    ))
}

/// `addresses`, when every one is 16-byte aligned (the kernels' vector loads need it).
fn aligned<const N: usize>(addresses: [u64; N]) -> Result<[u64; N], KernelError> {
    if addresses.iter().all(|address| address % 16 == 0) {
        Ok(addresses)
    } else {
        Err(KernelError::Unsupported(
            "a buffer not aligned to 16 bytes".into(),
        ))
    }
}

/// Blocks of `per_block` rows that cover `rows`.
fn blocks(rows: usize, per_block: usize) -> u32 {
    rows.div_ceil(per_block) as u32
}

/// The checked shapes of one attention call: `q` `[b, h, lq, d]`, `k` and `v` `[b, h, lk, d]`.
struct Problem {
    batch: usize,
    heads: usize,
    len_q: usize,
    len_k: usize,
    head_dim: usize,
    strides: [Strides; 3],
}

impl Problem {
    fn new(
        q: &CubeTensor<CudaRuntime>,
        k: &CubeTensor<CudaRuntime>,
        v: &CubeTensor<CudaRuntime>,
    ) -> Option<Self> {
        let ((qd, qs), (kd, ks), (vd, vs)) = (operand(q)?, operand(k)?, operand(v)?);
        let [batch, heads, len_q, head_dim] = qd;
        let len_k = kd[2];
        let fits = [batch * heads, len_q, len_k]
            .iter()
            .all(|&n| i32::try_from(n).is_ok() && n > 0);
        (fits && matches!(head_dim, 64 | 128) && kd == [batch, heads, len_k, head_dim] && vd == kd)
            .then_some(Self {
                batch,
                heads,
                len_q,
                len_k,
                head_dim,
                strides: [qs, ks, vs],
            })
    }

    fn rows_q(&self) -> usize {
        self.batch * self.heads * self.len_q
    }

    fn attention_shape(&self) -> AttentionShape {
        AttentionShape {
            batch: self.batch as i64,
            heads: self.heads as i64,
            len_q: self.len_q as i64,
            len_k: self.len_k as i64,
            head_dim: self.head_dim as i64,
            strides: self.strides.map(|s| [s.batch, s.head, s.row]),
        }
    }
}

/// A fresh contiguous tensor of `shape` and `dtype` on `like`'s device.
fn empty(
    like: &CubeTensor<CudaRuntime>,
    shape: Vec<usize>,
    dtype: DType,
) -> CubeTensor<CudaRuntime> {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(shape),
        dtype,
    )
}

/// Which implementation ran a forward pass; its backward runs on the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    /// cuDNN's fused attention engines (`sdpa.rs`).
    Cudnn,
    /// The kernels of `flash_attention.cu`.
    Kernels,
}

/// What the backward pass of one fused attention needs from its forward pass.
#[derive(Debug, Clone)]
pub struct FlashSaved {
    /// The output, `[batch, heads, len_q, head_dim]` bf16.
    output: CubeTensor<CudaRuntime>,
    /// Per query row, the log-sum-exp of its scores, f32 `[batch, heads, len_q]`: of
    /// `scale · q·k` in natural log units from cuDNN, of `scale · log2 e · q·k` in base 2 from
    /// the kernels.
    row_stats: CubeTensor<CudaRuntime>,
    /// How the forward was ordered with CubeCL's stream; the backward is ordered the same way.
    order: StreamOrder,
    engine: Engine,
}

/// The forward pass through cuDNN, or `None` when cuDNN is missing, has no engine for this
/// shape, or fails (logged).
fn cudnn_forward(
    side: &SideContext,
    [q, k, v]: [&CubeTensor<CudaRuntime>; 3],
    problem: &Problem,
    scale: f32,
    order: StreamOrder,
) -> Option<(CubeTensor<CudaRuntime>, FlashSaved)> {
    let dnn = side.dnn().ok()?;
    let mut dnn = dnn.lock().unwrap();
    side.context().bind_to_thread().ok()?;
    let (handle, stream) = (dnn.handle(), dnn.stream().clone());
    let shape = problem.attention_shape();
    let (plan, _) = dnn.attention_plans(&shape)?;
    let (batch, heads, len_q) = (problem.batch, problem.heads, problem.len_q);
    let out = empty(q, vec![batch, heads, len_q, problem.head_dim], DType::BF16);
    let stats = empty(q, vec![batch, heads, len_q], DType::F32);
    let workspace = q.client.empty(plan.workspace.max(1));
    let buffers = [
        &q.handle,
        &k.handle,
        &v.handle,
        &out.handle,
        &stats.handle,
        &workspace,
    ];
    let run = ordered(&q.client, side, &stream, order, buffers, |addresses| {
        // SAFETY: `Problem` checked q, k and v against the plan's shape; `out`, `stats` and
        // the workspace were allocated for it.
        unsafe { sdpa::run_forward(plan, handle, aligned(addresses)?, scale) }
    });
    match run {
        Ok(()) => {
            count_dnn_attention();
            Some((
                out.clone(),
                FlashSaved {
                    output: out,
                    row_stats: stats,
                    order,
                    engine: Engine::Cudnn,
                },
            ))
        }
        Err(error) => {
            tracing::warn!("cuDNN attention: {error}; the fused kernels run it");
            None
        }
    }
}

/// The backward pass through cuDNN, for a forward that ran there (which built its plan).
fn cudnn_backward(
    side: &SideContext,
    [q, k, v]: [&CubeTensor<CudaRuntime>; 3],
    problem: &Problem,
    saved: &FlashSaved,
    grad: &CubeTensor<CudaRuntime>,
    scale: f32,
) -> Result<[CubeTensor<CudaRuntime>; 3], KernelError> {
    let dnn = side.dnn()?;
    let mut dnn = dnn.lock().unwrap();
    let (handle, stream) = (dnn.handle(), dnn.stream().clone());
    let shape = problem.attention_shape();
    let (_, plan) = dnn
        .attention_plans(&shape)
        .expect("built for the forward pass");
    let (batch, heads, len_q, len_k, d) = (
        problem.batch,
        problem.heads,
        problem.len_q,
        problem.len_k,
        problem.head_dim,
    );
    let dq = empty(q, vec![batch, heads, len_q, d], DType::BF16);
    let dk = empty(q, vec![batch, heads, len_k, d], DType::BF16);
    let dv = empty(q, vec![batch, heads, len_k, d], DType::BF16);
    let client = &q.client;
    let row_sums = client.empty(shape.row_bytes());
    let accumulator = client.empty(shape.dq_accumulator_bytes());
    let workspace = client.empty(plan.workspace.max(1));
    let buffers = [
        &q.handle,
        &k.handle,
        &v.handle,
        &saved.output.handle,
        &saved.row_stats.handle,
        &grad.handle,
        &dq.handle,
        &dk.handle,
        &dv.handle,
        &row_sums,
        &accumulator,
        &workspace,
    ];
    ordered(client, side, &stream, saved.order, buffers, |addresses| {
        let addresses = aligned(addresses)?;
        if sdpa::clears_nothing() {
            // SAFETY: the accumulator holds `dq_accumulator_bytes`; all-zero bytes are 0.0.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    addresses[10],
                    0,
                    shape.dq_accumulator_bytes(),
                    stream.cu_stream(),
                )
            }
            .map_err(KernelError::device("clearing the dq accumulator"))?;
        }
        // SAFETY: the forward checked q, k and v against the plan's shape, `grad` is the
        // contiguous output gradient, and every other buffer was allocated for the shape.
        unsafe { sdpa::run_backward(plan, handle, addresses, scale) }
    })?;
    Ok([dq, dk, dv])
}

/// `softmax(scale · q kᵀ) v` and what its backward needs, or `None` when the kernels do not take
/// these tensors (dtype other than bf16, head size other than 64 or 128, layout) or fail (logged).
pub(crate) fn forward(
    q: &CubeTensor<CudaRuntime>,
    k: &CubeTensor<CudaRuntime>,
    v: &CubeTensor<CudaRuntime>,
    scale: f32,
    options: &KernelOptions,
) -> Option<(CubeTensor<CudaRuntime>, FlashSaved)> {
    let problem = Problem::new(q, k, v)?;
    let order = options.order;
    let side = match SideContext::of(&q.device) {
        Ok(side) => side,
        Err(error) => {
            fell_back("fused attention", &error);
            return None;
        }
    };
    if options.attention == AttentionRoute::Fused
        && let Some(done) = cudnn_forward(&side, [q, k, v], &problem, scale, order)
    {
        return Some(done);
    }
    let kernels = match side.flash(problem.head_dim) {
        Ok(kernels) => kernels,
        Err(error) => {
            fell_back("fused attention", &error);
            return None;
        }
    };
    let Problem {
        batch,
        heads,
        len_q,
        len_k,
        head_dim,
        strides: [qs, ks, vs],
    } = problem;
    let out = empty(q, vec![batch, heads, len_q, head_dim], DType::BF16);
    let lse = empty(q, vec![batch, heads, len_q], DType::F32);
    let client = &q.client;
    let (heads_i, len_q_i, len_k_i) = (heads as i32, len_q as i32, len_k as i32);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let kernels = kernels.lock().unwrap();
    let buffers = [&q.handle, &k.handle, &v.handle, &out.handle, &lse.handle];
    let launched = ordered(
        client,
        &side,
        &kernels.stream,
        order,
        buffers,
        |addresses| {
            let [qp, kp, vp, op, lp] = aligned(addresses)?;
            let mut launch = kernels.stream.launch_builder(&kernels.forward);
            launch
                .arg(&qp)
                .arg(&kp)
                .arg(&vp)
                .arg(&op)
                .arg(&lp)
                .arg(&heads_i)
                .arg(&len_q_i)
                .arg(&len_k_i)
                .arg(&qs)
                .arg(&ks)
                .arg(&vs)
                .arg(&scale_log2);
            // SAFETY: the arguments match `flash_forward`'s parameters; the buffers hold the
            // extents `Problem` checked, `out` and `lse` were allocated for them.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (
                        blocks(len_q, forward_rows(kernels.query_tiles)),
                        (batch * heads) as u32,
                        1,
                    ),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: forward_shared(head_dim, kernels.query_tiles) as u32,
                })
            }
            .map(drop)
            .map_err(KernelError::device("launching the attention forward"))
        },
    );
    match launched {
        Ok(()) => Some((
            out.clone(),
            FlashSaved {
                output: out,
                row_stats: lse,
                order,
                engine: Engine::Kernels,
            },
        )),
        Err(error) => {
            fell_back("fused attention", &error);
            None
        }
    }
}

/// The gradients of `q`, `k` and `v` from the output's gradient `grad`, given what the forward
/// saved. Panics when the kernels fail: a forward that ran has no other backward.
pub(crate) fn backward(
    [q, k, v]: [&CubeTensor<CudaRuntime>; 3],
    saved: &FlashSaved,
    grad: &CubeTensor<CudaRuntime>,
    scale: f32,
) -> [CubeTensor<CudaRuntime>; 3] {
    let problem = Problem::new(q, k, v).expect("the forward pass checked these tensors");
    let Problem {
        batch,
        heads,
        len_q,
        len_k,
        head_dim,
        strides: [qs, ks, vs],
    } = problem;
    let (grad_dims, ds) = operand(grad).expect("the output gradient is a bf16 [b, h, lq, d]");
    assert_eq!(
        grad_dims,
        [batch, heads, len_q, head_dim],
        "output gradient shape"
    );
    let side = SideContext::of(&q.device).expect("opened for the forward pass");
    if saved.engine == Engine::Cudnn {
        let packed = [heads * len_q * head_dim, len_q * head_dim, head_dim].map(|n| n as i64);
        let sizes = [batch, heads, len_q];
        let contiguous =
            (0..3).all(|i| sizes[i] == 1 || [ds.batch, ds.head, ds.row][i] == packed[i]);
        // The backward plan reads the output gradient packed, as its forward wrote the output.
        let grad = if contiguous {
            grad.clone()
        } else {
            into_contiguous(grad.clone())
        };
        match cudnn_backward(&side, [q, k, v], &problem, saved, &grad, scale) {
            Ok(grads) => return grads,
            Err(error) => panic!("cuDNN attention backward failed: {error}"),
        }
    }
    let (out, lse) = (&saved.output, &saved.row_stats);
    let kernels = side.flash(head_dim).expect("compiled for the forward pass");
    let rows = problem.rows_q();
    let delta = empty(q, vec![rows], DType::F32);
    let dq_acc = empty(q, vec![rows * head_dim], DType::F32);
    let dq = empty(q, vec![batch, heads, len_q, head_dim], DType::BF16);
    let dk = empty(q, vec![batch, heads, len_k, head_dim], DType::BF16);
    let dv = empty(q, vec![batch, heads, len_k, head_dim], DType::BF16);
    let client = &q.client;
    let handles = [
        &q.handle,
        &k.handle,
        &v.handle,
        &out.handle,
        &lse.handle,
        &grad.handle,
        &delta.handle,
        &dq_acc.handle,
        &dq.handle,
        &dk.handle,
        &dv.handle,
    ];
    let (heads_i, len_q_i, len_k_i) = (heads as i32, len_q as i32, len_k as i32);
    let (rows_i, elements) = (rows as i64, (rows * head_dim) as i64);
    let scale_log2 = scale * std::f32::consts::LOG2_E;
    let kernels = kernels.lock().unwrap();
    let done = ordered(
        client,
        &side,
        &kernels.stream,
        saved.order,
        handles,
        |addresses| {
            let [qp, kp, vp, op, lp, gp, deltap, accp, dqp, dkp, dvp] = aligned(addresses)?;
            // SAFETY: `accp` holds `rows · head_dim` f32 values; all-zero bytes are 0.0.
            unsafe {
                cudarc::driver::result::memset_d8_async(
                    accp,
                    0,
                    rows * head_dim * size_of::<f32>(),
                    kernels.stream.cu_stream(),
                )
            }
            .map_err(KernelError::device("clearing the dq accumulator"))?;
            let rows_per_block = (THREADS / 32) as usize;
            let mut launch = kernels.stream.launch_builder(&kernels.delta);
            launch
                .arg(&op)
                .arg(&gp)
                .arg(&deltap)
                .arg(&heads_i)
                .arg(&len_q_i)
                .arg(&rows_i)
                .arg(&ds);
            // SAFETY: the arguments match `flash_backward_delta`'s parameters; one warp per row.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (rows.div_ceil(rows_per_block) as u32, 1, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(KernelError::device("launching the attention delta kernel"))?;
            let mut launch = kernels.stream.launch_builder(&kernels.backward);
            launch
                .arg(&qp)
                .arg(&kp)
                .arg(&vp)
                .arg(&gp)
                .arg(&lp)
                .arg(&deltap)
                .arg(&accp)
                .arg(&dkp)
                .arg(&dvp)
                .arg(&heads_i)
                .arg(&len_q_i)
                .arg(&len_k_i)
                .arg(&qs)
                .arg(&ks)
                .arg(&vs)
                .arg(&ds)
                .arg(&scale_log2)
                .arg(&scale);
            // SAFETY: the arguments match `flash_backward`'s parameters; every buffer was
            // allocated for the extents `Problem` checked.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: (blocks(len_k, TILE), (batch * heads) as u32, 1),
                    block_dim: (THREADS, 1, 1),
                    shared_mem_bytes: kernels.backward_shared as u32,
                })
            }
            .map_err(KernelError::device("launching the attention backward"))?;
            let mut launch = kernels.stream.launch_builder(&kernels.dq);
            launch.arg(&accp).arg(&dqp).arg(&elements);
            // SAFETY: the arguments match `flash_backward_dq`'s parameters.
            unsafe {
                launch.launch(LaunchConfig {
                    grid_dim: ((rows * head_dim).div_ceil(256) as u32, 1, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map(drop)
            .map_err(KernelError::device("launching the attention's dq kernel"))
        },
    );
    if let Err(error) = done {
        panic!("fused attention backward failed: {error}");
    }
    [dq, dk, dv]
}
