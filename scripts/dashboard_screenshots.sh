#!/usr/bin/env bash
# The dashboard's screenshots (docs/dashboard/running.png, failed.png, restarted.png), taken
# with headless Chromium at 1280×1000 against real processes on 127.0.0.1:
#  - running:   `archipelago train --dashboard` (dp=2 × pp=2 in this process, cosine schedule);
#  - failed:    an `archipelago controller --dashboard` with two hosts (h1, h2: cpu:0,cpu:1
#               each) running a dp=2 × pp=2 job submitted with `train --controller`; h2 is
#               SIGKILLed mid-run and the job fails;
#  - restarted: the same with `--restart on-failure`: the job re-plans on h1 (dp=1 × pp=2) and
#               goes on from the last checkpoint.
#
#   scripts/dashboard_screenshots.sh [BINARY] [OUT_DIR]
#
# Every process it starts is killed (by its pid) when it ends.
set -euo pipefail
bin=${1:-target/debug/archipelago} out=${2:-docs/dashboard}
mkdir -p "$out"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
model=mlp:in=64,hidden=256,layers=6,out=10
job=(--model "$model" --dp 2 --pp 2 --microbatches 4 --lr-schedule cosine --warmup-steps 100 --quiet)

# The first match of sed expression $2 in file $1, waited for.
line_of() {
  for _ in $(seq 1 600); do
    local found
    found=$(sed -n "$2" "$1" | head -1)
    [[ -n $found ]] && { echo "$found"; return; }
    sleep 0.1
  done
  echo "no match of $2 in $1" >&2
  exit 1
}
dashboard_of() { line_of "$1" 's|.*dashboard at http://\([^/]*\)/.*|\1|p'; }
# Waits until jq condition $3 holds on the dashboard $1's endpoint $2 (what: $4).
wait_for() {
  for _ in $(seq 1 1200); do
    [[ $(curl -sf "http://$1$2" | jq -r "$3" 2>/dev/null) == true ]] && return
    sleep 0.2
  done
  echo "timed out waiting for $4" >&2
  exit 1
}
shot() {
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1000 \
    --screenshot="$out/$2" "http://$1/" 2>/dev/null
  echo "wrote $out/$2"
}

# A controller with a dashboard and hosts h1 and h2; sets ctl, dash and h2 (its pid).
cluster() {
  echo "screenshot-token-$RANDOM" >"$work/token"
  "$bin" controller --listen 127.0.0.1:0 --token-file "$work/token" --host-timeout-s 5 \
    --wait-for-hosts-s 2 --dashboard 127.0.0.1:0 >"$work/$1-controller.out" 2>/dev/null &
  pids+=($!)
  ctl=$(line_of "$work/$1-controller.out" 's/.*controller listening on \(.*\)/\1/p')
  dash=$(dashboard_of "$work/$1-controller.out")
  for h in h1 h2; do
    "$bin" host --controller "$ctl" --token-file "$work/token" --devices cpu:0,cpu:1 \
      --name "$h" --island "island-$h" --heartbeat-ms 200 >/dev/null 2>&1 &
    pids+=($!)
  done
  h2=$!
  wait_for "$dash" /api/cluster 'map(select(.state == "live")) | length == 2' "two hosts"
}
submit() { # name, extra train flags…
  local name=$1
  shift
  "$bin" train --controller "$ctl" --token-file "$work/token" "${job[@]}" "$@" \
    >"$work/$name-train.out" 2>&1 &
  pids+=($!)
}

# Running.
"$bin" train "${job[@]}" --steps 3000 --dashboard 127.0.0.1:0 >"$work/train.out" 2>/dev/null &
pids+=($!)
dash=$(dashboard_of "$work/train.out")
wait_for "$dash" /api/job '.step >= 600' "step 600"
shot "$dash" running.png
kill "${pids[-1]}"

# Failed: h2 killed, no restart.
cluster failed
submit failed --steps 3000
wait_for "$dash" /api/job '.step >= 400' "step 400 of the failing job"
kill -KILL "$h2"
wait_for "$dash" /api/job '.state == "failed"' "the job's failure"
shot "$dash" failed.png

# Restarted: h2 killed, the job goes on on h1.
cluster restarted
submit restarted --steps 1500 --restart on-failure --checkpoint-dir "$work/checkpoints" \
  --checkpoint-every 100
wait_for "$dash" /api/job '.step >= 450' "step 450 of the restarting job"
kill -KILL "$h2"
wait_for "$dash" /api/job '(.restarts | length) == 1 and .restarts[0].resumed_at_step != null
  and .step >= .restarts[0].after_step + 300' "300 steps after the restart"
shot "$dash" restarted.png
