#!/bin/sh
# Makes the benchmark's clip: 33 frames (or the count given, into bench_clips_<count>) of
# FFmpeg's test pattern at 1040x600 (the aspect of 832x480, which bench.yaml's 640 buckets
# give), as a folder of numbered frames with a caption.
#   bench_clip.sh        -> bench_clips/
#   bench_clip.sh 81     -> bench_clips_81/
set -eu
cd "$(dirname "$0")"
frames=${1:-33}
dir=bench_clips
[ "$frames" = 33 ] || dir=bench_clips_$frames
mkdir -p "$dir/pattern"
ffmpeg -loglevel error -y -f lavfi -i testsrc2=size=1040x600:rate=16 -frames:v "$frames" \
    "$dir/pattern/frame_%03d.png"
echo "a moving colour test pattern with a counter" > "$dir/pattern.txt"
