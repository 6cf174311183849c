"""A/B timing of the sparse family on the NumPy engine across checkouts (issue #39).

    python benchmarks/ab_sparse.py --old /tmp/sp_base_e633 --mid /tmp/sp_base_d36 \\
        [--sizes 4096,16384] [--rounds 2] [--calls 3] [--variants strided,fixed]

For each sparse variant of the registry (``arrayattn.variants(family="sparse")``), each
``n`` and causal flag (every variant plain; ``local`` also causal), the call
``arrayattn.get_variant(name)(q, k, v, causal=...)`` on rng standard-normal
``(1, 8, n, 64)`` float32 inputs is timed in fresh processes, one per checkout, with
``PYTHONPATH`` set to each checkout in turn (old, mid, new, old, mid, new, ...): in each
process one warm-up call, then the best of ``--calls``; a checkout's time is its best
over the rounds.  Only the public registry API present in every revision is used.
The blockwise exact baseline (``softmax_blockwise``, ``block_size="auto"``, same causal
flag) is timed on the new checkout in the same alternation.

Writes ``benchmarks/results/ab_sparse.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = os.path.dirname(HERE)

CHILD = r"""
import json, sys, time
import numpy as np
import arrayattn
name, n, causal, calls = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, n, 64)).astype(np.float32) for _ in range(3))
fn = arrayattn.get_variant(name)
fn(q, k, v, causal=causal)
best = float("inf")
for _ in range(calls):
    t = time.perf_counter()
    fn(q, k, v, causal=causal)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"ms": best * 1e3}))
"""

LIST = r"""
import json, arrayattn
print(json.dumps([[r.name, bool(r.causal)] for r in arrayattn.variants(family="sparse")]))
"""


def child(checkout: str, code: str, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout}
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                         capture_output=True, text=True, check=True, cwd="/tmp")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cases(variants: str | None) -> list:
    listed = child(NEW, LIST)
    want = None if variants is None else set(variants.split(","))
    out = []
    for name, causal in listed:
        if want is not None and name not in want:
            continue
        out.append((name, False))
        if causal and name == "local":
            out.append((name, True))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="/tmp/sp_base_e633")
    ap.add_argument("--mid", default="/tmp/sp_base_d36")
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--variants", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ab_sparse"))
    a = ap.parse_args(argv)
    labels = {"old": a.old, "mid": a.mid, "new": NEW}
    rev = {key: subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"],
                               capture_output=True, text=True).stdout.strip()
           for key, path in labels.items()}
    rows = []
    for n in map(int, a.sizes.split(",")):
        calls = a.calls if n <= 4096 else max(1, a.calls - 2)
        exact = {}
        for name, causal in cases(a.variants):
            best = {key: float("inf") for key in labels}
            for _ in range(a.rounds):
                for key, path in labels.items():
                    ms = child(path, CHILD, name, n, int(causal), calls)["ms"]
                    best[key] = min(best[key], ms)
                if causal not in exact or len(exact[causal]) < a.rounds:
                    exact.setdefault(causal, []).append(
                        child(NEW, CHILD, "softmax_blockwise", n, int(causal), calls)["ms"])
            ex = min(exact[causal])
            row = {"variant": name, "n": n, "causal": causal, **{k: best[k] for k in labels},
                   "exact": ex, "new/old": best["new"] / best["old"],
                   "new/exact": best["new"] / ex}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"revisions": rev, "rows": rows}, f, indent=1)
    head = (f"| variant | n | causal | {rev['old']} ms | {rev['mid']} ms | new ms | "
            f"new/{rev['old']} | new/blockwise exact |")
    lines = ["# Sparse family on the NumPy engine: A/B (issue #39)", "",
             f"`python benchmarks/ab_sparse.py` -- (1, 8, n, 64) float32, registry defaults; "
             f"fresh process per checkout, alternated {a.rounds} rounds, best of "
             f"{a.calls} calls (n > 4096: {max(1, a.calls - 2)}) after a warm-up; new = "
             f"{rev['new']} plus the working tree. Blockwise exact = `softmax_blockwise` "
             f"(block_size=\"auto\") on the new checkout.", "", head,
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['n']} | {r['causal']} | {r['old']:.1f} | "
                     f"{r['mid']:.1f} | {r['new']:.1f} | {r['new/old']:.2f} | "
                     f"{r['new/exact']:.3f} |")
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
