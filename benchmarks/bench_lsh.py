"""Benchmark Reformer LSH attention (NumPy, float32): time, peak memory, scaling in n.

    python benchmarks/bench_lsh.py                   # n = 4096, 16384; 8 heads, d = 64
    python benchmarks/bench_lsh.py --n 4096,16384,65536 --repeats 3

For each n: ``lsh_attention(qk, v)`` with its defaults (4 hash rounds, chunk 64, buckets
``2 n / 64``) on ``qk, v`` of shape ``(heads, n, d)`` with N(0, 1) entries;

* median wall time of ``--repeats`` calls after a warm-up call;
* peak memory of one call (tracemalloc, which NumPy reports its buffers to);
* FLOPs of the two products per round, ``4 n (2C) (d + dv) / 2 = 4 n C (d + dv)`` per
  head and round, and the achieved fraction of the measured float32 matmul rate
  (a 2048 x 2048 product) -- sorting, gathers and exps are not counted, so a low
  fraction says where the time goes;
* the growth exponent of time and memory between successive n (1 = linear).

Exact blockwise attention (``softmax_attention(..., block_size=1024)``) is run for n up
to ``--exact-max-n`` (default 4096) as a reference.  Writes
``benchmarks/results/bench_lsh.json`` and ``bench_lsh.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import numpy as np  # noqa: E402

from arrayattn import lsh_attention, softmax_attention  # noqa: E402


def matmul_rate(size: int = 2048, repeats: int = 3) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    a @ b
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


def measure(fn, repeats: int):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return statistics.median(times), times, peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--num-hashes", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--exact-max-n", type=int, default=4096)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.n.split(",")]
    rate = matmul_rate()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"matmul rate {rate / 1e9:.1f} GFLOP/s (float32, 2048^3); load average {load:.1f}")
    rows = []
    rng = np.random.default_rng(0)
    H, C, d = args.num_hashes, args.chunk_size, args.d
    for n in ns:
        qk = rng.standard_normal((args.heads, n, d), dtype=np.float32)
        v = rng.standard_normal((args.heads, n, d), dtype=np.float32)
        t, times, peak = measure(
            lambda: lsh_attention(qk, v, num_hashes=H, chunk_size=C), args.repeats)
        flops = H * args.heads * 4.0 * n * C * (d + d)
        rows.append(dict(variant="lsh", n=n, seconds=t, times=times, peak_bytes=peak,
                         flops=flops, matmul_fraction=flops / t / rate,
                         options=dict(num_hashes=H, chunk_size=C,
                                      num_buckets=2 * math.ceil(n / C))))
        print(f"lsh    n={n:6d}  {t:8.3f} s  peak {peak / 2**20:8.1f} MiB  "
              f"{flops / t / 1e9:6.1f} GFLOP/s ({flops / t / rate:.1%} of matmul)")
        if n <= args.exact_max_n:
            t, times, peak = measure(
                lambda: softmax_attention(qk, qk, v, block_size=1024), max(1, args.repeats - 1))
            flops = args.heads * 4.0 * n * n * d
            rows.append(dict(variant="softmax_blockwise(1024)", n=n, seconds=t, times=times,
                             peak_bytes=peak, flops=flops, matmul_fraction=flops / t / rate,
                             options=dict(block_size=1024)))
            print(f"exact  n={n:6d}  {t:8.3f} s  peak {peak / 2**20:8.1f} MiB  "
                  f"{flops / t / 1e9:6.1f} GFLOP/s ({flops / t / rate:.1%} of matmul)")
        del qk, v
    lsh = [r for r in rows if r["variant"] == "lsh"]
    for a, b in zip(lsh, lsh[1:]):
        f = math.log(b["n"] / a["n"])
        b["time_exponent"] = math.log(b["seconds"] / a["seconds"]) / f
        b["memory_exponent"] = math.log(b["peak_bytes"] / a["peak_bytes"]) / f
        print(f"n {a['n']} -> {b['n']}: time ~ n^{b['time_exponent']:.2f}, "
              f"memory ~ n^{b['memory_exponent']:.2f}")

    meta = dict(heads=args.heads, d=args.d, dtype="float32", backend="numpy",
                numpy=np.__version__, machine=platform.machine(), cpus=os.cpu_count(),
                load_average=load, matmul_gflops=rate / 1e9,
                note="measured on a machine shared with other jobs; rerun on a quiet machine")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_lsh.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    lines = [
        f"LSH attention, NumPy float32, {args.heads} heads, d = {args.d}, "
        f"{H} hash rounds, chunk {C}; matmul rate {rate / 1e9:.1f} GFLOP/s; load average "
        f"{load:.1f} on {os.cpu_count()} CPUs (shared machine: rerun on a quiet one).",
        "",
        "| variant | n | time (s) | peak memory (MiB) | GFLOP | % of matmul rate | "
        "time exponent | memory exponent |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        te = f"{r['time_exponent']:.2f}" if "time_exponent" in r else "-"
        me = f"{r['memory_exponent']:.2f}" if "memory_exponent" in r else "-"
        lines.append(f"| {r['variant']} | {r['n']} | {r['seconds']:.3f} | "
                     f"{r['peak_bytes'] / 2**20:.1f} | {r['flops'] / 1e9:.2f} | "
                     f"{100 * r['matmul_fraction']:.1f} | {te} | {me} |")
    with open(os.path.join(args.out, "bench_lsh.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
