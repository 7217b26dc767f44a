//! Attention through cuDNN's fused attention engines: the operation graphs of
//! `softmax(scale · q kᵀ) v` and of its gradients in cuDNN's backend (graph) API, composed of
//! products, pointwise ops, reductions and reshapes as NVIDIA's cudnn-frontend composes its SDPA
//! nodes, so that cuDNN's heuristics find the fused flash-attention engine for them. One
//! execution plan per pass and shape, built once and kept by the cuDNN handle's owner.
//!
//! The forward writes each query row's log-sum-exp of its scaled scores in natural log units
//! (`stats`); the backward reads it back. The backward needs two f32 buffers of its own beside
//! cuDNN's workspace: each row's `rowsum(dO ∘ O)` and the dq accumulator.

use std::ffi::c_void;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Type,
    cudnnBackendDescriptor_t, cudnnBackendDescriptorType_t as Kind, cudnnBackendHeurMode_t,
    cudnnDataType_t, cudnnHandle_t, cudnnPointwiseMode_t as Pointwise, cudnnReduceTensorOp_t,
    cudnnStatus_t,
};

use crate::error::KernelError;

/// The extents and element strides of one attention call: `q` `[batch, heads, len_q, head_dim]`,
/// `k` and `v` `[batch, heads, len_k, head_dim]`, each with unit stride on the head dimension;
/// the output and every gradient contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct AttentionShape {
    pub batch: i64,
    pub heads: i64,
    pub len_q: i64,
    pub len_k: i64,
    pub head_dim: i64,
    /// Batch, head and row strides of `q`, `k` and `v`.
    pub strides: [[i64; 3]; 3],
}

impl AttentionShape {
    /// Bytes of the backward's `rowsum(dO ∘ O)` buffer (f32 per query row).
    pub fn row_bytes(&self) -> usize {
        (self.batch * self.heads * self.len_q) as usize * size_of::<f32>()
    }

    /// Bytes of the backward's dq accumulator (f32, the shape of `q`).
    pub fn dq_accumulator_bytes(&self) -> usize {
        self.row_bytes() * self.head_dim as usize
    }
}

// Unique ids of the tensors a caller binds; virtual tensors are numbered from `FIRST_VIRTUAL`.
const Q: i64 = 1;
const K: i64 = 2;
const V: i64 = 3;
const SCALE: i64 = 4;
const O: i64 = 5;
const STATS: i64 = 6;
const DO: i64 = 7;
const DQ: i64 = 8;
const DK: i64 = 9;
const DV: i64 = 10;
const ONE: i64 = 11;
const ROW_SUMS: i64 = 12;
const DQ_ACCUMULATOR: i64 = 13;
const FIRST_VIRTUAL: i64 = 100;

const BF16: cudnnDataType_t = cudnnDataType_t::CUDNN_DATA_BFLOAT16;
const F32: cudnnDataType_t = cudnnDataType_t::CUDNN_DATA_FLOAT;

fn checked(status: cudnnStatus_t, action: &'static str) -> Result<(), KernelError> {
    if status == cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(KernelError::Device {
            action,
            reason: format!("{status:?}"),
        })
    }
}

/// One backend descriptor, destroyed on drop.
struct Descriptor(cudnnBackendDescriptor_t);

impl Descriptor {
    fn new(kind: Kind) -> Result<Self, KernelError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: cuDNN writes a fresh descriptor into `raw`.
        let status = unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) };
        checked(status, "creating a cuDNN descriptor")?;
        Ok(Self(raw))
    }

    /// Sets attribute `name` to `values`, whose element type `kind` names.
    fn set<T>(&self, name: Attr, kind: Type, values: &[T]) -> Result<(), KernelError> {
        // SAFETY: a live descriptor; `values` holds `len` elements of the type `kind` names
        // (each caller pairs them), read during the call.
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.0,
                name,
                kind,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        };
        checked(status, "setting a cuDNN graph attribute")
    }

    /// Reads up to `values.len()` elements of attribute `name` (of the type `kind` names) into
    /// `values`; returns how many the attribute holds. An empty `values` only counts them.
    fn get<T>(&self, name: Attr, kind: Type, values: &mut [T]) -> Result<i64, KernelError> {
        let mut count = 0i64;
        let out = if values.is_empty() {
            std::ptr::null_mut()
        } else {
            values.as_mut_ptr().cast()
        };
        // SAFETY: a live descriptor; `values` has room for `len` elements of the type `kind`
        // names (each caller pairs them), written during the call.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(self.0, name, kind, values.len() as i64, &mut count, out)
        };
        checked(status, "reading a cuDNN descriptor attribute")?;
        Ok(count)
    }

    /// Sets attribute `name` to the backend descriptors `values`.
    fn set_descriptors(
        &self,
        name: Attr,
        values: &[cudnnBackendDescriptor_t],
    ) -> Result<(), KernelError> {
        self.set(name, Type::CUDNN_TYPE_BACKEND_DESCRIPTOR, values)
    }

    fn finalize(self) -> Result<Self, KernelError> {
        // SAFETY: a live descriptor whose required attributes were set.
        checked(
            unsafe { sys::cudnnBackendFinalize(self.0) },
            "finalizing a cuDNN descriptor",
        )?;
        Ok(self)
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by `Descriptor::new`, destroyed once.
        unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

/// What a tensor of the graph is: bound to a buffer, computed inside the engine, or a scalar
/// passed by value from host memory.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Bound,
    Virtual,
    Value,
}

