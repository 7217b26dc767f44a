#!/bin/sh
# Data-parallel training on the GPUs of one host: the scaling figure and the equivalence check.
# Run from the repository root on a machine with N >= 2 GPUs, with a CUDA build of `burnlora`
# on PATH, NCCL_NVLS_ENABLE=0 and NumPy for the comparison (logs go to $LOGS, default .):
#
#   benches/data_parallel.sh [N]
#
# CONFIG names another recipe than examples/flux/bench.yaml, one whose output_dir is `output`.
#
# Scaling: examples/flux/bench.yaml (FLUX.1-dev shape, r32, 1024², checkpointing) streamed
# within 12 GB per GPU with e5m2 on the bus, 6 steps on one GPU, then 6 on N GPUs (N times the
# images per step); compare the logged s/it (images per second = N / s/it).
# Equivalence: the same global batch (N micro-batches per step) and seed, 3 steps, on one GPU
# with N-fold accumulation (twice, for the run-to-run noise of bf16 and of the attention
# backward's atomics) and on N GPUs; the N-GPU adapters should differ from the first run by
# no more than the second run does.
set -eu
n=${1:-2}
config=${CONFIG:-examples/flux/bench.yaml}
out="$(dirname "$config")/output"
export BURNLORA_MODEL__QUANTIZE=e5m2 BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB=12
run() {
  name=$1
  shift
  log="${LOGS:-.}/dp_$name.log"
  rm -rf "${out:?}/$name" # a run folder left by an earlier call would be resumed
  if ! env BURNLORA_NAME="$name" "$@" burnlora train "$config" > "$log" 2>&1; then
    echo "$name failed (log $log):"
    grep -m 1 '^Error' "$log"
    exit 1
  fi
  echo "$name (log $log):"
  grep 'step [0-9]*: loss' "$log" | sed 's/.*step /  step /'
}
run scale1 BURNLORA_TRAIN__STEPS=6
run "scale$n" BURNLORA_TRAIN__STEPS=6 BURNLORA_TRAIN__DEVICES="$n"
run same1 BURNLORA_TRAIN__STEPS=3 BURNLORA_TRAIN__GRADIENT_ACCUMULATION_STEPS="$n"
run same1again BURNLORA_TRAIN__STEPS=3 BURNLORA_TRAIN__GRADIENT_ACCUMULATION_STEPS="$n"
run "same$n" BURNLORA_TRAIN__STEPS=3 BURNLORA_TRAIN__DEVICES="$n"
python3 benches/compare_lora.py "$out/same1/same1_000000003.safetensors" \
  "$out/same1again/same1again_000000003.safetensors" "$out/same$n/same${n}_000000003.safetensors"
