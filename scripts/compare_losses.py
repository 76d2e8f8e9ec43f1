#!/usr/bin/env python3
"""Compares the per-step losses of two `archipelago train --report` files (a GPU run against the
same plan on CPU, or a parallel plan against one device): prints the largest relative
difference and exits 1 when it is over the tolerance (default 1e-3, ../shared/GPU.md's bar;
f32 reduction order alone stays near 1e-5). `--expect-differ` inverts the verdict, for the
negative control (a run that must not match, e.g. another seed)."""

import argparse
import json
import math
import sys


def losses(path):
    with open(path) as f:
        return [s["loss"] for s in json.load(f)["steps"]]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("reference")
    p.add_argument("--tolerance", type=float, default=1e-3)
    p.add_argument("--expect-differ", action="store_true")
    args = p.parse_args()
    a, b = losses(args.run), losses(args.reference)
    n = min(len(a), len(b))
    if n == 0 or any(math.isnan(x) for x in a + b):
        print(f"FAIL: {args.run} vs {args.reference}: no common steps, or a NaN loss")
        return 1
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a[:n], b[:n]))
    # Runs of different lengths compare on their common steps; the shorter must be the reference
    # (a run that stopped early does not match).
    matches = worst <= args.tolerance and len(a) >= len(b)
    ok = matches != args.expect_differ
    what = "differs as it must" if args.expect_differ else "matches"
    verdict = "PASS" if ok else "FAIL"
    short = f"; the run has {len(a)} steps, the reference {len(b)}" if len(a) < len(b) else ""
    print(f"{verdict}: {args.run} vs {args.reference}: {n} steps, max relative loss difference "
          f"{worst:.2e} (tolerance {args.tolerance:g}; expected: {what if ok else 'the opposite'}{short})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
