#!/usr/bin/env bash
# The standing GPU checks of ../shared/GPU.md on an NVIDIA machine, as one script with a time cap
# per step, so a short device lease gets every answer it can: the GPU and its libraries, a few
# steps of mlp and gpt-tiny on cuda:0 (host state and device state) with their losses compared to
# the same run on cpu:0 (scripts/compare_losses.py: PASS/FAIL at 1e-3), the device benchmark, and
# the PyTorch reference beside it. Each step runs even if an earlier one failed.
#
#   bash scripts/gpu_check.sh BIN [OUT] [first|parallel|memory|calibrate|precision]
#
# Where the evidence goes: OUT, by default docs/gpu/<date>-<card>/ of this repository (date from
# `date -u +%F`, card the first GPU's name slugged: "NVIDIA H200" -> 2026-11-26-h200; "-xN" added
# for N GPUs), or $GPU_CHECK_ROOT/<date>-<card>/ when that variable names another parent. Pass an
# explicit OUT (or "" / auto for the default) to override. Each round writes its own folder in it:
#
#   docs/gpu/2026-11-26-h200/
#     README.md            what ran, made by this script: the machine, versions, git commit, the
#                          binary's sha256, and per round every step's command, cap, exit status,
#                          seconds and verdict (regenerated after every step)
#     0133-first/          a round, named by its start (UTC hours and minutes) and its kind
#       machine.txt        nvidia-smi (full and queried), driver/CUDA, nvrtc, CPU, memory, OS,
#                          python3 and torch versions, the binary (path, sha256, --version), commit
#       steps.tsv          one line per step: n, start s, seconds, cap s, exit, verdict, name, command
#       log.txt            everything the round printed
#       *.json, *.jsonl    the reports (`train --report`, `bench --json`, torch_reference.py lines)
#
# Commit the folder beside the prose that quotes it. The device tool returns at most 8 files from
# $OUT, so set GPU_CHECK_BUNDLE=FILE.tar.gz there: after every step the whole <date>-<card>
# folder is packed into that one file (a run killed at its limit still returns what it did), and
# here `tar -xzf FILE.tar.gz -C docs/gpu/` puts it in place (rounds from several leases land in
# the same folder; `bash scripts/gpu_check.sh --readme docs/gpu/<date>-<card>` then rewrites its
# README.md from every round's files, no GPU needed). Needs bash, coreutils, tar, python3 (stdlib
# only, for the comparing and summary scripts; torch only for the PyTorch steps) and the binary:
# nothing is fetched, so it runs where no registry can be reached.
#
#   cargo build --release -p archipelago-controller --features cuda   # here, where the registries are
#   strip target/release/archipelago                                  # and carry it (docs/gpu/README.md)
#   GPU_CHECK_COMMIT=<git rev-parse HEAD here> GPU_CHECK_ROOT=/tmp/gpu GPU_CHECK_BUNDLE=$OUT/gpu.tar.gz \
#     bash scripts/gpu_check.sh target/release/archipelago "" first   # on the GPU machine
#   ... "" parallel    # the second round, same folder: parallel plans, the full bench, TF32,
#                      # PyTorch's autocast bf16/f16 (the mixed-precision peer)
#   ... "" memory      # the device's memory pool against the plan's estimate
#   ... "" calibrate   # plan --rate measure on the GPU against the step train measures
#   ... "" precision   # --precision bf16 against f32: losses, step times, PyTorch's f32 and bf16
#   ... "" tensor      # --tp 2 on cuda:0,cuda:0 against dp=1 and CPU; what its collectives cost
set -u
die() { echo "gpu_check.sh: $*" >&2; exit 2; }

# The folder's README.md, regenerated from every round's machine.txt summary and steps.tsv.
readme() {
  {
    echo "# GPU checks: $(basename "$FOLDER")"
    echo
    echo "Written by \`scripts/gpu_check.sh\` (regenerated after every step, and by its \`--readme\`;"
    echo "do not edit by hand: the prose that quotes these files goes in docs/PERFORMANCE.md). Each"
    echo "round's folder holds \`machine.txt\` (the machine and versions in full), \`steps.tsv\`,"
    echo "\`log.txt\` (all output) and the reports. Exit 124 = the step hit its time cap; a verdict"
    echo "is the comparing script's (scripts/compare_losses.py, plan_vs_measured.py, compare_precision.py)."
    for r in $(ls "$FOLDER" | sort -V); do
      dir=$FOLDER/$r
      [ -f "$dir/steps.tsv" ] || continue
      echo
      echo "## Round \`$r\`"
      echo
      sed -n 's/^summary: /- /p' "$dir/machine.txt" 2> /dev/null
      echo
      echo "| n | start s | seconds | cap s | exit | verdict | step | command |"
      echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
      tail -n +2 "$dir/steps.tsv" | while IFS=$'\t' read -r i s secs cap rc verdict name cmd; do
        echo "| $i | $s | $secs | $cap | $rc | $verdict | $name | \`$cmd\` |"
      done
    done
  } > "$FOLDER/README.md.tmp" && mv "$FOLDER/README.md.tmp" "$FOLDER/README.md"
}

