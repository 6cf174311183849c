"""Reformer LSH attention (NumPy, float32): time, peak memory, scaling in n.

    python benchmarks/bench_lsh.py [--sizes 4096,16384] [--heads 8] [--d 64]
                                   [--num-hashes 4] [--chunk-size 64] [--repeats 2]
                                   [--exact-max-n 4096]

``lsh_attention(qk, v)`` with its defaults (4 hash rounds, chunk 64, ``2 n / 64``
buckets) on ``qk, v`` of shape ``(heads, n, d)`` with N(0, 1) entries; exact blockwise
attention (``softmax_attention(qk, qk, v, block_size=512)``) as a reference up to
``--exact-max-n``.  Each configuration runs in its own subprocess (peak RSS growth and
tracemalloc peak, as in ``bench_exact.py``).  FLOPs of LSH are those of its two products,
``4 n C (d + dv)`` per head and round: sorting, gathers, masks and exps are not counted,
so a low fraction of the matmul rate says where the time goes.  The growth exponent of
time and memory between successive sizes shows the scaling (1 = linear).  Writes
``benchmarks/results/lsh.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import (machine, matmul_rate, median_time, peak_rss_growth,  # noqa: E402
                      traced_peak, write_results)


def _one(impl: str, n: int, args) -> dict:
    import numpy as np

    import arrayattn

    rng = np.random.default_rng(0)
    qk, v = (rng.standard_normal((args.heads, n, args.d), dtype=np.float32)
             for _ in range(2))
    if impl == "lsh":
        fn = lambda: arrayattn.lsh_attention(  # noqa: E731
            qk, v, num_hashes=args.num_hashes, chunk_size=args.chunk_size)
    else:
        fn = lambda: arrayattn.softmax_attention(qk, qk, v, block_size=512)  # noqa: E731
    rss, _ = peak_rss_growth(fn)
    t = median_time(fn, repeats=args.repeats, warmup=0)
    return {"impl": impl, "n": n, "time_s": t, "peak_rss_mb": rss / 1e6,
            "tracemalloc_mb": traced_peak(fn) / 1e6}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--num-hashes", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--exact-max-n", type=int, default=4096)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        impl, n = args.one.split(":")
        print(json.dumps(_one(impl, int(n), args)))
        return
    rate = matmul_rate()
    H, C, d, heads = args.num_hashes, args.chunk_size, args.d, args.heads
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        impls = ["lsh"] + (["exact_blockwise"] if n <= args.exact_max_n else [])
        for impl in impls:
            res = subprocess.run(
                [sys.executable, __file__, "--one", f"{impl}:{n}", "--heads", str(heads),
                 "--d", str(d), "--num-hashes", str(H), "--chunk-size", str(C),
                 "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=True)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            flops = (H * heads * 4.0 * n * C * (d + d) if impl == "lsh"
                     else heads * 4.0 * n * n * d)
            row["gflop"] = flops / 1e9
            row["gflops"] = flops / row["time_s"] / 1e9
            row["matmul_fraction"] = flops / row["time_s"] / rate
            rows.append(row)
            print(row, file=sys.stderr)
    lsh = [r for r in rows if r["impl"] == "lsh"]
    for a, b in zip(lsh, lsh[1:]):
        f = math.log(b["n"] / a["n"])
        b["time_exponent"] = math.log(b["time_s"] / a["time_s"]) / f
        b["memory_exponent"] = math.log(b["tracemalloc_mb"] / a["tracemalloc_mb"]) / f
    meta = {"machine": machine(), "matmul_gflops": rate / 1e9, "heads": heads, "d": d,
            "num_hashes": H, "chunk_size": C, "dtype": "float32",
            "note": "shared, loaded machine: rerun on a quiet one"}
    cols = [("impl", "impl"), ("n", "n"), ("time_s", "time s"),
            ("peak_rss_mb", "peak RSS growth MB"), ("tracemalloc_mb", "tracemalloc peak MB"),
            ("gflop", "GFLOP"), ("gflops", "GFLOP/s"), ("matmul_fraction", "of matmul rate"),
            ("time_exponent", "time ~ n^"), ("memory_exponent", "memory ~ n^")]
    print(f"matmul rate: {rate / 1e9:.1f} GFLOP/s (float32, NumPy)")
    print(write_results("lsh", rows, cols, meta))


if __name__ == "__main__":
    main()