/// An operation graph under construction: its tensors and operations.
struct Graph {
    tensors: Vec<(i64, Descriptor)>,
    ops: Vec<Descriptor>,
    next_virtual: i64,
}

/// Strides of a contiguous tensor of `dims`.
fn packed(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

impl Graph {
    fn new() -> Self {
        Self {
            tensors: Vec::new(),
            ops: Vec::new(),
            next_virtual: FIRST_VIRTUAL,
        }
    }

    fn tensor(
        &mut self,
        uid: i64,
        dims: [i64; 4],
        strides: [i64; 4],
        dtype: cudnnDataType_t,
        role: Role,
    ) -> Result<i64, KernelError> {
        let d = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
            Type::CUDNN_TYPE_DATA_TYPE,
            &[dtype],
        )?;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_DIMENSIONS,
            Type::CUDNN_TYPE_INT64,
            &dims,
        )?;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_STRIDES,
            Type::CUDNN_TYPE_INT64,
            &strides,
        )?;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID,
            Type::CUDNN_TYPE_INT64,
            &[uid],
        )?;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
            Type::CUDNN_TYPE_INT64,
            &[16i64],
        )?;
        let is_virtual = role == Role::Virtual;
        d.set(
            Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
            Type::CUDNN_TYPE_BOOLEAN,
            &[is_virtual],
        )?;
        if role == Role::Value {
            d.set(
                Attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
                Type::CUDNN_TYPE_BOOLEAN,
                &[true],
            )?;
        }
        self.tensors.push((uid, d.finalize()?));
        Ok(uid)
    }

    /// A virtual tensor of `dims` (contiguous strides unless given).
    fn temp(
        &mut self,
        dims: [i64; 4],
        strides: Option<[i64; 4]>,
        dtype: cudnnDataType_t,
    ) -> Result<i64, KernelError> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(
            uid,
            dims,
            strides.unwrap_or(packed(dims)),
            dtype,
            Role::Virtual,
        )
    }

    /// A scalar f32 passed by value.
    fn scalar(&mut self, uid: i64) -> Result<i64, KernelError> {
        self.tensor(uid, [1; 4], [1; 4], F32, Role::Value)
    }

    fn raw(&self, uid: i64) -> cudnnBackendDescriptor_t {
        let found = self.tensors.iter().find(|(id, _)| *id == uid);
        found.expect("tensors are described before their ops").1.0
    }

    /// `c = a · b` over the last two dimensions.
    fn matmul(&mut self, a: i64, b: i64, c: i64) -> Result<(), KernelError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        desc.set(
            Attr::CUDNN_ATTR_MATMUL_COMP_TYPE,
            Type::CUDNN_TYPE_DATA_TYPE,
            &[F32],
        )?;
        let desc = desc.finalize()?;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[self.raw(a)])?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[self.raw(b)])?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[self.raw(c)])?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[desc.0])?;
        self.ops.push(op.finalize()?);
        Ok(())
    }

    /// `y = mode(x)` or `y = mode(x, b)`, broadcasting, computed in f32.
    fn pointwise(
        &mut self,
        mode: Pointwise,
        x: i64,
        b: Option<i64>,
        y: i64,
    ) -> Result<(), KernelError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        desc.set(
            Attr::CUDNN_ATTR_POINTWISE_MODE,
            Type::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
        )?;
        desc.set(
            Attr::CUDNN_ATTR_POINTWISE_MATH_PREC,
            Type::CUDNN_TYPE_DATA_TYPE,
            &[F32],
        )?;
        let desc = desc.finalize()?;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_descriptors(
            Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR,
            &[desc.0],
        )?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[self.raw(x)])?;
        if let Some(b) = b {
            op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[self.raw(b)])?;
        }
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[self.raw(y)])?;
        self.ops.push(op.finalize()?);
        Ok(())
    }

    /// `y = reduce(x)` over the dimensions where `y` has extent 1, in f32.
    fn reduction(&mut self, op: cudnnReduceTensorOp_t, x: i64, y: i64) -> Result<(), KernelError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        let operator = Type::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE;
        desc.set(Attr::CUDNN_ATTR_REDUCTION_OPERATOR, operator, &[op])?;
        desc.set(
            Attr::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            Type::CUDNN_TYPE_DATA_TYPE,
            &[F32],
        )?;
        let desc = desc.finalize()?;
        let node = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        node.set_descriptors(Attr::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[desc.0])?;
        node.set_descriptors(Attr::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[self.raw(x)])?;
        node.set_descriptors(Attr::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[self.raw(y)])?;
        self.ops.push(node.finalize()?);
        Ok(())
    }

    /// `y`, the elements of `x` seen through `y`'s dimensions and strides (a transposed view).
    fn reshape(&mut self, x: i64, y: i64) -> Result<(), KernelError> {
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[self.raw(x)])?;
        op.set_descriptors(Attr::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[self.raw(y)])?;
        self.ops.push(op.finalize()?);
        Ok(())
    }

    /// The first execution plan that cuDNN's heuristics (mode A, then its fallback list) offer
    /// and that finalizes for this graph.
    fn plan(self, handle: cudnnHandle_t) -> Result<Plan, KernelError> {
        let ops: Vec<cudnnBackendDescriptor_t> = self.ops.iter().map(|op| op.0).collect();
        let graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_descriptors(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &ops)?;
        graph.set(
            Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
            Type::CUDNN_TYPE_HANDLE,
            &[handle],
        )?;
        let graph = graph.finalize()?;
        for mode in [
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let heuristics = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
            heuristics.set_descriptors(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph.0])?;
            heuristics.set(
                Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
                Type::CUDNN_TYPE_HEUR_MODE,
                &[mode],
            )?;
            let Ok(heuristics) = heuristics.finalize() else {
                continue;
            };
            let results = Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS;
            let descriptors = Type::CUDNN_TYPE_BACKEND_DESCRIPTOR;
            let count =
                heuristics.get::<cudnnBackendDescriptor_t>(results, descriptors, &mut [])?;
            let mut configs = (0..count)
                .map(|_| Descriptor::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
                .collect::<Result<Vec<_>, _>>()?;
            // cuDNN fills the engine-config descriptors created above.
            let mut raw: Vec<cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
            let got = heuristics.get(results, descriptors, &mut raw)?;
            for (i, &choice) in raw.iter().enumerate().take(got.min(count) as usize) {
                let plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.set(
                    Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                    Type::CUDNN_TYPE_HANDLE,
                    &[handle],
                )?;
                plan.set_descriptors(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[choice])?;
                let Ok(plan) = plan.finalize() else {
                    continue;
                };
                let mut workspace = 0i64;
                plan.get(
                    Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                    Type::CUDNN_TYPE_INT64,
                    std::slice::from_mut(&mut workspace),
                )?;
                return Ok(Plan {
                    plan,
                    workspace: workspace.max(0) as usize,
                    _config: configs.swap_remove(i),
                    _graph: graph,
                    _parts: self,
                });
            }
        }
        Err(KernelError::Unsupported(
            "cuDNN offers no engine for this attention graph".into(),
        ))
    }
}

