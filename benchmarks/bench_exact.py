"""Exact attention: naive (dense) vs blockwise vs torch's scaled_dot_product_attention.

    python benchmarks/bench_exact.py [--sizes 1024,4096,16384] [--heads 8] [--d 64]
                                     [--block 512] [--repeats 3]

Each configuration runs in its own subprocess so that peak-memory figures do not leak
from one to the next. Writes benchmarks/results/exact.{json,md}.
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


def _one(impl: str, n: int, heads: int, d: int, block: int, repeats: int) -> dict:
    import numpy as np

    import arrayattn

    rng = np.random.default_rng(0)
    # (batch, heads, n, d): torch's SDPA picks its fused flash kernel on CPU only for 4-D
    # inputs; with 3-D (heads, n, d) it falls back to the math path that materialises n x n.
    q, k, v = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(3))
    if impl == "torch_sdpa":
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    else:
        bs = None if impl == "naive" else block
        fn = lambda: arrayattn.softmax_attention(q, k, v, block_size=bs)  # noqa: E731
    rss, _ = peak_rss_growth(fn)
    t = median_time(fn, repeats=repeats, warmup=0)
    row = {"impl": impl, "n": n, "heads": heads, "d": d, "time_s": t, "peak_rss_mb": rss / 1e6}
    if impl != "torch_sdpa":
        row["tracemalloc_mb"] = traced_peak(fn) / 1e6
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1024,4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        impl, n = args.one.split(":")
        print(json.dumps(_one(impl, int(n), args.heads, args.d, args.block, args.repeats)))
        return
    rate = matmul_rate()
    try:
        import torch  # noqa: F401
        impls = ["naive", "blockwise", "torch_sdpa"]
    except ImportError:
        impls = ["naive", "blockwise"]
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        flops = 4.0 * args.heads * n * n * args.d
        for impl in impls:
            dense_bytes = 4.0 * args.heads * n * n
            if impl == "naive" and dense_bytes > 2e9:
                rows.append({"impl": impl, "n": n, "note": f"skipped: the dense score matrix "
                             f"alone is {dense_bytes / 1e9:.1f} GB"})
                continue
            res = subprocess.run(
                [sys.executable, __file__, "--one", f"{impl}:{n}", "--heads", str(args.heads),
                 "--d", str(args.d), "--block", str(args.block), "--repeats",
                 str(args.repeats if n < 16384 else 1)],
                capture_output=True, text=True, check=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            row["gflops"] = flops / row["time_s"] / 1e9
            row["matmul_fraction"] = flops / row["time_s"] / rate
            rows.append(row)
            print(row, file=sys.stderr)
    by_n = {}
    for r in rows:
        by_n.setdefault(r["n"], {})[r["impl"]] = r
    for r in rows:
        sdpa = by_n[r["n"]].get("torch_sdpa")
        if sdpa and "time_s" in r:
            r["x_sdpa"] = r["time_s"] / sdpa["time_s"]
    meta = {"machine": machine(), "matmul_gflops": rate / 1e9, "heads": args.heads,
            "d": args.d, "block": args.block, "dtype": "float32"}
    cols = [("impl", "impl"), ("n", "n"), ("time_s", "time s"), ("x_sdpa", "x SDPA time"),
            ("peak_rss_mb", "peak RSS growth MB"), ("tracemalloc_mb", "tracemalloc peak MB"),
            ("gflops", "GFLOP/s"), ("matmul_fraction", "of matmul rate"), ("note", "note")]
    print(f"matmul rate: {rate / 1e9:.1f} GFLOP/s (float32, NumPy)")
    print(write_results("exact", rows, cols, meta))


if __name__ == "__main__":
    main()
