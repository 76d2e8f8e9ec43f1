#!/usr/bin/env python3
"""Compares where two `archipelago train --report` runs ended up: the mean loss of their last N
steps (default 20). For mixed precision (`--precision bf16` against the same run in f32), whose
per-step losses drift apart too far for scripts/compare_losses.py's 1e-3 bar but should land on
the same curve.

    python3 scripts/compare_precision.py A.json B.json [--within 0.02] [--last 20] [--expect-differ]

Prints both means and the relative difference |b - a| / |a|, then PASS (exit 0) when it is within
the bound, else FAIL (exit 1); 2 on unreadable input. `--expect-differ` inverts the verdict, for
the negative control (a run that must not match, e.g. another seed and learning rate), as
compare_losses.py's does. scripts/gpu_check.sh's `precision` round runs it. Standard library only.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_losses import losses  # noqa: E402  (the same reading of a report's per-step losses)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", help="the run compared against (e.g. f32)")
    p.add_argument("b", help="the run compared (e.g. bf16)")
    p.add_argument("--within", type=float, default=0.02, help="relative bound (0.02 = 2 %%)")
    p.add_argument("--last", type=int, default=20, help="steps averaged at the end of each run")
    p.add_argument("--expect-differ", action="store_true")
    args = p.parse_args()
    try:
        a, b = losses(args.a), losses(args.b)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"FAIL: cannot read the per-step losses of {args.a} or {args.b}: {e!r}")
        return 2
    n = args.last
    if n < 1 or len(a) < n or len(b) < n:
        print(f"FAIL: {args.a} vs {args.b}: need {n} steps in each, have {len(a)} and {len(b)}")
        return 1
    tail_a, tail_b = a[-n:], b[-n:]
    if any(math.isnan(x) or math.isinf(x) for x in tail_a + tail_b):
        print(f"FAIL: {args.a} vs {args.b}: a NaN or infinite loss in the last {n} steps")
        return 1
    mean_a, mean_b = sum(tail_a) / n, sum(tail_b) / n
    rel = abs(mean_b - mean_a) / max(abs(mean_a), 1e-12)
    within = rel <= args.within
    ok = within != args.expect_differ
    verdict = "PASS" if ok else "FAIL"
    expected = "differs as it must" if args.expect_differ else "matches"
    print(f"mean loss of the last {n} steps: {mean_a:.6f} ({args.a}), {mean_b:.6f} ({args.b})")
    print(f"{verdict}: relative difference {rel:.2e} is {'within' if within else 'outside'} "
          f"{args.within:g} (expected: {expected if ok else 'the opposite'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
