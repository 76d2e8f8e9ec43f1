#!/usr/bin/env bash
# The first-run checks of ../shared/GPU.md on an NVIDIA machine, as one script with a time cap per
# step, so a short device lease gets every answer it can: the GPU and its libraries, a few steps
# of mlp and gpt-tiny on cuda:0 (host state and device state) with their losses compared to the
# same run on cpu:0 (scripts/compare_losses.py: PASS/FAIL at 1e-3), the device benchmark, and the
# PyTorch reference beside it. Each step runs even if an earlier one failed; everything goes to
# OUTDIR (log.txt plus the reports).
#
#   cargo build --release -p archipelago-controller --features cuda    # where the registries are
#   bash scripts/gpu_check.sh target/release/archipelago "$OUT"        # on the GPU machine
#   bash scripts/gpu_check.sh target/release/archipelago "$OUT" parallel   # the second round
#   bash scripts/gpu_check.sh target/release/archipelago "$OUT" memory     # pool vs estimate
set -u
BIN=${1:-target/release/archipelago}
OUTDIR=${2:-/tmp/gpu_check}
mkdir -p "$OUTDIR"
exec > >(tee "$OUTDIR/log.txt") 2>&1
started=$(date +%s)
step() { echo; echo "=== [$(($(date +%s) - started)) s] $*"; }

step "machine"
nvidia-smi -L
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
nproc
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
ls -d "$CUDA_PATH/include" || echo "no CUDA include dir under $CUDA_PATH"
nvrtc=$(ldconfig -p | awk '/libnvrtc\.so/ {print $NF; exit}')
if [ -z "$nvrtc" ]; then
  nvrtc=$(find "$CUDA_PATH/" /usr/local /opt -name 'libnvrtc.so*' 2>/dev/null | head -1)
  [ -n "$nvrtc" ] && export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
echo "nvrtc: ${nvrtc:-not found}"
export RUST_BACKTRACE=1

step "devices"
timeout 30 "$BIN" devices

if [ "${3:-first}" = memory ]; then
  # The device's own memory pool against the plan's estimate (the `device memory pool` lines).
  big=gpt:vocab=256,ctx=1024,d=1024,layers=12,heads=16
  one="--devices cuda:0"
  for run in "gpt-tiny $one --state host" "gpt-tiny $one --state device" \
      "gpt-tiny --dp 2 --devices cuda:0,cuda:0" "$big $one --batch 8 --state device" \
      "$big $one --batch 8 --state device --checkpoint-activations" "$big $one --batch 8 --state host"; do
    step "$run, 4 steps"
    set -- $run
    model=$1; shift
    timeout 60 "$BIN" train --model "$model" --steps 4 "$@" | grep -v '^step'
  done
  step "done"
  exit 0
fi

if [ "${3:-first}" = parallel ]; then
  # Parallel plans with two actors on the one GPU (compare with the same flags on cpu:0,cpu:1),
  # the benchmark in full, the host path's breakdown at 151M, and PyTorch with and without TF32.
  # The compared reports stay out of OUTDIR (a device lease returns at most 8 files); the
  # PASS/FAIL lines are in the log.
  R=$(mktemp -d)
  step "gpt-tiny, 10 steps on cuda:0 (the one-device reference), and with another seed (the control)"
  timeout 60 "$BIN" train --devices cuda:0 --model gpt-tiny --steps 10 --report "$R/one.json" | tail -1
  timeout 60 "$BIN" train --devices cuda:0 --model gpt-tiny --steps 10 --seed 8 \
    --report "$R/seed8.json" | tail -1
  python3 scripts/compare_losses.py "$R/seed8.json" "$R/one.json" --expect-differ
  for plan in "--dp 2" "--dp 2 --zero 1" "--dp 2 --optimizer sgd --momentum 0.9 --lr 0.05" \
      "--pp 2 --microbatches 4"; do
    name=$(echo "$plan" | tr -d ' -' | tr . _)
    step "gpt-tiny, 10 steps, $plan on cuda:0,cuda:0 and on cpu:0,cpu:1"
    timeout 60 "$BIN" train --devices cuda:0,cuda:0 --model gpt-tiny --steps 10 $plan \
      --report "$R/par_$name.json" | tail -3
    timeout 90 "$BIN" train --devices cpu:0,cpu:1 --model gpt-tiny --steps 10 $plan \
      --report "$R/cpu_$name.json" | tail -1
    python3 scripts/compare_losses.py "$R/par_$name.json" "$R/cpu_$name.json"
    case "$plan" in
      *sgd*) ;;  # another update rule: not the Adam reference
      *) python3 scripts/compare_losses.py "$R/par_$name.json" "$R/one.json" ;;
    esac
  done
  step "bench --device cuda:0 (state as --state auto places it)"
  timeout 150 "$BIN" bench --device cuda:0 --json "$OUTDIR/bench_gpu_full.json" | tail -5
  step "the 151M gpt, 4 steps, --state host (where the host path's time goes)"
  timeout 60 "$BIN" train --devices cuda:0 --model gpt:vocab=256,ctx=1024,d=1024,layers=12,heads=16 \
    --batch 8 --steps 4 --state host --report "$OUTDIR/gpt151_host.json" | tail -3
  for tf32 in off on; do
    step "PyTorch reference on cuda, tf32 $tf32"
    PYTHONUNBUFFERED=1 timeout 80 python3 scripts/torch_reference.py --device cuda \
      --models gpt-tiny,gpt-151m --tf32 $tf32 | tee -a "$OUTDIR/torch_cuda.jsonl"
  done
  step "done"
  exit 0
fi

step "mlp-8x1024, 5 steps on cuda:0 (smoke)"
timeout 60 "$BIN" train --devices cuda:0 --model mlp-8x1024 --steps 5 --report "$OUTDIR/mlp_cuda.json"

step "gpt-tiny, 20 steps on cuda:0, state on the host"
timeout 120 "$BIN" train --devices cuda:0 --model gpt-tiny --steps 20 --state host \
  --report "$OUTDIR/gpt_cuda_host.json"

step "gpt-tiny, 20 steps on cpu:0 (the reference for the two GPU runs)"
timeout 120 "$BIN" train --devices cpu:0 --model gpt-tiny --steps 20 --report "$OUTDIR/gpt_cpu.json" | tail -1
python3 scripts/compare_losses.py "$OUTDIR/gpt_cuda_host.json" "$OUTDIR/gpt_cpu.json"

step "gpt-tiny, 20 steps on cuda:0, state on the device"
timeout 80 "$BIN" train --devices cuda:0 --model gpt-tiny --steps 20 --state device \
  --report "$OUTDIR/gpt_cuda_device.json"
python3 scripts/compare_losses.py "$OUTDIR/gpt_cuda_device.json" "$OUTDIR/gpt_cpu.json"

step "bench --device cuda:0 --quick (gpt-tiny and the 151M gpt)"
timeout 150 "$BIN" bench --device cuda:0 --quick --json "$OUTDIR/bench_gpu.json"

step "PyTorch reference on cuda, tf32 off"
PYTHONUNBUFFERED=1 timeout 80 python3 scripts/torch_reference.py --device cuda \
  --models gpt-tiny,gpt-151m --tf32 off --warmup 2 --timed 5 | tee "$OUTDIR/torch_cuda.jsonl"

step "done"
