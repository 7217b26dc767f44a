"""burn-kernels' fused attention (burn-kernels/src/cuda/flash_attention.cu) beside PyTorch's
flash and cuDNN attention, on the GPU machine, with no Rust build: the kernels are compiled by
NVRTC with the options burn-kernels gives them (`flash.rs`, `flash_plan.rs`) and launched through
the driver API on PyTorch's stream. Prints, per shape, milliseconds of the forward and of the
backward (delta, backward, dq conversion) and the gradients' relative distance to PyTorch's
flash attention in bf16.

    python3 benches/flash_attention.py                      # the kernels as they are in the tree
    python3 benches/flash_attention.py --source other.cu    # a variant of the file
    python3 benches/flash_attention.py --define NAME=1 ...  # more NVRTC defines
"""
import argparse
import ctypes
import pathlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = {
    # name: (batch, heads, tokens, head dim)
    "wan": (1, 40, 14040, 128),
    "flux": (1, 24, 4608, 128),
    "sdxl": (1, 10, 4096, 64),
}
TILE, THREADS = 64, 128

nvrtc = ctypes.CDLL("libnvrtc.so")
cuda = ctypes.CDLL("libcuda.so.1")


def check(code, what):
    if code != 0:
        raise RuntimeError(f"{what} failed with error {code}")


def compile_ptx(source, options):
    prog = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"flash_attention.cu",
                                   0, None, None), "nvrtcCreateProgram")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    code = nvrtc.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if code != 0:
        raise RuntimeError(f"NVRTC: {log.value.decode()}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
    return ptx.raw


class Strides(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_longlong), ("head", ctypes.c_longlong),
                ("row", ctypes.c_longlong)]


def strides(t):
    return Strides(t.stride(0), t.stride(1), t.stride(2))


