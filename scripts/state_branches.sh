#!/usr/bin/env bash
# Lists the places in the trainer (actors/src/trainer/) that branch on the ZeRO stage, the
# offload tier or where the state lives, outside the store implementations (issue 37's count).
# Usage: scripts/state_branches.sh [REV]  (a git revision; the working tree without one).
# The store implementations: store.rs, store_device.rs, store_offload.rs and the device state's
# own files (device_state.rs, device_lamb.rs, cpu_buffers.rs). Comments are not counted.
set -euo pipefail
cd "$(dirname "$0")/.."
rev="${1:-}"
pattern='shards_parameters|shards_optimizer|shards_gradients|ZeroStage::|\.zero\b|offload_params|params_in_tier|state\.offload\b|offload\(\)|offload_mut\(\)|\bdevice_state\b|\.device\(\)|device_mut\(\)|Store::|StatePlacement::|holds_whole|held\.len\(\) == |held_mut'
store='^(store|store_device|store_offload|device_state|device_lamb|cpu_buffers)\.rs$'
files() {
  if [ -n "$rev" ]; then git ls-tree --name-only "$rev" actors/src/trainer/; else ls actors/src/trainer/*.rs; fi
}
show() { if [ -n "$rev" ]; then git show "$rev:$1"; else cat "$1"; fi; }
total=0
for f in $(files); do
  base=$(basename "$f")
  [[ "$base" =~ $store ]] && continue
  hits=$(show "$f" | grep -nE "$pattern" | grep -vE '^[0-9]+:\s*//' | grep -vE '^[0-9]+:\s*(use|pub use|mod) ' || true)
  [ -z "$hits" ] && continue
  n=$(printf '%s\n' "$hits" | wc -l)
  total=$((total + n))
  printf '%s (%d)\n' "$f" "$n"
  printf '%s\n' "$hits" | sed 's/^/    /'
done
echo "total: $total"
