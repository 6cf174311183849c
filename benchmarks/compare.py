"""Before/after: the issue workloads on two git revisions, interleaved, in fresh processes.

    python benchmarks/compare.py 3906a61              # that revision against the work tree
    python benchmarks/compare.py 3906a61 --rounds 5 --n 16384 --heads 8

On a shared machine the speed drifts by tens of percent within minutes, so a table of
absolute times from two sessions compares machines, not code.  This script checks the
old revision out into a temporary ``git worktree``, then runs every case on the old and
the new code alternately (``--rounds`` times, each run a fresh process: best of 3 calls
after a warm-up), and reports the median per side and their ratio.  The cases are the
NumPy workloads of the performance issues (kernel, Performer, Nyström, blockwise exact),
all of shape ``(heads, n, 64)`` float32.  Writes ``results/compare.md`` (``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: name -> expression on q, k, v (arrayattn imported as aa)
CASES = {
    "linear elu+1, non-causal": "aa.linear_attention(q, k, v)",
    "linear elu+1, causal chunked": "aa.linear_attention(q, k, v, causal=True)",
    "performer positive m=256, non-causal": "aa.performer_attention(q, k, v)",
    "performer positive m=256, causal": "aa.performer_attention(q, k, v, causal=True)",
    "nystrom m=64, iterative pinv": "aa.nystrom_attention(q, k, v, num_landmarks=64)",
    "nystrom m=64, svd pinv": "aa.nystrom_attention(q, k, v, num_landmarks=64, pinv='svd')",
    "nystrom m=64, iterative, 10% padding (key + query mask)":
        "aa.nystrom_attention(q, k, v, num_landmarks=64, key_mask=pad, query_mask=pad)",
    "softmax blockwise (block 512), n/4 tokens":
        "aa.softmax_attention(q[..., :n4, :], k[..., :n4, :], v[..., :n4, :], block_size=512)",
}

_CHILD = r"""
import json, sys, time
sys.path.insert(0, REPO)
import numpy as np
import arrayattn as aa
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((HEADS, N, 64), dtype=np.float32) for _ in range(3))
n4 = max(1, N // 4)
pad = rng.random((HEADS, N)) < 0.9
sync = lambda x: x
if BACKEND == "torch":
    import torch
    q, k, v, pad = (torch.asarray(x) for x in (q, k, v, pad))
elif BACKEND == "jax":
    import jax.numpy as jnp
    q, k, v, pad = (jnp.asarray(x) for x in (q, k, v, pad))
    sync = lambda x: x.block_until_ready()
out = {}
for name, expr in CASES.items():
    g = eval("lambda: " + expr)
    f = lambda: sync(g())
    f()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    out[name] = min(times)
print(json.dumps(out))
"""


def _run(repo: str, cases: dict, n: int, heads: int, backend: str = "numpy") -> dict:
    head = (f"REPO = {repo!r}\nCASES = {cases!r}\nN = {n}\nHEADS = {heads}\n"
            f"BACKEND = {backend!r}\n")
    res = subprocess.run([sys.executable, "-c", head + _CHILD], capture_output=True,
                         text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the old git revision")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--backend", default="numpy", choices=("numpy", "torch", "jax"),
                    help="the inputs' library (torch and JAX run eagerly on the CPU)")
    args = ap.parse_args(argv)
    cases = {k: v for k, v in CASES.items()
             if not args.cases or any(s in k for s in args.cases.split(","))}
    times: dict = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as tmp:
        old = os.path.join(tmp, "old")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", old,
                        args.base], check=True)
        try:
            for _ in range(args.rounds):
                for side, repo in (("before", old), ("after", ROOT)):
                    for name, t in _run(repo, cases, args.n, args.heads,
                                        args.backend).items():
                        times[side].setdefault(name, []).append(t)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old],
                           check=False)
    lines = [f"Before = {args.base}, after = the work tree; {args.backend} float32, "
             f"({args.heads}, "
             f"{args.n}, 64); median over {args.rounds} interleaved rounds of the best of "
             "3 calls.", "", "| case | before (ms) | after (ms) | speed-up |",
             "|---|---:|---:|---:|"]
    for name in cases:
        b = statistics.median(times["before"][name]) * 1e3
        a = statistics.median(times["after"][name]) * 1e3
        lines.append(f"| {name} | {b:.1f} | {a:.1f} | {b / a:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "compare.json"), "w") as fh:
        json.dump({"base": args.base, "n": args.n, "heads": args.heads,
                   "backend": args.backend, "seconds": times},
                  fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