class Kernels:
    def __init__(self, source, head_dim, defines):
        major, minor = torch.cuda.get_device_capability()
        shared = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
        self.stages = 2 if self.backward_shared(head_dim, 2) <= shared else 1
        self.query_tiles = 2 if (2 + 4) * TILE * (head_dim + 8) * 2 <= shared else 1
        options = [f"--gpu-architecture=sm_{major}{minor}", f"-DHEAD_DIM={head_dim}",
                   f"-DSTAGES={self.stages}", f"-DQUERY_TILES={self.query_tiles}",
                   "-I/usr/local/cuda/include"] + [f"-D{d}" for d in defines]
        ptx = compile_ptx(source, options)
        torch.cuda.init()
        torch.zeros(1, device="cuda")
        self.module = ctypes.c_void_p()
        check(cuda.cuModuleLoadData(ctypes.byref(self.module), ptx), "cuModuleLoadData")
        self.head_dim = head_dim
        self.fn = {}
        for name in ["flash_forward", "flash_backward_delta", "flash_backward",
                     "flash_backward_dq"]:
            f = ctypes.c_void_p()
            check(cuda.cuModuleGetFunction(ctypes.byref(f), self.module, name.encode()), name)
            self.fn[name] = f
        self.forward_shared = (self.query_tiles + 4) * TILE * (head_dim + 8) * 2
        self.bwd_shared = self.backward_shared(head_dim, self.stages)
        for name, size in [("flash_forward", self.forward_shared),
                           ("flash_backward", self.bwd_shared)]:
            check(cuda.cuFuncSetAttribute(self.fn[name], 8, size), "cuFuncSetAttribute")

    @staticmethod
    def backward_shared(d, stages):
        tile = TILE * (d + 8) * 2
        return (2 + 2 * stages) * tile + TILE * (TILE + 8) * 2 + 2 * stages * TILE * 4

    def registers(self, name):
        value = ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(value), 4, self.fn[name])
        spill = ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(spill), 3, self.fn[name])
        return value.value, spill.value

    def launch(self, name, grid, block, shared, args):
        holders = []
        for a in args:
            if isinstance(a, torch.Tensor):
                holders.append(ctypes.c_void_p(a.data_ptr()))
            elif isinstance(a, ctypes.Structure) or isinstance(a, ctypes._SimpleCData):
                holders.append(a)
            else:
                raise TypeError(type(a))
        params = (ctypes.c_void_p * len(holders))(
            *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(cuda.cuLaunchKernel(self.fn[name], grid[0], grid[1], 1, block, 1, 1, shared,
                                  stream, params, None), f"launching {name}")

    def forward(self, q, k, v, scale):
        b, h, n, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(b * h * n, device=q.device, dtype=torch.float32)
        rows = TILE * self.query_tiles
        self.launch("flash_forward", ((n + rows - 1) // rows, b * h), THREADS,
                    self.forward_shared,
                    [q, k, v, out, lse, ctypes.c_int(h), ctypes.c_int(n), ctypes.c_int(n),
                     strides(q), strides(k), strides(v),
                     ctypes.c_float(scale * 1.4426950408889634)])
        return out, lse

    def backward(self, q, k, v, out, lse, dout, scale):
        b, h, n, d = q.shape
        rows = b * h * n
        delta = torch.empty(rows, device=q.device, dtype=torch.float32)
        acc = torch.zeros(rows * d, device=q.device, dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.launch("flash_backward_delta", ((rows + 3) // 4, 1), THREADS, 0,
                    [out, dout, delta, ctypes.c_int(h), ctypes.c_int(n), ctypes.c_longlong(rows),
                     strides(dout)])
        self.launch("flash_backward", ((n + TILE - 1) // TILE, b * h), THREADS, self.bwd_shared,
                    [q, k, v, dout, lse, delta, acc, dk, dv, ctypes.c_int(h), ctypes.c_int(n),
                     ctypes.c_int(n), strides(q), strides(k), strides(v), strides(dout),
                     ctypes.c_float(scale * 1.4426950408889634), ctypes.c_float(scale)])
        self.launch("flash_backward_dq", ((rows * d + 255) // 256, 1), 256, 0,
                    [acc, dq, ctypes.c_longlong(rows * d)])
        return dq, dk, dv


def elapsed(fn, reps):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def distance(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", default=str(pathlib.Path(__file__).parent.parent /
                                                "burn-kernels/src/cuda/flash_attention.cu"))
    parser.add_argument("--define", action="append", default=[])
    parser.add_argument("--shapes", default="wan,flux,sdxl")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--torch", action="store_true", help="also time PyTorch's kernels")
    args = parser.parse_args()
    source = pathlib.Path(args.source).read_text()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        b, h, n, d = SHAPES[name]
        kernels = Kernels(source, d, args.define)
        regs = {f: kernels.registers(f) for f in ["flash_forward", "flash_backward"]}
        q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        scale = d ** -0.5
        flops = 4 * b * h * n * n * d
        out, lse = kernels.forward(q, k, v, scale)
        grads = kernels.backward(q, k, v, out, lse, dout, scale)
        ref = []
        for t in (q, k, v):
            t.requires_grad_(True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o_ref = F.scaled_dot_product_attention(q, k, v)
            o_ref.backward(dout)
        ref = [q.grad, k.grad, v.grad]
        for t in (q, k, v):
            t.requires_grad_(False)
            t.grad = None
        errors = " ".join(f"{g}={distance(x, y):.2e}" for g, x, y in
                          zip(["out", "dq", "dk", "dv"], (out, *grads), (o_ref, *ref)))
        fwd = elapsed(lambda: kernels.forward(q, k, v, scale), args.reps)
        bwd = elapsed(lambda: kernels.backward(q, k, v, out, lse, dout, scale), args.reps)
        print(f"{name} {b}x{h}x{n}x{d} ours: forward {fwd:.3f} ms ({flops / fwd / 1e9:.0f} "
              f"TFLOP/s), backward {bwd:.3f} ms ({2.5 * flops / bwd / 1e9:.0f} TFLOP/s); "
              f"registers/local bytes {regs}; stages {kernels.stages}; vs torch flash {errors}",
              flush=True)
        if args.torch:
            for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
                qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                try:
                    with sdpa_kernel(backend):
                        f_ms = elapsed(lambda: F.scaled_dot_product_attention(qg, kg, vg),
                                       args.reps)
                        fb_ms = elapsed(lambda: F.scaled_dot_product_attention(
                            qg, kg, vg).backward(dout), args.reps)
                    print(f"{name} torch {backend.name}: forward {f_ms:.3f} ms, backward "
                          f"{fb_ms - f_ms:.3f} ms", flush=True)
                except RuntimeError as e:
                    print(f"{name} torch {backend.name}: {str(e).splitlines()[0]}", flush=True)


if __name__ == "__main__":
    main()
