"""Random Feature Attention (NumPy, float32): non-causal, causal, gated.

    python benchmarks/bench_rfa.py [--n 16384] [--heads 8] [--d 64] [--m 128]
                                   [--chunk-size 64] [--repeats 2]

``rfa_attention(q, k, v, num_features=m)`` on ``q, k, v`` of shape ``(heads, n, d)``
(N(0, 1) entries, float32): non-causal, causal (chunked prefix form of
``feature_attention``) and gated (a gate ``(heads, n)`` uniform in (0.5, 1), log-space
chunked scan).  Each configuration runs in its own subprocess (peak RSS growth and the
tracemalloc peak).  FLOPs counted are those of the matmuls, per head with ``M = 2m``
features and ``c = chunk``: features ``2 * 2n (d + 1) M``; non-causal ``4 n M (dv + 1)``;
causal/gated ``2 n c M + 2 n c (dv + 1) + 4 n M (dv + 1)``.  sin, exp and the
elementwise passes are not counted, so the fraction of the matmul rate says where the
time goes.  Writes ``benchmarks/results/rfa.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import (machine, matmul_rate, median_time, peak_rss_growth,  # noqa: E402
                      traced_peak, write_results)

CONFIGS = ("non-causal", "causal", "gated")


def _one(config: str, args) -> dict:
    import numpy as np

    import arrayattn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((args.heads, args.n, args.d), dtype=np.float32)
               for _ in range(3))
    opts = {"num_features": args.m, "chunk_size": args.chunk_size}
    if config != "non-causal":
        opts["causal"] = True
    if config == "gated":
        opts["gate"] = rng.uniform(0.5, 1.0, size=(args.heads, args.n)).astype(np.float32)
    fn = lambda: arrayattn.rfa_attention(q, k, v, **opts)  # noqa: E731
    rss, _ = peak_rss_growth(fn)
    t = median_time(fn, repeats=args.repeats, warmup=0)
    one_input = q.nbytes
    return {"config": config, "n": args.n, "time_s": t, "peak_rss_mb": rss / 1e6,
            "tracemalloc_mb": traced_peak(fn) / 1e6, "input_mb": one_input / 1e6}


def _flops(config: str, n: int, d: int, m: int, c: int, heads: int) -> float:
    M, dv1 = 2 * m, d + 1
    feats = 2 * 2.0 * n * (d + 1) * M
    if config == "non-causal":
        body = 4.0 * n * M * dv1
    else:
        body = 2.0 * n * c * M + 2.0 * n * c * dv1 + 4.0 * n * M * dv1
    return heads * (feats + body)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(_one(args.one, args)))
        return
    rate = matmul_rate()
    rows = []
    for config in CONFIGS:
        res = subprocess.run(
            [sys.executable, __file__, "--one", config, "--n", str(args.n),
             "--heads", str(args.heads), "--d", str(args.d), "--m", str(args.m),
             "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats)],
            capture_output=True, text=True, check=True)
        row = json.loads(res.stdout.strip().splitlines()[-1])
        flops = _flops(config, args.n, args.d, args.m, args.chunk_size, args.heads)
        row["gflop"] = flops / 1e9
        row["gflops"] = flops / row["time_s"] / 1e9
        row["matmul_fraction"] = flops / row["time_s"] / rate
        row["peak_per_input"] = row["tracemalloc_mb"] / row["input_mb"]
        rows.append(row)
        print(row, file=sys.stderr)
    meta = {"machine": machine(), "matmul_gflops": rate / 1e9, "heads": args.heads,
            "d": args.d, "m": args.m, "chunk_size": args.chunk_size, "dtype": "float32",
            "note": "shared, loaded machine (other jobs running): rerun on a quiet one"}
    cols = [("config", "config"), ("n", "n"), ("time_s", "time s"),
            ("peak_rss_mb", "peak RSS growth MB"), ("tracemalloc_mb", "tracemalloc peak MB"),
            ("peak_per_input", "peak / one input"), ("gflop", "GFLOP"),
            ("gflops", "GFLOP/s"), ("matmul_fraction", "of matmul rate")]
    print(f"matmul rate: {rate / 1e9:.1f} GFLOP/s (float32, NumPy); load {meta['machine']}")
    print(write_results("rfa", rows, cols, meta))


if __name__ == "__main__":
    main()
