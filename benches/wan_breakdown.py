"""The rows of examples/wan_breakdown.rs for diffusers' Wan 2.1 14B block on PyTorch: one block
and each kind of part alone, forward and forward + backward, at 33 frames of 480x832 (14,040
tokens, 512 text tokens), bf16, LoRA rank 32 on every Linear of the block (the adapter of
../shared/bench/anchor.py). Run on the GPU machine with diffusers on the path (anchor.py's
header says how):

    python3 benches/wan_breakdown.py
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed, WanTransformerBlock

dev = torch.device("cuda")
torch.manual_seed(0)
LAYERS, WIDTH, HEADS, FFN, TEXT = 40, 5120, 40, 13824, 512
GRID = (9, 30, 52)
TOKENS = GRID[0] * GRID[1] * GRID[2]

with torch.device("meta"):
    block = WanTransformerBlock(WIDTH, FFN, HEADS, qk_norm="rms_norm_across_heads",
                                cross_attn_norm=True, eps=1e-6)
block = block.to(torch.bfloat16)
block.to_empty(device=dev)
with torch.no_grad():
    for p in block.parameters():
        p.normal_(0.0, 0.02)
block.requires_grad_(False)


def add_lora(linear, rank=32):
    down = nn.Parameter(torch.randn(rank, linear.in_features, device=dev, dtype=torch.bfloat16) / rank)
    up = nn.Parameter(torch.zeros(linear.out_features, rank, device=dev, dtype=torch.bfloat16))
    base = linear.forward
    linear.forward = lambda x, *a, **k: base(x, *a, **k) + F.linear(F.linear(x, down), up)
    linear.lora = nn.ParameterList([down, up])


for module in list(block.modules()):
    if isinstance(module, nn.Linear):
        add_lora(module)

rope = WanRotaryPosEmbed(128, (1, 2, 2), 1024).to(dev)
latent = torch.empty(1, 16, GRID[0], GRID[1] * 2, GRID[2] * 2, device=dev)
rotary = tuple(t.to(torch.bfloat16) for t in rope(latent))


def rand(*shape):
    return torch.randn(*shape, device=dev, dtype=torch.bfloat16).requires_grad_()


def timed(f, warm=2, runs=5):
    for _ in range(warm):
        f()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(runs):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / runs


def measure(name, uses, loss):
    forward = timed(lambda: loss())
    both = timed(lambda: loss().float().backward())
    step = uses * (forward + both)
    print(f"  {name:40} {forward * 1e3:9.2f} {both * 1e3:9.2f} {uses:6} {step:9.3f}", flush=True)
    return step


x, context, modulation = rand(1, TOKENS, WIDTH), rand(1, TEXT, WIDTH), rand(1, 6, WIDTH)
hidden = rand(1, TOKENS, FFN)
heads = lambda t: t.view(1, -1, HEADS, 128).transpose(1, 2)

print(f"== Wan 2.1 14B block at 33 x 480 x 832 ({TOKENS} tokens), bf16, LoRA r32, PyTorch",
      torch.__version__)
print(f"  {'part':40} {'fwd ms':>9} {'fwd+bwd':>9} {'uses':>6} {'step s':>9}")
parts = [
    measure("self-attention module", LAYERS, lambda: block.attn1(x, None, None, rotary).sum()),
    measure("cross-attention module", LAYERS, lambda: block.attn2(x, context, None, None).sum()),
    measure("feed-forward", LAYERS, lambda: block.ffn(x).sum()),
]
whole = measure("block", LAYERS, lambda: block(x, context, modulation, rotary).sum())
print(f"  {'block beyond its three modules':40} {'':>9} {'':>9} {'':>6} {whole - sum(parts):9.3f}")
print("  of which:")
measure("  attention, self, 40 heads of 128", LAYERS,
        lambda: F.scaled_dot_product_attention(heads(x), heads(x), heads(x)).sum())
measure("  attention, cross to 512 tokens", LAYERS,
        lambda: F.scaled_dot_product_attention(heads(x), heads(context), heads(context)).sum())
measure("  LoRA Linear 5120 → 5120", 6 * LAYERS, lambda: block.attn1.to_q(x).sum())
measure("  LoRA Linear 5120 → 13824", LAYERS, lambda: block.ffn.net[0].proj(x).sum())
measure("  RMS norm across heads (5120)", 3 * LAYERS, lambda: block.attn1.norm_q(x).sum())
measure("  layer norm in f32", 3 * LAYERS, lambda: block.norm1(x.float()).to(torch.bfloat16).sum())
measure("  GELU (tanh) 13824", LAYERS, lambda: F.gelu(hidden, approximate="tanh").sum())