if [ "${1:-}" = --readme ]; then
  FOLDER=${2:-}
  [ -d "$FOLDER" ] || die "--readme needs the folder of a run, e.g. docs/gpu/2026-11-26-h200"
  readme
  echo "gpu_check.sh: wrote $FOLDER/README.md"
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BIN=${1:-target/release/archipelago}
OUT_ARG=${2:-auto}
ROUND=${3:-first}

case "$ROUND" in first | parallel | memory | calibrate | precision | tensor) ;; *) die "unknown round '$ROUND' (first, parallel, memory, calibrate, precision or tensor)";; esac
[ -x "$BIN" ] || die "no executable archipelago binary at '$BIN' (build it with --features cuda and carry it)"
BIN=$(cd "$(dirname "$BIN")" && pwd)/$(basename "$BIN")
command -v nvidia-smi > /dev/null \
  || die "nvidia-smi not found: this machine shows no NVIDIA GPU (no driver). The checks need one; nothing was run or written."
gpu_names=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>&1) \
  || die "nvidia-smi found no usable NVIDIA GPU: ${gpu_names:-no output}. Nothing was run or written."
card_name=$(printf '%s\n' "$gpu_names" | head -1)
[ -n "$card_name" ] || die "nvidia-smi lists no GPU. Nothing was run or written."
gpu_count=$(printf '%s\n' "$gpu_names" | grep -c .)
card=$(printf '%s' "$card_name" | tr 'A-Z' 'a-z' | sed -e 's/nvidia//g' -e 's/[^a-z0-9]\{1,\}/-/g' -e 's/^-//' -e 's/-$//')
[ "$gpu_count" -gt 1 ] && card="$card-x$gpu_count"
DATE=$(date -u +%F)
case "$OUT_ARG" in
  "" | auto) FOLDER=${GPU_CHECK_ROOT:-$ROOT/docs/gpu}/$DATE-$card ;;
  *) FOLDER=$OUT_ARG ;;
esac
mkdir -p "$FOLDER" || die "cannot make $FOLDER"
FOLDER=$(cd "$FOLDER" && pwd)
RUN=$(date -u +%H%M)-$ROUND
n=2
while [ -e "$FOLDER/$RUN" ]; do RUN=$(date -u +%H%M)-$ROUND-$n; n=$((n + 1)); done
OUTDIR=$FOLDER/$RUN
mkdir -p "$OUTDIR"
COMMIT=${GPU_CHECK_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo unknown)}
DIRTY=$(git -C "$ROOT" status --porcelain --untracked-files=no 2> /dev/null | grep -c . || true)
started=$(date +%s)
STARTED_UTC=$(date -u '+%F %T UTC')
printf 'n\tstart_s\tseconds\tcap_s\texit\tverdict\tname\tcommand\n' > "$OUTDIR/steps.tsv"

bundle() {
  readme
  if [ -n "${GPU_CHECK_BUNDLE:-}" ]; then
    tar -czf "$GPU_CHECK_BUNDLE.tmp" -C "$(dirname "$FOLDER")" "$(basename "$FOLDER")" \
      && mv "$GPU_CHECK_BUNDLE.tmp" "$GPU_CHECK_BUNDLE"
  fi
}