/// A finalized execution plan with the descriptors it was built from.
pub(crate) struct Plan {
    plan: Descriptor,
    /// Bytes of workspace the plan needs.
    pub workspace: usize,
    _config: Descriptor,
    _graph: Descriptor,
    _parts: Graph,
}

impl Plan {
    /// Runs the plan on `handle`'s stream with each unique id bound to its pointer.
    ///
    /// # Safety
    /// Each device pointer must address a buffer of the extents the plan was built for, each
    /// by-value pointer a live host f32, and `workspace` at least [`Plan::workspace`] bytes.
    unsafe fn execute(
        &self,
        handle: cudnnHandle_t,
        uids: &[i64],
        pointers: &[*mut c_void],
        workspace: *mut c_void,
    ) -> Result<(), KernelError> {
        let pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            Type::CUDNN_TYPE_INT64,
            uids,
        )?;
        let pointer = Type::CUDNN_TYPE_VOID_PTR;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            pointer,
            pointers,
        )?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            pointer,
            &[workspace],
        )?;
        let pack = pack.finalize()?;
        // SAFETY: the caller vouches for the buffers behind the pointers.
        let status = unsafe { sys::cudnnBackendExecute(handle, self.plan.0, pack.0) };
        checked(status, "running cuDNN's attention")
    }
}

