#!/usr/bin/env python3
"""What tensor parallelism costs per step (issue 39), from `archipelago train --report` files:
one device (`ONE`) against a tp plan (`TP`) of the same model and batch. For each it prints
(and writes, with --json) the median step, and for the tp run, per actor, the seconds of its
tensor-parallel collectives (the medians of every all-reduce and wait on g's activations
`act.*`, f's gradients `dact.*`, the loss statistics `lossmax.*`/`losssums.*` and the replicated
gradients `tpgrad.*`, summed over the step), the fabric bytes it read of the `tensor_parallel`
kind against the plan's prediction, and the step's host ⇄ device bytes of activations (on a GPU
the collectives go through host memory: each all-reduced activation leaves the device and comes
back). Standard library only."""

import argparse
import json
import re
import sys

TP_TENSOR = re.compile(r"^(AllReduceSum|AllReduceMax|Wait)\((act|dact|lossmax|losssums|tpgrad)\.")


def load(path):
    with open(path) as f:
        return json.load(f)


def tp_collective_s(actor):
    return sum(i["median_s"] for i in actor.get("instructions", []) if TP_TENSOR.match(i["instruction"]))


def median(values):
    v = sorted(values)
    n = len(v)
    return (v[n // 2] + v[(n - 1) // 2]) / 2 if n else float("nan")


def step_transfers(report, kind):
    # The last step's (the first may carry set-up transfers).
    steps = report.get("steps", [])
    if not steps:
        return None
    t = steps[-1].get("transfers", {}).get(kind, {})
    return {"to_device": t.get("to_device", 0), "to_host": t.get("to_host", 0)}


def summary(one, tp):
    actors = []
    for a in tp["actors"]:
        fabric = a.get("fabric_bytes_per_step", {}).get("tensor_parallel")
        predicted = a.get("predicted_fabric_bytes_per_step", {}).get("tensor_parallel")
        actors.append(
            {
                "actor": a["actor"],
                "device": a["device"],
                "compute_s": a.get("compute_s"),
                "comm_wait_s": a.get("comm_wait_s"),
                "tp_collective_s": tp_collective_s(a),
                "tp_fabric_bytes_per_step": fabric,
                "predicted_tp_fabric_bytes_per_step": predicted,
            }
        )
    one_s, tp_s = one["median_step_s"], tp["median_step_s"]
    return {
        "model": tp["model"],
        "one_device": {"median_step_s": one_s, "tokens_per_s": one.get("tokens_per_s")},
        "tp": {
            "plan": tp.get("plan"),
            "median_step_s": tp_s,
            "tokens_per_s": tp.get("tokens_per_s"),
            "activation_transfers_last_step": step_transfers(tp, "activations"),
            "actors": actors,
            "median_tp_collective_s": median([a["tp_collective_s"] for a in actors]),
        },
        "tp_step_over_one_device": tp_s / one_s if one_s else None,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("one")
    p.add_argument("tp")
    p.add_argument("--json")
    args = p.parse_args()
    s = summary(load(args.one), load(args.tp))
    tp = s["tp"]
    print(f"{s['model']}: one device {s['one_device']['median_step_s']:.4f} s/step, "
          f"tp {tp['median_step_s']:.4f} s/step ({s['tp_step_over_one_device']:.2f}x)")
    for a in tp["actors"]:
        print(f"  actor {a['actor']} ({a['device']}): tp collectives {a['tp_collective_s']:.4f} s/step, "
              f"tp fabric {a['tp_fabric_bytes_per_step']} B/step (plan {a['predicted_tp_fabric_bytes_per_step']})")
    print(f"  activations host<->device, last step: {tp['activation_transfers_last_step']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
