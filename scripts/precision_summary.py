#!/usr/bin/env python3
"""Summarises a `precision` round of scripts/gpu_check.sh: the median step of gpt-tiny and the
151M gpt in f32 and bf16, ours and PyTorch's, in one table, written also as precision_summary.json.

    python3 scripts/precision_summary.py DIR

Reads from DIR our `train --report` files tiny_f32.json, tiny_bf16.json, big_f32.json and
big_bf16.json (their median_step_s: the median over the steps after the first, warm-up one, as
scripts/plan_vs_measured.py reads it) and scripts/torch_reference.py's lines
torch_cuda_tf32_off.jsonl (f32) and torch_cuda_autocast_bf16.jsonl (autocast bf16; their
median_step_s, 5 warm-up + 30 timed steps). Ratios: our bf16 speedup (our f32 step / our bf16
step), PyTorch's the same way, and PyTorch's step over ours in each precision (above 1: ours is
faster). A missing or unreadable file gives "missing" in its cells, never an error: the summary
always exits 0 unless it cannot write its JSON. Standard library only.
"""
import json
import os
import statistics
import sys

MODELS = [("gpt-tiny", "tiny"), ("gpt-151m", "big")]  # the name (torch_reference.py's), our files' prefix
TORCH = {"f32": "torch_cuda_tf32_off.jsonl", "bf16": "torch_cuda_autocast_bf16.jsonl"}


def ours_step(path):
    """Median step seconds of a train report: its median_step_s, else the median of the steps'
    time_s after the first (as the binary computes it); None when unreadable."""
    try:
        with open(path) as f:
            report = json.load(f)
        if report.get("median_step_s") is not None:
            return float(report["median_step_s"])
        times = [float(s["time_s"]) for s in report["steps"]]
        return statistics.median(times[1:] if len(times) > 1 else times)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, statistics.StatisticsError):
        return None


def torch_step(path, model):
    """Median step seconds of the first torch_reference.py line for this model; None if none."""
    try:
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a stray line among the JSON ones
                if isinstance(row, dict) and row.get("model") == model:
                    return float(row["median_step_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def ratio(num, den):
    return num / den if num is not None and den else None


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip())
        return 2
    folder = sys.argv[1]
    rows = {}
    for label, short in MODELS:
        row = {
            "ours_f32_s": ours_step(os.path.join(folder, f"{short}_f32.json")),
            "ours_bf16_s": ours_step(os.path.join(folder, f"{short}_bf16.json")),
            "torch_f32_s": torch_step(os.path.join(folder, TORCH["f32"]), label),
            "torch_bf16_s": torch_step(os.path.join(folder, TORCH["bf16"]), label),
        }
        row["ours_bf16_speedup"] = ratio(row["ours_f32_s"], row["ours_bf16_s"])
        row["torch_bf16_speedup"] = ratio(row["torch_f32_s"], row["torch_bf16_s"])
        row["torch_over_ours_f32"] = ratio(row["torch_f32_s"], row["ours_f32_s"])
        row["torch_over_ours_bf16"] = ratio(row["torch_bf16_s"], row["ours_bf16_s"])
        rows[label] = row

    def ms(x):
        return "missing" if x is None else f"{1e3 * x:.2f}"

    def times(x):
        return "missing" if x is None else f"{x:.2f}x"

    head = ["model", "ours f32 ms", "ours bf16 ms", "ours bf16 speedup", "torch f32 ms",
            "torch bf16 ms", "torch bf16 speedup", "torch/ours f32", "torch/ours bf16"]
    table = [head]
    for label, r in rows.items():
        table.append([label, ms(r["ours_f32_s"]), ms(r["ours_bf16_s"]), times(r["ours_bf16_speedup"]),
                      ms(r["torch_f32_s"]), ms(r["torch_bf16_s"]), times(r["torch_bf16_speedup"]),
                      times(r["torch_over_ours_f32"]), times(r["torch_over_ours_bf16"])])
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    print("median step (ms); speedup = f32 step / bf16 step; torch/ours above 1: ours is faster")
    for line in table:
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))))

    out = os.path.join(folder, "precision_summary.json")
    try:
        with open(out, "w") as f:
            json.dump({"models": rows, "torch_files": TORCH}, f, indent=2)
            f.write("\n")
    except OSError as e:
        print(f"precision_summary.py: cannot write {out}: {e}")
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