/// The input tensors both passes share: `q`, `kᵀ` (a transposed view of `k`), and `v` or `vᵀ`.
fn inputs(g: &mut Graph, s: &AttentionShape, v_transposed: bool) -> Result<(), KernelError> {
    let AttentionShape {
        batch: b,
        heads: h,
        len_q: sq,
        len_k: sk,
        head_dim: d,
        strides: [qs, ks, vs],
    } = *s;
    g.tensor(
        Q,
        [b, h, sq, d],
        [qs[0], qs[1], qs[2], 1],
        BF16,
        Role::Bound,
    )?;
    g.tensor(
        K,
        [b, h, d, sk],
        [ks[0], ks[1], 1, ks[2]],
        BF16,
        Role::Bound,
    )?;
    if v_transposed {
        g.tensor(
            V,
            [b, h, d, sk],
            [vs[0], vs[1], 1, vs[2]],
            BF16,
            Role::Bound,
        )?;
    } else {
        g.tensor(
            V,
            [b, h, sk, d],
            [vs[0], vs[1], vs[2], 1],
            BF16,
            Role::Bound,
        )?;
    }
    g.scalar(SCALE)?;
    g.tensor(O, [b, h, sq, d], packed([b, h, sq, d]), BF16, Role::Bound)?;
    g.tensor(
        STATS,
        [b, h, sq, 1],
        packed([b, h, sq, 1]),
        F32,
        Role::Bound,
    )?;
    Ok(())
}

/// The forward pass's plan: `o = softmax(scale · q kᵀ) v` and `stats`, each row's log-sum-exp.
pub(crate) fn forward_plan(handle: cudnnHandle_t, s: &AttentionShape) -> Result<Plan, KernelError> {
    let (b, h, sq, sk) = (s.batch, s.heads, s.len_q, s.len_k);
    let (scores, rows) = ([b, h, sq, sk], [b, h, sq, 1]);
    let mut g = Graph::new();
    inputs(&mut g, s, false)?;
    let raw = g.temp(scores, None, F32)?;
    g.matmul(Q, K, raw)?;
    let scaled = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_MUL, raw, Some(SCALE), scaled)?;
    let max = g.temp(rows, None, F32)?;
    g.reduction(cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_MAX, scaled, max)?;
    let shifted = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_SUB, scaled, Some(max), shifted)?;
    let exp = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_EXP, shifted, None, exp)?;
    let sum = g.temp(rows, None, F32)?;
    g.reduction(cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD, exp, sum)?;
    let log = g.temp(rows, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_LOG, sum, None, log)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_ADD, max, Some(log), STATS)?;
    let p = g.temp(scores, None, BF16)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_DIV, exp, Some(sum), p)?;
    g.matmul(p, V, O)?;
    g.plan(handle)
}

