#!/usr/bin/env bash
# Before/after training speed of two `archipelago` binaries in one window: mlp-8x1024 and
# gpt-tiny at dp=1 and dp=2, each configuration run A B A B ... (the binaries alternated, the
# order flipped every pair), the step time of each run read from its report (median_step_s), and
# per configuration the median of the pairs' ratios new/base. The new binary's fabric bytes per
# step (measured and predicted, summed over actors) land in the JSON beside them.
#
#   scripts/ab_train.sh BASE_BINARY NEW_BINARY OUT.json [PAIRS] [STEPS]
#
# Machines here are shared and noisy: quote the median ratio and its range, not one run.
set -euo pipefail
base=$1 new=$2 out=$3 pairs=${4:-4} steps=${5:-12}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
configs=("mlp-8x1024 1" "mlp-8x1024 2" "gpt-tiny 1" "gpt-tiny 2")
run() { # binary model dp report
  "$1" train --model "$2" --dp "$3" --steps "$steps" --quiet --report "$4" >/dev/null
}
for c in "${configs[@]}"; do
  read -r model dp <<<"$c"
  for p in $(seq 1 "$pairs"); do
    if (( p % 2 )); then order="base new"; else order="new base"; fi
    for who in $order; do
      bin=$base; [[ $who == new ]] && bin=$new
      run "$bin" "$model" "$dp" "$work/$model-dp$dp-$p-$who.json"
    done
  done
done
python3 - "$work" "$out" "$pairs" "$steps" "$base" "$new" <<'EOF'
import json, statistics, sys, os
work, out, pairs, steps, base, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
configs = [("mlp-8x1024", 1), ("mlp-8x1024", 2), ("gpt-tiny", 1), ("gpt-tiny", 2)]
result = {"base": base, "new": new, "pairs": pairs, "steps": steps, "configs": []}
def fabric(report, key):
    total = {}
    for a in report["actors"]:
        for k, v in a.get(key, {}).items():
            total[k] = total.get(k, 0) + v
    return total
for model, dp in configs:
    runs = []
    for p in range(1, pairs + 1):
        r = {}
        for who in ("base", "new"):
            with open(os.path.join(work, f"{model}-dp{dp}-{p}-{who}.json")) as f:
                r[who] = json.load(f)
        runs.append(r)
    ratios = [r["new"]["median_step_s"] / r["base"]["median_step_s"] for r in runs]
    last = runs[-1]["new"]
    result["configs"].append({
        "model": model, "dp": dp,
        "base_step_s": [r["base"]["median_step_s"] for r in runs],
        "new_step_s": [r["new"]["median_step_s"] for r in runs],
        "new_over_base": ratios,
        "new_over_base_median": statistics.median(ratios),
        "fabric_bytes_per_step": fabric(last, "fabric_bytes_per_step"),
        "predicted_fabric_bytes_per_step": fabric(last, "predicted_fabric_bytes_per_step"),
        "final_loss": {"base": runs[-1]["base"]["final_loss"], "new": last["final_loss"]},
    })
with open(out, "w") as f:
    json.dump(result, f, indent=2)
for c in result["configs"]:
    print(f'{c["model"]} dp={c["dp"]}: new/base median {c["new_over_base_median"]:.3f} '
          f'(pairs {", ".join(f"{x:.3f}" for x in c["new_over_base"])}); fabric {c["fabric_bytes_per_step"]}')
EOF
