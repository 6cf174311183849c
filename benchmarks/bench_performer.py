"""Performer (FAVOR+) attention: time, peak memory and FLOP rate, non-causal and causal.

    python benchmarks/bench_performer.py [--n 16384] [--heads 8] [--d 64] [--m 256]
                                         [--kinds positive,hyperbolic] [--repeats 3]
                                         [--backends numpy,torch]

Each configuration runs in its own subprocess (peak-memory figures do not leak). FLOPs
counted per call, with m' = m (positive) or 2m (hyperbolic, trig) features and
dv1 = dv + 1 (the denominator rides along as a column of ones):

* projections ``[x, h, 1] @ [W, -1, -c]^T``: ``2 heads (n + s) (d + 2) m'``;
* non-causal products ``φ(K)^T [V, 1]`` and ``φ(Q) (...)``: ``2 heads (n + s) m' dv1``;
* causal (chunk c = 64) adds the in-chunk products ``2 heads n c (m' + dv1)``;
* exps: ``heads (n + s) m'``.

Writes benchmarks/results/performer.{json,md}.  CPU time (all threads) is reported
beside wall time because the development machine is shared.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import (machine, matmul_rate, median_time, peak_rss_growth,  # noqa: E402
                      traced_peak, write_results)

CHUNK = 64


def flops(n, heads, d, m2, dv, causal):
    f = 2.0 * heads * 2 * n * (d + 2) * m2 + 2.0 * heads * 2 * n * m2 * (dv + 1)
    if causal:
        f += 2.0 * heads * n * CHUNK * (m2 + dv + 1)
    return f


def _one(backend, kind, causal, n, heads, d, m, repeats):
    import numpy as np

    import arrayattn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(3))
    if backend == "torch":
        import torch
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    feats = arrayattn.RandomFeatures.draw(d, m, seed=0)
    fn = lambda: arrayattn.performer_attention(  # noqa: E731
        q, k, v, features=feats, kind=kind, causal=causal)
    rss, _ = peak_rss_growth(fn)
    c0 = time.process_time()
    t = median_time(fn, repeats=repeats, warmup=0)
    cpu = (time.process_time() - c0) / repeats
    row = {"backend": backend, "kind": kind, "causal": causal, "n": n, "heads": heads,
           "d": d, "m": m, "time_s": t, "cpu_s": cpu, "peak_rss_mb": rss / 1e6}
    if backend == "numpy":
        row["tracemalloc_mb"] = traced_peak(fn) / 1e6
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--kinds", default="positive,hyperbolic")
    ap.add_argument("--backends", default="numpy,torch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="BLAS/OpenMP threads of the measured subprocesses (default: the "
                         "library's own choice). On a loaded machine 1 avoids OpenBLAS's "
                         "pathological spin-waiting on the many small chunk matmuls.")
    ap.add_argument("--note", default="", help="free text stored with the results")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        backend, kind, causal = args.one.split(":")
        print(json.dumps(_one(backend, kind, causal == "1", args.n, args.heads, args.d,
                              args.m, args.repeats)))
        return
    rate = matmul_rate()
    backends = args.backends.split(",")
    if "torch" in backends:
        try:
            import torch  # noqa: F401
        except ImportError:
            backends.remove("torch")
    env = dict(os.environ)
    if args.threads is not None:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(args.threads)
    rows = []
    for backend in backends:
        for kind in args.kinds.split(","):
            m2 = args.m * (1 if kind == "positive" else 2)
            for causal in (False, True):
                res = subprocess.run(
                    [sys.executable, __file__, "--one", f"{backend}:{kind}:{int(causal)}",
                     "--n", str(args.n), "--heads", str(args.heads), "--d", str(args.d),
                     "--m", str(args.m), "--repeats", str(args.repeats)],
                    capture_output=True, text=True, check=True, env=env)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                f = flops(args.n, args.heads, args.d, m2, args.d, causal)
                row["gflop"] = f / 1e9
                row["exps_m"] = args.heads * 2 * args.n * m2 / 1e6
                row["matmul_fraction"] = f / row["time_s"] / rate
                rows.append(row)
                print(row, file=sys.stderr)
    for r in rows:
        base = [x for x in rows if x["backend"] == r["backend"] and x["kind"] == r["kind"]
                and not x["causal"]]
        if r["causal"] and base:
            r["x_noncausal"] = r["time_s"] / base[0]["time_s"]
    meta = {"machine": machine(), "matmul_gflops": rate / 1e9, "heads": args.heads,
            "n": args.n, "d": args.d, "m": args.m, "dtype": "float32", "chunk": CHUNK,
            "blas_threads": args.threads, "note": args.note}
    cols = [("backend", "backend"), ("kind", "kind"), ("causal", "causal"),
            ("time_s", "wall s"), ("cpu_s", "CPU s"), ("x_noncausal", "x non-causal"),
            ("peak_rss_mb", "peak RSS growth MB"), ("tracemalloc_mb", "tracemalloc peak MB"),
            ("gflop", "GFLOP"), ("exps_m", "M exps"), ("matmul_fraction", "of matmul rate")]
    print(f"matmul rate: {rate / 1e9:.1f} GFLOP/s (float32, NumPy)")
    print(write_results("performer", rows, cols, meta))


if __name__ == "__main__":
    main()
