#!/bin/bash
# Timed runs on a GPU host, each with the whole process's device memory sampled. Source it
# from the repository root (bash), with a CUDA build of `burnlora` on PATH or in $BURNLORA:
#
#   . benches/measure.sh
#   flux NAME [VAR=VALUE ...]     # burnlora train examples/flux/bench.yaml, 6 steps
#   sdxl NAME [VAR=VALUE ...]     # burnlora train examples/sdxl/bench.yaml, 6 steps
#   job NAME COMMAND ...          # any command
#   pack                          # the logs into $LOGS/logs.tgz, at the end of a device call
#
# VARs override the config (`BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB=12`); $F12 and $S4 hold
# the rows of benches/RESULTS.md: FLUX.1 within 12 GB with e5m2 on the bus, SDXL within 4 GB
# with e5m2 and adamw8bit. A job runs at most $TIMEOUT seconds (default 600). Its output goes
# to $LOGS/NAME.log (default ./measure), nvidia-smi's used device memory every 0.2 s to
# $LOGS/NAME.mem, and $LOGS/summary.txt gets its exit status, wall time, peak MiB and the
# lines that carry step times and errors. A device call brings back only a few files from
# $OUT, so `pack` gathers every log and memory trace into one archive.
F12="BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB=12 BURNLORA_MODEL__QUANTIZE=e5m2"
S4="BURNLORA_MODEL__OFFLOAD__VRAM_BUDGET_GB=4 BURNLORA_MODEL__QUANTIZE=e5m2 BURNLORA_TRAIN__OPTIMIZER=adamw8bit"
LOGS=${LOGS:-measure}
mkdir -p "$LOGS"

job() {
  local name=$1
  shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 \
    > "$LOGS/$name.mem" 2> /dev/null &
  local sampler=$! start=$SECONDS
  timeout "${TIMEOUT:-600}" "$@" > "$LOGS/$name.log" 2>&1
  local status=$?
  kill "$sampler" 2> /dev/null
  wait "$sampler" 2> /dev/null
  local peak
  peak=$(sort -n "$LOGS/$name.mem" | tail -n 1)
  {
    echo "== $name: exit $status, $((SECONDS - start)) s, peak ${peak:-?} MiB"
    sed 's/\x1b\[[0-9;]*m//g' "$LOGS/$name.log" |
      grep -E 'offload step|s/it|median|rror|panicked|mismatch|\|' | tail -n 40
  } >> "$LOGS/summary.txt"
  return "$status"
}

# train NAME CONFIG [VAR=VALUE ...]: 6 steps of `burnlora train CONFIG` as run NAME, with the
# step log's offload lines.
train() {
  local name=$1 config=$2
  shift 2
  job "$name" env BURNLORA_TRAIN__STEPS=6 BURNLORA_NAME="$name" \
    BURNLORA_LOG=info,burn_lora_train::train=debug,burn_offload=debug "$@" \
    "${BURNLORA:-burnlora}" train "$config"
}

flux() {
  local name=$1
  shift
  train "$name" examples/flux/bench.yaml "$@"
}

sdxl() {
  local name=$1
  shift
  train "$name" examples/sdxl/bench.yaml "$@"
}

# pack: every job's log and memory trace into $LOGS/logs.tgz, leaving summary.txt beside it.
pack() {
  (cd "$LOGS" && tar czf logs.tgz --remove-files -- *.log *.mem)
}
