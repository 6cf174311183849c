"""Sparse attention: local (sliding window) and BigBird, block-sparse, vs exact blockwise;
and every registered sparse pattern at its registry defaults (``default:<name>``), the
issue's test that sparse attention costs at most half of dense exact attention.

    python benchmarks/bench_sparse.py [--sizes 4096,16384,65536] [--heads 8] [--d 64]
                                      [--window 256] [--block 64] [--exact-block 512]
                                      [--exact-max 16384] [--repeats 3] [--no-defaults]

float32 NumPy, ``(heads, n, d)`` inputs. Each configuration runs in its own subprocess so
that peak-memory figures do not leak from one to the next. FLOPs are counted as
``4 d`` per computed score (QK^T and PV): for the sparse paths both the scores actually
computed (gathered tiles, including masked slots) and the allowed pairs of the pattern.
Exact attention is skipped above ``--exact-max`` (its time grows as n^2; the table gives
the extrapolated time instead). Writes benchmarks/results/sparse.{json,md}.
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


def _layout(impl: str, n: int, args):
    import arrayattn

    if impl.startswith("default:"):
        rec = arrayattn.get_variant(impl.split(":", 1)[1])
        if rec.fn is arrayattn.sparse_attention:     # a pattern builder's uniform call
            builder = getattr(arrayattn, rec.name + "_layout")
            opts = {k: v for k, v in rec.defaults.items()}
            return builder(n, **opts)
        if rec.fn is arrayattn.local_attention:
            return arrayattn.local_layout(n, window=rec.defaults["window"],
                                          block_size=rec.defaults["block_size"])
        return None
    if impl == "local":
        return arrayattn.local_layout(n, window=args.window, block_size=args.block)
    if impl == "bigbird":
        return arrayattn.bigbird_layout(n, block_size=args.block, num_window_blocks=3,
                                        num_global_blocks=2, num_random_blocks=3, seed=0)
    return None


def _one(impl: str, n: int, args) -> dict:
    import numpy as np

    import arrayattn

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((args.heads, n, args.d), dtype=np.float32)
               for _ in range(3))
    lay = _layout(impl, n, args)
    if impl.startswith("default:"):
        rec = arrayattn.get_variant(impl.split(":", 1)[1])
        fn = lambda: rec(q, k, v)  # noqa: E731
        # Poolingformer's two levels: count the first-level band (a lower bound)
        computed = lay.count_computed() if lay is not None else 0
        allowed = lay.count_allowed() if lay is not None else 0
    elif lay is None:
        fn = lambda: arrayattn.softmax_attention(q, k, v, block_size=args.exact_block)  # noqa: E731
        computed = allowed = n * n
    else:
        fn = lambda: arrayattn.sparse_attention(q, k, v, layout=lay)  # noqa: E731
        computed, allowed = lay.count_computed(), lay.count_allowed()
    rss, _ = peak_rss_growth(fn)   # also the warm-up
    t = median_time(fn, repeats=args.repeats, warmup=0)
    return {"impl": impl, "n": n, "time_s": t, "peak_rss_mb": rss / 1e6,
            "tracemalloc_mb": traced_peak(fn) / 1e6, "keys_per_query": allowed / n,
            "computed_per_query": computed / n,
            "flops_computed": 4.0 * args.heads * args.d * computed,
            "flops_allowed": 4.0 * args.heads * args.d * allowed}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="4096,16384,65536")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--exact-block", type=int, default=512)
    ap.add_argument("--exact-max", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blas-threads", type=int, default=None,
                    help="OPENBLAS/OMP/MKL_NUM_THREADS for the measured subprocesses "
                         "(default: inherit). On a loaded machine multi-threaded OpenBLAS "
                         "on many small batched GEMMs can be ~100x slower.")
    ap.add_argument("--no-defaults", action="store_true",
                    help="skip the registered patterns at their registry defaults")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        impl, n = args.one.rsplit(":", 1)
        print(json.dumps(_one(impl, int(n), args)))
        return
    import arrayattn
    defaults = [] if args.no_defaults else [
        f"default:{r.name}" for r in arrayattn.variants() if r.family == "sparse"]
    rate = matmul_rate()
    rows, exact_time = [], {}
    for n in (int(x) for x in args.sizes.split(",")):
        for impl in ("exact_blockwise", "local", "bigbird", *defaults):
            if impl == "exact_blockwise" and n > args.exact_max:
                known = max((m for m in exact_time), default=None)
                est = exact_time[known] * (n / known) ** 2 if known else None
                rows.append({"impl": impl, "n": n, "note": (
                    f"skipped (n^2: ~{est:.0f} s extrapolated from n={known})" if est
                    else "skipped")})
                continue
            cmd = [sys.executable, __file__, "--one", f"{impl}:{n}"]
            for opt in ("heads", "d", "window", "block", "exact_block"):
                cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
            cmd += ["--repeats", str(args.repeats if n < 16384 else 1)]
            env = dict(os.environ)
            if args.blas_threads:
                for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
                    env[var] = str(args.blas_threads)
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            if row["flops_computed"]:
                row["gflops"] = row["flops_computed"] / row["time_s"] / 1e9
                row["matmul_fraction"] = row["flops_computed"] / row["time_s"] / rate
            if impl == "exact_blockwise":
                exact_time[n] = row["time_s"]
            rows.append(row)
            print(row, file=sys.stderr)
    first = {}
    for r in rows:
        if "time_s" in r:
            base = first.setdefault(r["impl"], r)
            r["time_per_n_vs_smallest"] = (r["time_s"] / r["n"]) / (base["time_s"] / base["n"])
            if r["n"] in exact_time and r["impl"] != "exact_blockwise":
                r["speedup_vs_exact"] = exact_time[r["n"]] / r["time_s"]
                r["cost_vs_exact"] = r["time_s"] / exact_time[r["n"]]
    meta = {"machine": machine(), "matmul_gflops": rate / 1e9, "heads": args.heads,
            "d": args.d, "window": args.window, "block": args.block,
            "exact_block": args.exact_block, "dtype": "float32",
            "blas_threads": args.blas_threads or "inherited",
            "bigbird": "block 64, 3 window + 2 global + 3 random blocks, seed 0",
            "caveat": "measured while other processes load the machine (see load_average)"}
    cols = [("impl", "impl"), ("n", "n"), ("time_s", "time s"),
            ("time_per_n_vs_smallest", "time/n vs smallest n"),
            ("speedup_vs_exact", "x faster than exact"),
            ("cost_vs_exact", "cost / exact (goal <= 0.5)"),
            ("peak_rss_mb", "peak RSS growth MB"), ("tracemalloc_mb", "tracemalloc peak MB"),
            ("keys_per_query", "allowed keys/query"),
            ("computed_per_query", "computed keys/query"),
            ("gflops", "GFLOP/s (computed)"), ("matmul_fraction", "of matmul rate"),
            ("note", "note")]
    print(f"matmul rate: {rate / 1e9:.1f} GFLOP/s (float32, NumPy, this process's BLAS "
          f"threads); "
          f"load average {meta['machine'].get('load_average')}")
    print(write_results("sparse", rows, cols, meta))


if __name__ == "__main__":
    main()