# run NAME CAP_S [--stdout FILE] -- CMD...: one step under `timeout`, its line in steps.tsv.
steps=0
run() {
  local name=$1 cap=$2 file="" t0 rc verdict
  shift 2
  if [ "$1" = --stdout ]; then file=$2; shift 2; fi
  [ "$1" = -- ] && shift
  steps=$((steps + 1))
  t0=$(date +%s)
  echo
  echo "=== [$((t0 - started)) s] $name (cap ${cap} s)"
  echo "\$ $*${file:+ > $(basename "$file")}"
  if [ -n "$file" ]; then
    timeout -k 10 "$cap" "$@" | tee "$file"
    rc=${PIPESTATUS[0]}
  else
    timeout -k 10 "$cap" "$@"
    rc=$?
  fi
  verdict=-
  case "$name" in compare*) verdict=$([ "$rc" = 0 ] && echo PASS || echo FAIL) ;; esac
  [ "$rc" = 124 ] && echo "gpu_check.sh: '$name' hit its cap of $cap s"
  local cmd="$*"
  cmd=${cmd//"$BIN"/BIN}
  cmd=${cmd//"$OUTDIR/"/}
  cmd=${cmd//"$ROOT/"/}
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$steps" "$((t0 - started))" "$(($(date +%s) - t0))" \
    "$cap" "$rc" "$verdict" "$name" "$cmd${file:+ > $(basename "$file")}" >> "$OUTDIR/steps.tsv"
  bundle
  return "$rc"
}

exec 3>&1 4>&2
exec > >(tee "$OUTDIR/log.txt") 2>&1
tee_pid=$!
echo "gpu_check.sh: round $ROUND into $OUTDIR (started $STARTED_UTC)"

export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
nvrtc=$(ldconfig -p 2> /dev/null | awk '/libnvrtc\.so/ {print $NF; exit}')
if [ -z "$nvrtc" ]; then
  nvrtc=$(find "$CUDA_PATH/" /usr/local /opt -name 'libnvrtc.so*' 2> /dev/null | head -1)
  [ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export RUST_BACKTRACE=1

# The machine, in full, before anything runs (the README's summary lines start with "summary: ").
{
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader | head -1)
  cuda=$(nvidia-smi 2> /dev/null | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
  cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
  memtotal=$(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)
  os=$(. /etc/os-release 2> /dev/null && echo "$PRETTY_NAME")
  torch=$(timeout 60 python3 -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2> /dev/null || echo "not importable")
  sha=$(sha256sum "$BIN" | cut -d' ' -f1)
  echo "summary: started $STARTED_UTC, round \`$ROUND\`, folder \`$RUN/\`"
  echo "summary: GPU: $gpu_count × $card_name, $mem, driver $driver, CUDA (driver) ${cuda:-?}"
  echo "summary: host: $(nproc) CPU cores of ${cpu:-?}, $memtotal, ${os:-?}, kernel $(uname -r)"
  echo "summary: git commit $COMMIT$([ "${DIRTY:-0}" -gt 0 ] 2> /dev/null && echo " ($DIRTY tracked files changed)"); binary sha256 $sha ($("$BIN" --version 2>&1 | head -1))"
  echo "summary: python3 $(python3 -c 'import platform; print(platform.python_version())' 2>&1), torch $torch; nvrtc ${nvrtc:-not found}; CUDA_PATH $CUDA_PATH$([ -d "$CUDA_PATH/include" ] || echo ' (no include dir)')"
  echo
  echo "binary: $BIN"
  echo "nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,pci.bus_id:"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm,pci.bus_id --format=csv
  echo
  nvidia-smi
  echo
  nvcc --version 2> /dev/null || echo "nvcc: not on PATH"
} > "$OUTDIR/machine.txt" 2>&1
cat "$OUTDIR/machine.txt"
bundle

run devices 30 -- "$BIN" devices
run "devices --json" 30 --stdout "$OUTDIR/devices.json" -- "$BIN" devices --json

big=gpt:vocab=256,ctx=1024,d=1024,layers=12,heads=16
if [ "$ROUND" = memory ]; then
  # The device's own memory pool against the plan's estimate (the `device memory pool` lines and
  # each report's actors[].device_memory).
  one="--devices cuda:0"
  i=0
  for job in "gpt-tiny $one --state host" "gpt-tiny $one --state device" \
      "gpt-tiny --dp 2 --devices cuda:0,cuda:0" "$big $one --batch 8 --state device" \
      "$big $one --batch 8 --state device --checkpoint-activations" "$big $one --batch 8 --state host"; do
    i=$((i + 1))
    set -- $job
    model=$1
    shift
    run "train $job, 4 steps" 60 -- "$BIN" train --model "$model" --steps 4 "$@" \
      --report "$OUTDIR/memory_$i.json"
  done
elif [ "$ROUND" = calibrate ]; then
  # The cost model calibrated on the device (issue 46): `plan --rate measure` times a few steps of
  # the model on one actor of the GPU, then the same layout trains and the plan's predicted step is
  # compared with the measured median step (scripts/plan_vs_measured.py: PASS within 20 %).
  i=0
  for job in "gpt-tiny --devices cuda:0" "gpt-tiny --dp 2 --devices cuda:0,cuda:0" \
      "gpt-tiny --pp 2 --microbatches 4 --devices cuda:0,cuda:0" "$big --devices cuda:0 --batch 8"; do
    i=$((i + 1))
    set -- $job
    model=$1
    shift
    run "plan --rate measure $job" 90 --stdout "$OUTDIR/plan_$i.json" -- \
      "$BIN" plan --model "$model" "$@" --rate measure --json
    run "train $job, 12 steps" 90 -- "$BIN" train --model "$model" "$@" --steps 12 \
      --report "$OUTDIR/train_$i.json"
    run "compare plan with train: $job" 30 -- \
      python3 "$ROOT/scripts/plan_vs_measured.py" "$OUTDIR/plan_$i.json" "$OUTDIR/train_$i.json"
  done
elif [ "$ROUND" = precision ]; then
  # Mixed precision on the device: `--precision bf16` (a bf16 compute copy of the weights over f32
  # master weights) against f32, gpt-tiny for 60 steps and the 151M gpt for 12. The losses must
  # land on the same curve (scripts/compare_precision.py: the mean of the last steps within 2 %),
  # with another seed and learning rate as the negative control; then the step times beside
  # PyTorch's f32 and autocast bf16 (scripts/precision_summary.py: precision_summary.json).
  for prec in f32 bf16; do
    run "train gpt-tiny, 60 steps on cuda:0, --precision $prec" 60 -- \
      "$BIN" train --devices cuda:0 --model gpt-tiny --steps 60 --precision $prec \
      --report "$OUTDIR/tiny_$prec.json"
  done
  run "compare gpt-tiny bf16 with f32 (mean loss of the last 20 steps)" 30 -- \
    python3 "$ROOT/scripts/compare_precision.py" "$OUTDIR/tiny_f32.json" "$OUTDIR/tiny_bf16.json" \
    --within 0.02 --last 20
  run "train gpt-tiny, 60 steps on cuda:0, f32, seed 1, lr 3e-3 (the negative control)" 60 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 60 --seed 1 --lr 3e-3 \
    --report "$OUTDIR/tiny_control.json"
  run "compare seed 1, lr 3e-3 with f32 (the negative control: must differ)" 30 -- \
    python3 "$ROOT/scripts/compare_precision.py" "$OUTDIR/tiny_f32.json" "$OUTDIR/tiny_control.json" \
    --within 0.02 --last 20 --expect-differ
  for prec in f32 bf16; do
    run "train the 151M gpt, 12 steps on cuda:0, --precision $prec" 90 -- \
      "$BIN" train --devices cuda:0 --model "$big" --batch 8 --steps 12 --precision $prec \
      --report "$OUTDIR/big_$prec.json"
  done
  run "compare the 151M gpt bf16 with f32 (mean loss of the last 6 steps)" 30 -- \
    python3 "$ROOT/scripts/compare_precision.py" "$OUTDIR/big_f32.json" "$OUTDIR/big_bf16.json" \
    --within 0.02 --last 6
  run "PyTorch reference on cuda, tf32 off" 80 --stdout "$OUTDIR/torch_cuda_tf32_off.jsonl" -- \
    env PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/torch_reference.py" --device cuda \
    --models gpt-tiny,gpt-151m --tf32 off
  run "PyTorch reference on cuda, autocast bf16" 80 --stdout "$OUTDIR/torch_cuda_autocast_bf16.jsonl" -- \
    env PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/torch_reference.py" --device cuda \
    --models gpt-tiny,gpt-151m --tf32 off --autocast bf16
  run "precision summary: median steps, ours and PyTorch's, f32 and bf16" 30 -- \
    python3 "$ROOT/scripts/precision_summary.py" "$OUTDIR/."
elif [ "$ROUND" = tensor ]; then
  # Tensor parallelism (issue 39): tp=2 with two actors on cuda:0 against dp=1 there (and against
  # the same plan on cpu:0,cpu:1), tp × dp, bf16; then what the host-memory collectives cost per
  # step for gpt-tiny and the 151M gpt (scripts/tp_summary.py: tp_tiny.json, tp_big.json).
  two=cuda:0,cuda:0
  run "train gpt-tiny, 10 steps on cuda:0 (the one-device reference)" 60 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 10 --report "$OUTDIR/one.json"
  run "train gpt-tiny, 10 steps on cuda:0, seed 8 (the negative control)" 60 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 10 --seed 8 --report "$OUTDIR/seed8.json"
  run "compare seed 8 with seed 1 (must differ)" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/seed8.json" "$OUTDIR/one.json" --expect-differ
  run "train gpt-tiny, 10 steps, --tp 2 on $two" 60 -- "$BIN" train --devices $two \
    --model gpt-tiny --steps 10 --tp 2 --report "$OUTDIR/tp2.json"
  run "train gpt-tiny, 10 steps, --tp 2 on cpu:0,cpu:1" 120 -- "$BIN" train --devices cpu:0,cpu:1 \
    --model gpt-tiny --steps 10 --tp 2 --report "$OUTDIR/cpu_tp2.json"
  run "compare --tp 2: GPU with CPU" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/tp2.json" "$OUTDIR/cpu_tp2.json"
  run "compare --tp 2 with GPU dp=1" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/tp2.json" "$OUTDIR/one.json"
  run "train gpt-tiny, 10 steps, --tp 2 --dp 2 on cuda:0 ×4" 60 -- "$BIN" train \
    --devices cuda:0,cuda:0,cuda:0,cuda:0 --model gpt-tiny --steps 10 --tp 2 --dp 2 \
    --report "$OUTDIR/tp2dp2.json"
  run "compare --tp 2 --dp 2 with GPU dp=1" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/tp2dp2.json" "$OUTDIR/one.json"
  for tp in 1 2; do
    devices=$([ $tp = 1 ] && echo cuda:0 || echo $two)
    run "train gpt-tiny, 10 steps, --tp $tp --precision bf16 on $devices" 60 -- "$BIN" train \
      --devices $devices --model gpt-tiny --steps 10 --tp $tp --precision bf16 \
      --report "$OUTDIR/bf16_tp$tp.json"
  done
  run "compare bf16 --tp 2 with bf16 dp=1 (within 1e-3)" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/bf16_tp2.json" "$OUTDIR/bf16_tp1.json"
  run "what tp=2 costs per step: gpt-tiny" 30 -- \
    python3 "$ROOT/scripts/tp_summary.py" "$OUTDIR/one.json" "$OUTDIR/tp2.json" --json "$OUTDIR/tp_tiny.json"
  run "train the 151M gpt, 6 steps on cuda:0" 90 -- "$BIN" train --devices cuda:0 --model "$big" \
    --batch 8 --steps 6 --report "$OUTDIR/big_one.json"
  run "train the 151M gpt, 6 steps, --tp 2 on $two" 120 -- "$BIN" train --devices $two \
    --model "$big" --batch 8 --steps 6 --tp 2 --report "$OUTDIR/big_tp2.json"
  run "compare the 151M gpt --tp 2 with dp=1" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/big_tp2.json" "$OUTDIR/big_one.json"
  run "what tp=2 costs per step: the 151M gpt" 30 -- \
    python3 "$ROOT/scripts/tp_summary.py" "$OUTDIR/big_one.json" "$OUTDIR/big_tp2.json" --json "$OUTDIR/tp_big.json"
elif [ "$ROUND" = parallel ]; then
  # Parallel plans with two actors on the one GPU (compared with the same flags on cpu:0,cpu:1
  # and with the GPU's dp=1 run), the benchmark in full, the host path's breakdown at 151M, and
  # PyTorch with and without TF32.
  run "train gpt-tiny, 10 steps on cuda:0 (the one-device reference)" 60 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 10 --report "$OUTDIR/one.json"
  run "train gpt-tiny, 10 steps on cuda:0, seed 8 (the negative control)" 60 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 10 --seed 8 --report "$OUTDIR/seed8.json"
  run "compare seed 8 with seed 1 (must differ)" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/seed8.json" "$OUTDIR/one.json" --expect-differ
  for plan in "--dp 2" "--dp 2 --zero 1" "--dp 2 --optimizer sgd --momentum 0.9 --lr 0.05" \
      "--pp 2 --microbatches 4"; do
    name=$(echo "$plan" | tr -d ' -' | tr . _)
    run "train gpt-tiny, 10 steps, $plan on cuda:0,cuda:0" 60 -- "$BIN" train --devices cuda:0,cuda:0 \
      --model gpt-tiny --steps 10 $plan --report "$OUTDIR/par_$name.json"
    run "train gpt-tiny, 10 steps, $plan on cpu:0,cpu:1" 90 -- "$BIN" train --devices cpu:0,cpu:1 \
      --model gpt-tiny --steps 10 $plan --report "$OUTDIR/cpu_$name.json"
    run "compare $plan: GPU with CPU" 30 -- \
      python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/par_$name.json" "$OUTDIR/cpu_$name.json"
    case "$plan" in
      *sgd*) ;; # another update rule: not the Adam reference
      *) run "compare $plan with GPU dp=1" 30 -- \
        python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/par_$name.json" "$OUTDIR/one.json" ;;
    esac
  done
  run "bench --device cuda:0 (state as --state auto places it)" 150 -- \
    "$BIN" bench --device cuda:0 --json "$OUTDIR/bench_gpu_full.json"
  run "train the 151M gpt, 4 steps, --state host (where the host path's time goes)" 60 -- \
    "$BIN" train --devices cuda:0 --model "$big" --batch 8 --steps 4 --state host \
    --report "$OUTDIR/gpt151_host.json"
  for tf32 in off on; do
    run "PyTorch reference on cuda, tf32 $tf32" 80 --stdout "$OUTDIR/torch_cuda_tf32_$tf32.jsonl" -- \
      env PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/torch_reference.py" --device cuda \
      --models gpt-tiny,gpt-151m --tf32 $tf32
  done
  # The mixed-precision peer (issue 38): PyTorch's autocast bf16 and f16 (GradScaler), TF32 off.
  for amp in bf16 f16; do
    run "PyTorch reference on cuda, autocast $amp" 80 --stdout "$OUTDIR/torch_cuda_autocast_$amp.jsonl" -- \
      env PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/torch_reference.py" --device cuda \
      --models gpt-tiny,gpt-151m --tf32 off --autocast $amp
  done
else
  run "train mlp-8x1024, 5 steps on cuda:0 (smoke)" 60 -- \
    "$BIN" train --devices cuda:0 --model mlp-8x1024 --steps 5 --report "$OUTDIR/mlp_cuda.json"
  run "train gpt-tiny, 20 steps on cuda:0, state on the host" 120 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 20 --state host --report "$OUTDIR/gpt_cuda_host.json"
  run "train gpt-tiny, 20 steps on cpu:0 (the reference for the two GPU runs)" 120 -- \
    "$BIN" train --devices cpu:0 --model gpt-tiny --steps 20 --report "$OUTDIR/gpt_cpu.json"
  run "compare GPU (state on the host) with CPU" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/gpt_cuda_host.json" "$OUTDIR/gpt_cpu.json"
  run "train gpt-tiny, 20 steps on cuda:0, state on the device" 80 -- \
    "$BIN" train --devices cuda:0 --model gpt-tiny --steps 20 --state device --report "$OUTDIR/gpt_cuda_device.json"
  run "compare GPU (state on the device) with CPU" 30 -- \
    python3 "$ROOT/scripts/compare_losses.py" "$OUTDIR/gpt_cuda_device.json" "$OUTDIR/gpt_cpu.json"
  run "bench --device cuda:0 --quick (gpt-tiny and the 151M gpt)" 150 -- \
    "$BIN" bench --device cuda:0 --quick --json "$OUTDIR/bench_gpu.json"
  run "PyTorch reference on cuda, tf32 off" 80 --stdout "$OUTDIR/torch_cuda.jsonl" -- \
    env PYTHONUNBUFFERED=1 python3 "$ROOT/scripts/torch_reference.py" --device cuda \
    --models gpt-tiny,gpt-151m --tf32 off --warmup 2 --timed 5
fi

failed=$(tail -n +2 "$OUTDIR/steps.tsv" | awk -F'\t' '$5 != 0' | wc -l)
echo
echo "=== [$(($(date +%s) - started)) s] done: $steps steps, $failed with a non-zero exit; evidence in $OUTDIR"
[ -n "${GPU_CHECK_BUNDLE:-}" ] && echo "bundle: $GPU_CHECK_BUNDLE (tar -xzf it -C docs/gpu/)"
exec 1>&3 2>&4
wait "$tee_pid" 2> /dev/null
bundle
[ "$failed" = 0 ]