/// The backward pass's plan: dq, dk and dv from `dO` (contiguous), `o`, `stats` and the inputs.
pub(crate) fn backward_plan(
    handle: cudnnHandle_t,
    s: &AttentionShape,
) -> Result<Plan, KernelError> {
    let (b, h, sq, sk, d) = (s.batch, s.heads, s.len_q, s.len_k, s.head_dim);
    let (scores, rows) = ([b, h, sq, sk], [b, h, sq, 1]);
    // A [b, h, len_k, len_q] view of a score matrix.
    let transposed = [b, h, sk, sq];
    let transposed_strides = Some([h * sq * sk, sq * sk, 1, sk]);
    let mut g = Graph::new();
    inputs(&mut g, s, true)?;
    g.tensor(DO, [b, h, sq, d], packed([b, h, sq, d]), BF16, Role::Bound)?;
    g.tensor(DQ, [b, h, sq, d], packed([b, h, sq, d]), BF16, Role::Bound)?;
    g.tensor(DK, [b, h, sk, d], packed([b, h, sk, d]), BF16, Role::Bound)?;
    g.tensor(DV, [b, h, sk, d], packed([b, h, sk, d]), BF16, Role::Bound)?;
    g.scalar(ONE)?;
    g.tensor(ROW_SUMS, rows, packed(rows), F32, Role::Bound)?;
    g.tensor(
        DQ_ACCUMULATOR,
        [b, h, sq, d],
        packed([b, h, sq, d]),
        F32,
        Role::Bound,
    )?;

    // Each row's rowsum(dO ∘ O).
    let products = g.temp([b, h, sq, d], None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_MUL, DO, Some(O), products)?;
    let sums = g.temp(rows, None, F32)?;
    g.reduction(
        cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD,
        products,
        sums,
    )?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_MUL, sums, Some(ONE), ROW_SUMS)?;
    // P = exp(scale · q kᵀ − stats); dV = Pᵀ dO.
    let raw = g.temp(scores, None, F32)?;
    g.matmul(Q, K, raw)?;
    let scaled = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_MUL, raw, Some(SCALE), scaled)?;
    let shifted = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_SUB, scaled, Some(STATS), shifted)?;
    let p = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_EXP, shifted, None, p)?;
    let p_t = g.temp(transposed, transposed_strides, BF16)?;
    g.reshape(p, p_t)?;
    g.matmul(p_t, DO, DV)?;
    // dS = scale · P ∘ (dO vᵀ − rowsum); dK = dSᵀ q; dQ = dS k.
    let dp = g.temp(scores, None, F32)?;
    g.matmul(DO, V, dp)?;
    let centred = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_SUB, dp, Some(ROW_SUMS), centred)?;
    let weighted = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_MUL, centred, Some(p), weighted)?;
    let ds = g.temp(scores, None, F32)?;
    g.pointwise(Pointwise::CUDNN_POINTWISE_MUL, weighted, Some(SCALE), ds)?;
    let ds_t = g.temp(transposed, transposed_strides, BF16)?;
    g.reshape(ds, ds_t)?;
    g.matmul(ds_t, Q, DK)?;
    let ks = s.strides[1];
    let k = g.temp([b, h, sk, d], Some([ks[0], ks[1], ks[2], 1]), BF16)?;
    g.reshape(K, k)?;
    g.matmul(ds, k, DQ_ACCUMULATOR)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_IDENTITY,
        DQ_ACCUMULATOR,
        None,
        DQ,
    )?;
    g.plan(handle)
}

/// Runs the forward plan: `[q, k, v, o, stats, workspace]` device addresses.
///
/// # Safety
/// The addresses must hold buffers of `plan`'s shape; the workspace at least its bytes.
pub(crate) unsafe fn run_forward(
    plan: &Plan,
    handle: cudnnHandle_t,
    [q, k, v, o, stats, workspace]: [u64; 6],
    scale: f32,
) -> Result<(), KernelError> {
    let scale_ptr = (&scale as *const f32).cast_mut().cast::<c_void>();
    let pointers = [q, k, v, o, stats].map(|a| a as *mut c_void);
    let uids = [Q, K, V, O, STATS, SCALE];
    let all = [
        pointers[0],
        pointers[1],
        pointers[2],
        pointers[3],
        pointers[4],
        scale_ptr,
    ];
    // SAFETY: the caller vouches for the buffers; `scale` lives through the call.
    unsafe { plan.execute(handle, &uids, &all, workspace as *mut c_void) }
}

/// Runs the backward plan: `[q, k, v, o, stats, dO, dq, dk, dv, row sums, dq accumulator,
/// workspace]` device addresses.
///
/// # Safety
/// As [`run_forward`]; the row sums and the accumulator of [`AttentionShape`]'s sizes.
pub(crate) unsafe fn run_backward(
    plan: &Plan,
    handle: cudnnHandle_t,
    addresses: [u64; 12],
    scale: f32,
) -> Result<(), KernelError> {
    let (scale, one) = (scale, 1.0f32);
    let mut pointers: Vec<*mut c_void> =
        addresses[..11].iter().map(|&a| a as *mut c_void).collect();
    pointers.push((&scale as *const f32).cast_mut().cast());
    pointers.push((&one as *const f32).cast_mut().cast());
    let uids = [
        Q,
        K,
        V,
        O,
        STATS,
        DO,
        DQ,
        DK,
        DV,
        ROW_SUMS,
        DQ_ACCUMULATOR,
        SCALE,
        ONE,
    ];
    // SAFETY: the caller vouches for the buffers; `scale` and `one` live through the call.
    unsafe { plan.execute(handle, &uids, &pointers, addresses[11] as *mut c_void) }
}

/// Whether this cuDNN leaves the dq accumulator for its caller to clear (before 9.6.0).
pub(crate) fn clears_nothing() -> bool {
    // SAFETY: a plain query of the loaded library.
    unsafe { sys::cudnnGetVersion() < 90600 }
}
