"""The rows of examples/sdxl_breakdown.rs for diffusers' SDXL-base UNet on PyTorch: each kind
of part alone, forward and forward + backward, at the shapes the UNet hands it at 1024², bf16,
LoRA rank 32 on every Linear under `attentions` (the adapter of ../shared/bench/anchor.py).
Run on the GPU machine with diffusers on the path
(anchor.py's header says how):

    python3 benches/sdxl_breakdown.py
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import UNet2DConditionModel

dev = torch.device("cuda")
torch.backends.cuda.enable_cudnn_sdp(False)
torch.manual_seed(0)
with torch.device("meta"):
    unet = UNet2DConditionModel(
        sample_size=128, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(320, 640, 1280), layers_per_block=2,
        transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048, use_linear_projection=True, addition_embed_type="text_time",
        addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816)
unet = unet.to(torch.bfloat16)
unet.to_empty(device=dev)
with torch.no_grad():
    for p in unet.parameters():
        p.normal_(0.0, 0.02)
unet.requires_grad_(False)


def add_lora(linear, rank=32):
    down = nn.Parameter(torch.randn(rank, linear.in_features, device=dev, dtype=torch.bfloat16) / rank)
    up = nn.Parameter(torch.zeros(linear.out_features, rank, device=dev, dtype=torch.bfloat16))
    base = linear.forward
    linear.forward = lambda x, *a, **k: base(x, *a, **k) + F.linear(F.linear(x, down), up)
    linear.lora = nn.ParameterList([down, up])


for name, module in list(unet.named_modules()):
    if isinstance(module, nn.Linear) and "attentions" in name:
        add_lora(module)


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


temb, context = rand(1, 1280), rand(1, 77, 2048)
x320, x640, x1280 = rand(1, 320, 128, 128), rand(1, 640, 64, 64), rand(1, 1280, 32, 32)
t640, t1280 = rand(1, 4096, 640), rand(1, 1024, 1280)
down = unet.down_blocks
block = lambda level: down[level].attentions[0].transformer_blocks[0]

print("== SDXL-base UNet parts at 1024², bf16, LoRA r32 on the attentions, PyTorch", torch.__version__)
print(f"  {'part':40} {'fwd ms':>9} {'fwd+bwd':>9} {'uses':>6} {'step s':>9}")
parts = [
    measure("ResNet 320, 128² (down 0.0)", 5, lambda: down[0].resnets[0](x320, temb).sum()),
    measure("ResNet 640, 64² (down 1.1)", 5, lambda: down[1].resnets[1](x640, temb).sum()),
    measure("ResNet 1280, 32² (down 2.1)", 7, lambda: down[2].resnets[1](x1280, temb).sum()),
    measure("transformer block 640 × 4096 tokens", 10,
            lambda: block(1)(t640, encoder_hidden_states=context).sum()),
    measure("transformer block 1280 × 1024 tokens", 60,
            lambda: block(2)(t1280, encoder_hidden_states=context).sum()),
]
print(f"  {'sum of the parts × uses':40} {'':>9} {'':>9} {'':>6} {sum(parts):9.3f}")
print("  of which:")
resnet = down[0].resnets[0]
measure("  group norm 320, 128² (f32 statistics)", 34, lambda: resnet.norm1(x320).sum())
measure("  convolution 3×3 320, 128²", 10, lambda: resnet.conv1(x320).sum())
measure("  time-embedding product 1 × 1280 × 320", 17, lambda: resnet.time_emb_proj(temb).sum())
heads = lambda t: t.view(1, 4096, 10, 64).transpose(1, 2)
measure("  attention 4096 tokens, 10 heads of 64", 10,
        lambda: F.scaled_dot_product_attention(heads(t640), heads(t640), heads(t640)).sum())
measure("  self-attention module 640 × 4096", 10, lambda: block(1).attn1(t640).sum())
measure("  feed-forward (GEGLU) 640 × 4096", 10, lambda: block(1).ff(t640).sum())
measure("  feed-forward (GEGLU) 1280 × 1024", 60, lambda: block(2).ff(t1280).sum())
