"""Relative difference between LoRA files of the same network, for the data-parallel check
(benches/data_parallel.sh): the first file is the reference, and each other file is compared
with it over every tensor but the `.alpha` scalars, as ||a - b|| / ||a|| over all of them
together, and the largest such ratio of one tensor. Needs only NumPy:

    python3 benches/compare_lora.py REFERENCE OTHER [OTHER ...]
"""
import json
import struct
import sys

import numpy as np


FLOATS = {"F16": "<f2", "F32": "<f4", "F64": "<f8"}


def widen(raw, dtype):
    """Little-endian safetensors bytes of `dtype` as float64."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view("<f4").astype(np.float64)
    if dtype in FLOATS:
        return np.frombuffer(raw, dtype=FLOATS[dtype]).astype(np.float64)
    sys.exit(f"unexpected dtype {dtype}")


def read(path):
    """The tensors of a .safetensors file but the `.alpha` scalars, as float64 arrays."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__" or name.endswith(".alpha"):
            continue
        begin, end = entry["data_offsets"]
        tensors[name] = widen(data[begin:end], entry["dtype"]).reshape(entry["shape"])
    return tensors


def compare(reference, other):
    """(relative difference over all tensors, the largest of one tensor, its name)."""
    if reference.keys() != other.keys():
        differing = sorted(reference.keys() ^ other.keys())[:5]
        sys.exit(f"the files hold different tensors, e.g. {differing}")
    diff = norm = 0.0
    worst = (0.0, "")
    for name, a in reference.items():
        b = other[name]
        if a.shape != b.shape:
            sys.exit(f"{name}: shape {list(a.shape)} against {list(b.shape)}")
        d = float(np.sum((a - b) ** 2))
        n = float(np.sum(a**2))
        diff += d
        norm += n
        worst = max(worst, ((d / n) ** 0.5 if n > 0 else float(d > 0), name))
    return (diff / norm) ** 0.5, worst[0], worst[1]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    reference = read(sys.argv[1])
    for path in sys.argv[2:]:
        total, worst, name = compare(reference, read(path))
        print(f"{path}: relative difference {total:.3e} (largest {worst:.3e}, {name})")


if __name__ == "__main__":
    main()
