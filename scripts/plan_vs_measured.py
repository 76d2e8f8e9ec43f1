#!/usr/bin/env python3
"""Compares `archipelago plan --json`'s predicted step with the step a `train --report` measured.

    python3 scripts/plan_vs_measured.py PLAN.json REPORT.json [--within 0.2]

Prints the plan's calibrated rates, the predicted step, the report's median step (the median over
its steps, so the first, warm-up step does not count) and their ratio; exits 1 when the prediction
is off the measured step by more than --within (a fraction, 0.2 = 20 %), 2 on unreadable input.
Performance II (issue 46) asks of a lent GPU that the plan, calibrated on the device
(`plan --rate measure`), predicts the measured step within 20 %. Standard library only.
"""
import argparse
import json
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan")
    parser.add_argument("report")
    parser.add_argument("--within", type=float, default=0.2)
    args = parser.parse_args()
    try:
        with open(args.plan) as f:
            plan = json.load(f)
        with open(args.report) as f:
            report = json.load(f)
        predicted = float(plan["prediction"]["step_s"])
        measured = float(report["median_step_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plan_vs_measured.py: cannot read the plan's prediction or the report's step: {e}")
        return 2
    rates = plan.get("program", {}).get("cost_model") or {}
    if rates:
        print(
            "rates: {:.3g} GFLOP/s forward, backward {:.2f}x forward, optimizer {:.3g} params/s, "
            "{} compute units".format(
                rates.get("flops_per_s", 0) / 1e9,
                rates.get("backward_over_forward", 0),
                rates.get("optimizer_params_per_s", 0),
                rates.get("compute_units", rates.get("cpu_cores")),
            )
        )
    ratio = predicted / measured if measured > 0 else float("inf")
    ok = abs(ratio - 1.0) <= args.within
    print(
        f"predicted {1e3 * predicted:.2f} ms, measured {1e3 * measured:.2f} ms (median step), "
        f"predicted/measured {ratio:.3f}: {'within' if ok else 'outside'} {100 * args.within:.0f} %"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
