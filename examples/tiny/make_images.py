"""Writes examples/tiny/images/: six 64x64 PNGs (gradients, a disc, a square, stripes) with
same-stem .txt captions, the dataset of examples/tiny/config.yaml. Standard library only.

`make_images.py SIZE FOLDER` writes the same six images at SIZE x SIZE into FOLDER instead
(examples/flux/bench_images/ holds them at 1024 for the GPU benchmark).
"""
import math
import struct
import sys
import zlib
from pathlib import Path

SIZE = 64


def png(path, pixel, size):
    rows = b"".join(
        b"\x00" + bytes(c for x in range(size) for c in pixel(x / (size - 1), y / (size - 1)))
        for y in range(size)
    )

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def rgb(r, g, b):
    return tuple(max(0, min(255, round(255 * v))) for v in (r, g, b))


IMAGES = {
    "red_gradient": ("a red gradient from left to right", lambda x, y: rgb(x, 0.1, 0.1)),
    "blue_gradient": ("a blue gradient from top to bottom", lambda x, y: rgb(0.1, 0.1, y)),
    "green_disc": ("a green disc on a white background",
                   lambda x, y: rgb(0.1, 0.8, 0.2) if math.hypot(x - 0.5, y - 0.5) < 0.3 else rgb(1, 1, 1)),
    "yellow_square": ("a yellow square on a black background",
                      lambda x, y: rgb(1, 0.9, 0.1) if abs(x - 0.5) < 0.25 and abs(y - 0.5) < 0.25 else rgb(0, 0, 0)),
    "stripes": ("black and white vertical stripes",
                lambda x, y: rgb(1, 1, 1) if int(x * 8) % 2 else rgb(0, 0, 0)),
    "purple_diagonal": ("a purple diagonal gradient", lambda x, y: rgb((x + y) / 2, 0.1, (x + y) / 2)),
}


def main():
    size, folder = SIZE, Path(__file__).parent / "images"
    if len(sys.argv) == 3:
        size, folder = int(sys.argv[1]), Path(sys.argv[2])
    folder.mkdir(exist_ok=True)
    for name, (caption, pixel) in IMAGES.items():
        png(folder / f"{name}.png", pixel, size)
        (folder / f"{name}.txt").write_text(caption + "\n")


if __name__ == "__main__":
    main()
