#!/usr/bin/env bash
# Runs across separate processes on 127.0.0.1, with one `archipelago controller`; everything is
# stopped when the script ends. From the repository root:
#
#   bash examples/multi_host.sh                    # a training job: three `archipelago host`s (one
#                                                  # CPU device each, two islands) and a client that
#                                                  # submits a dp=3 job with checkpoints
#   bash examples/multi_host.sh EXAMPLE [ARGS...]  # a program on the runtime API: two hosts of the
#                                                  # example's own binary (ARCHIPELAGO_ROLE=host),
#                                                  # then the same binary as the driver, e.g.
#       bash examples/multi_host.sh actors_cluster
#       bash examples/multi_host.sh parameter_server 0
#       bash examples/multi_host.sh trial_search --quick
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

if [ $# -gt 0 ]; then
    example=$1
    shift
    # Devices per host: the parameter server runs 2 servers and 4 workers, one device each.
    case "$example" in
        parameter_server) devices=cpu:0,cpu:1,cpu:2 ;;
        *) devices=cpu:0,cpu:1 ;;
    esac
    cargo build -q -p archipelago-examples --example "$example"
    program="target/debug/examples/$example"
    for h in h1 h2; do
        ARCHIPELAGO_ROLE=host ARCHIPELAGO_DEVICES="$devices" ARCHIPELAGO_HOST_NAME="$h" \
            "$program" > "$work/$h.out" 2> "$work/$h.log" &
        pids+=($!)
    done
    for h in h1 h2; do
        until grep -q "serves actors" "$work/$h.out" 2>/dev/null; do sleep 0.1; done
        cat "$work/$h.out"
    done
    # The driver: the same binary with ARCHIPELAGO_CONTROLLER and ARCHIPELAGO_TOKEN_FILE set.
    "$program" "$@"
    exit
fi

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
