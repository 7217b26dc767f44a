#!/bin/sh
# Makes the benchmark's clip: 33 frames of FFmpeg's test pattern at 1040x600 (the aspect of
# 832x480, which bench.yaml's 640 buckets give), as a folder of numbered frames with a caption.
set -eu
cd "$(dirname "$0")"
mkdir -p bench_clips/pattern
ffmpeg -loglevel error -y -f lavfi -i testsrc2=size=1040x600:rate=16 -frames:v 33 \
    bench_clips/pattern/frame_%03d.png
echo "a moving colour test pattern with a counter" > bench_clips/pattern.txt
