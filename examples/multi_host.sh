#!/usr/bin/env bash
# A job across separate processes on 127.0.0.1: one `archipelago controller`, three
# `archipelago host`s (one CPU device each, two islands), and a client that submits a dp=3 job
# with checkpoints. Everything is stopped when the script ends.
#
#   bash examples/multi_host.sh            # from the repository root
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q -p archipelago-controller --bin archipelago
bin=target/debug/archipelago
work=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

head -c 24 /dev/urandom | base64 > "$work/token"
export ARCHIPELAGO_TOKEN_FILE="$work/token"

"$bin" controller --listen 127.0.0.1:0 > "$work/controller.out" 2> "$work/controller.log" &
pids+=($!)
until grep -q "listening on" "$work/controller.out" 2>/dev/null; do sleep 0.1; done
export ARCHIPELAGO_CONTROLLER=$(awk '/listening on/ {print $NF}' "$work/controller.out")
echo "controller at $ARCHIPELAGO_CONTROLLER"

for spec in "h1 rack-a" "h2 rack-a" "h3 rack-b"; do
    set -- $spec
    "$bin" host --name "$1" --island "$2" --devices cpu:0 > "$work/$1.out" 2> "$work/$1.log" &
    pids+=($!)
done
for h in h1 h2 h3; do
    until grep -q "registered" "$work/$h.out" 2>/dev/null; do sleep 0.1; done
    cat "$work/$h.out"
done

"$bin" train --model mlp-8x1024 --dp 3 --batch 48 --steps 20 \
    --checkpoint-dir "$work/checkpoints" --checkpoint-every 10 --report "$work/report.json"
ls "$work/checkpoints"
