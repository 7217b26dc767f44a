"""Writes examples/tiny/model.safetensors: a tiny FLUX-shaped checkpoint (BFL key names, random
bf16 weights, f32 norms) used by the README's first command. Needs numpy, ml_dtypes, safetensors.
"""
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

HIDDEN, MLP, CONTEXT, CHANNELS = 32, 128, 24, 8


def main():
    rng = np.random.default_rng(7)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(ml_dtypes.bfloat16)
    t = {"img_in.weight": w(HIDDEN, CHANNELS * 4), "img_in.bias": w(HIDDEN),
         "txt_in.weight": w(HIDDEN, CONTEXT), "txt_in.bias": w(HIDDEN)}
    for i in range(2):
        p = f"double_blocks.{i}."
        for s in ["img", "txt"]:
            t[p + f"{s}_mod.lin.weight"] = w(6 * HIDDEN, HIDDEN)
            t[p + f"{s}_attn.qkv.weight"] = w(3 * HIDDEN, HIDDEN)
            t[p + f"{s}_attn.norm.query_norm.scale"] = np.ones(16, np.float32)
            t[p + f"{s}_attn.proj.weight"] = w(HIDDEN, HIDDEN)
            t[p + f"{s}_mlp.0.weight"] = w(MLP, HIDDEN)
            t[p + f"{s}_mlp.2.weight"] = w(HIDDEN, MLP)
    for i in range(2):
        p = f"single_blocks.{i}."
        t[p + "modulation.lin.weight"] = w(3 * HIDDEN, HIDDEN)
        t[p + "linear1.weight"] = w(3 * HIDDEN + MLP, HIDDEN)
        t[p + "linear2.weight"] = w(HIDDEN, HIDDEN + MLP)
    t["final_layer.linear.weight"] = w(CHANNELS * 4, HIDDEN)
    save_file(t, str(Path(__file__).with_name("model.safetensors")),
              metadata={"model": "tiny FLUX-shaped example"})


if __name__ == "__main__":
    main()
