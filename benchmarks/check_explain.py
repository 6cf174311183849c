"""The checker's explanation on the tests' zoo of broken kernels (issue #50): for each bug,
the named deviation expected (tests/testing/check/zoo.py: EXPECTED, MORE) against the one
named, and the share right / wrong.  Appends a dated section to
benchmarks/results/check_explain.md.

    python benchmarks/check_explain.py [--budget 10] [--seed 0] [--no-write]
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "testing", "check"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    from zoo import EXPECTED, MORE, ZOO, broken
    from arrayattn.testing import check_kernel

    bugs = [(c, fn, b, EXPECTED[b]) for c, fn, b in ZOO] + list(MORE)
    rows = []
    for conv, fn, bug, expected in bugs:
        t0 = time.monotonic()
        res = check_kernel(broken(fn, bug), conv, budget=args.budget, seed=args.seed)
        took = time.monotonic() - t0
        exp = res.explanation
        named = (exp.names[0] if exp and exp.names else None) if not res.ok else "(not found)"
        rows.append((conv, bug, expected, named, exp.likely if exp else "", exp.dims if exp
                     else "", took))
        print(f"{conv:26s} {bug:26s} expected {expected!s:30s} named {named!s:30s} "
              f"{took:5.1f} s", flush=True)
    with_entry = [r for r in rows if r[2] is not None]
    right = sum(r[3] == r[2] for r in with_entry)
    wrong = sum(r[3] not in (None, r[2], "(not found)") for r in rows)
    found = sum(r[3] != "(not found)" for r in rows)
    summary = (f"{right} of {len(with_entry)} bugs with a catalogue entry named right "
               f"({100 * right / max(len(with_entry), 1):.0f} %); a wrong name on {wrong} of "
               f"{found} findings ({100 * wrong / max(found, 1):.0f} %)")
    print(summary)
    if args.no_write:
        return 0
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=HERE).stdout.strip()
    lines = [f"\n## {datetime.date.today().isoformat()} (commit {rev}; budget "
             f"{args.budget:g} s, seed {args.seed}, default dtypes, CPU)\n", summary + ".\n",
             "| convention | bug | expected | named | likely | dimensions | s |",
             "|---|---|---|---|---|---|---|"]
    for conv, bug, expected, named, likely, dims, took in rows:
        likely, dims = (text.replace("|", "\\|") for text in (likely, dims))
        lines.append(f"| {conv} | {bug} | {expected or '(none)'} | {named or '(none)'} | "
                     f"{likely} | {dims} | {took:.1f} |")
    path = os.path.join(HERE, "results", "check_explain.md")
    head = "" if os.path.exists(path) else (
        "# The checker's explanation on the zoo (benchmarks/check_explain.py)\n\n"
        "Each bug of tests/testing/check/zoo.py (ZOO and MORE) checked; the named deviation "
        "(issue #50) against the one expected (None: no catalogue entry describes the bug, "
        "so `no named deviation matches` is right).\n")
    with open(path, "a") as fh:
        fh.write(head + "\n".join(lines) + "\n")
    print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
