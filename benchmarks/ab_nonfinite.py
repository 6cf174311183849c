"""A/B timing of issue #39's variants on the NumPy engine: several checkouts, alternated.

For each variant name and each ``causal`` setting it takes (``rec.causal``), every round runs
one fresh subprocess per checkout, in the order the checkouts are given (old, ..., new),
with ``PYTHONPATH`` set to that checkout; a subprocess makes rng standard-normal
``(1, 8, n, 64)`` float32 inputs, calls the variant once to warm up, then ``--calls`` times,
and reports the best.  The table gives, per checkout, the best over rounds, and the ratio of
the last checkout to the first.  Only the public registry API is used, which exists in every
revision: ``arrayattn.get_variant(name)(q, k, v, causal=...)``.

    python benchmarks/ab_nonfinite.py --rev e6332e9=/tmp/base_e633 --rev d36ef9c=/tmp/base_d36 \
        --rev new=. --n 4096 --rounds 3
    python benchmarks/ab_nonfinite.py --rev new=. --check-cost 16384 --out ...  # the check's price

OpenBLAS: ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are removed from the children's
environment with ``--unset-openblas`` (they are set on the shared host; removing them gives
OpenBLAS's own choice for this CPU, and the same for every checkout).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ["linear_elu", "linear_relu", "linear_cosine", "nystrom_iterative", "nystrom_svd",
            "landmark", "linformer", "luna", "deltanet", "performer_positive"]

CHILD = r"""
import json, sys, time
import numpy as np
import arrayattn
name, n, causal, calls = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
rec = arrayattn.get_variant(name)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 8, n, 64)).astype(np.float32) for _ in range(3))
kw = {"causal": True} if causal else {}
rec(q, k, v, **kw)
best = float("inf")
for _ in range(calls):
    t0 = time.perf_counter()
    rec(q, k, v, **kw)
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"ms": best * 1e3}))
"""


def settings(name: str, rev_path: str) -> list[bool]:
    """The causal settings of ``name``: plain where it takes it, causal where it may be."""
    code = ("import arrayattn, inspect; r = arrayattn.get_variant(%r); "
            "print(int(bool(r.causal)))" % name)
    env = dict(os.environ, PYTHONPATH=rev_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    return [False, True] if out == "1" else [False]


def child(rev_path: str, name: str, n: int, causal: bool, calls: int, unset: bool) -> float:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(rev_path))
    if unset:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
    res = subprocess.run([sys.executable, "-c", CHILD, name, str(n), str(int(causal)),
                          str(calls)], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        print(res.stderr[-2000:], file=sys.stderr)
        return float("nan")
    return json.loads(res.stdout.strip().splitlines()[-1])["ms"]


#: the arrays each variant's host check reads (issue #39 point 1's price)
CHECKED = {"nystrom_iterative": "qkv", "nystrom_svd": "qkv"}


class _careful_always:
    """The host checks answer "not known" inside the block: every call takes the careful
    path, as d36ef9c did (the same process, so the A/B of point 1 is free of drift)."""

    def __enter__(self):
        from arrayattn.core import pipeline
        from arrayattn.gated import run as gated_run
        from arrayattn.lowrank import nystrom
        self.saved = [(m, a, getattr(m, a)) for m in (pipeline, gated_run, nystrom)
                      for a in ("finite_on_host", "nan_free_on_host") if hasattr(m, a)]
        for m, a, _ in self.saved:
            setattr(m, a, lambda xp, *arrays: False)

    def __exit__(self, *exc):
        for m, a, f in self.saved:
            setattr(m, a, f)


def check_cost(variants, n: int, calls: int) -> list[str]:
    """Markdown rows: per variant and causal setting, the call's best time and that of
    :func:`~arrayattn.core.pipeline.finite_on_host` on the arrays it reads (this checkout,
    in this process)."""
    import numpy as np
    import arrayattn
    from arrayattn.core.pipeline import finite_on_host

    def best(fn, reps):
        fn()
        b = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t0)
        return b * 1e3

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, n, 64)).astype(np.float32) for _ in range(3))
    rows = []
    for name in variants:
        rec = arrayattn.get_variant(name)
        arrays = (q, k, v) if CHECKED.get(name) == "qkv" else (k, v)
        for causal in ([False, True] if rec.causal else [False]):
            kw = {"causal": True} if causal else {}
            if name.startswith(("linear", "performer")) and not causal:
                continue                      # no poisoning, no check
            t_call, t_careful = float("inf"), float("inf")
            for _ in range(3):        # alternate: the check on, then forced off (d36ef9c)
                t_call = min(t_call, best(lambda: rec(q, k, v, **kw), calls))
                with _careful_always():
                    t_careful = min(t_careful, best(lambda: rec(q, k, v, **kw), calls))
            t_check = best(lambda: finite_on_host(np, *arrays), 4 * calls)
            rows.append(f"| {name} | {n} | {causal} | {t_call:.2f} | {t_careful:.2f} | "
                        f"{t_check:.2f} | {100 * t_check / t_call:.1f}% |")
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", required=True,
                    help="LABEL=PATH of a checkout; give them oldest first, the new one last")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--n", default="4096", help="comma-separated sequence lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--causal", choices=["both", "plain", "causal"], default="both")
    ap.add_argument("--unset-openblas", action="store_true")
    ap.add_argument("--out", default=None, help="Markdown file to write (and .json beside)")
    ap.add_argument("--check-cost", type=int, default=0, metavar="N",
                    help="instead: time the host check against the call at n=N in this "
                         "checkout (in process) and append the table to --out")
    args = ap.parse_args(argv)
    if args.check_cost:
        rows = check_cost(args.variants.split(","), args.check_cost, args.calls)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write("\n".join(["", "The price of the check on finite inputs (this "
                                     "checkout, one process: the call as it is and with the "
                                     "check forced to answer 'not known' (the careful path "
                                     "always, as d36ef9c), alternated 3 times, each best of "
                                     f"{args.calls} calls; the check alone best of "
                                     f"{4 * args.calls}):",
                                     "", "| variant | n | causal | call ms | careful path forced ms | "
                                     "check ms | check / call |", "|---|---|---|---|---|---|---|",
                                     *rows])
                         + "\n")
        return 0
    revs = [r.split("=", 1) for r in args.rev]
    rows = []
    for name in args.variants.split(","):
        modes = settings(name, os.path.abspath(revs[-1][1]))
        if args.causal == "plain":
            modes = [m for m in modes if not m]
        elif args.causal == "causal":
            modes = [m for m in modes if m]
        for n in (int(x) for x in args.n.split(",")):
            for causal in modes:
                times = {label: [] for label, _ in revs}
                for _ in range(args.rounds):
                    for label, path in revs:
                        times[label].append(child(path, name, n, causal, args.calls,
                                                  args.unset_openblas))
                best = {label: min(ts) for label, ts in times.items()}
                row = {"variant": name, "n": n, "causal": causal, "best_ms": best,
                       "all_ms": times,
                       "ratio": best[revs[-1][0]] / best[revs[0][0]]}
                rows.append(row)
                print(f"{name:20s} n={n:6d} causal={causal!s:5s} "
                      + " ".join(f"{lab}={best[lab]:8.2f}" for lab, _ in revs)
                      + f"  ratio={row['ratio']:.3f}", flush=True)
    if args.out:
        load = os.getloadavg()
        head = (["variant", "n", "causal"] + [f"{lab} ms" for lab, _ in revs]
                + [f"{revs[-1][0]}/{revs[0][0]}"])
        lines = [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
                 f"{args.rounds} rounds alternating {', '.join(l for l, _ in revs)} in fresh "
                 f"processes; each number the best over rounds of the best of {args.calls} "
                 f"calls after one warm-up; inputs rng standard normal (1, 8, n, 64) float32; "
                 f"OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE "
                 f"{'unset in the children' if args.unset_openblas else 'as in the environment'}"
                 f"; load average at the end {load[0]:.1f}.", "",
                 "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            lines.append("| " + " | ".join(
                [r["variant"], str(r["n"]), str(r["causal"])]
                + [f"{r['best_ms'][lab]:.2f}" for lab, _ in revs]
                + [f"{r['ratio']:.3f}"]) + " |")
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
