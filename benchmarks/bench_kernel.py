"""Benchmark of kernel (linear) attention on NumPy: time, peak memory, FLOPs.

Default problem (issue 3): batch 1, 8 heads, n = s = 16384, d = dv = 64, float32.
Rows: non-causal elu+1, causal chunked (chunk 32/64/128), causal cumsum and recurrent,
efficient attention.  The cumsum form materialises n x m x (dv + 1) floats (2.2 GB per
copy at the full size), so it is measured at ``--small-n`` (default 2048) and its time
and memory extrapolated linearly in n (its cost is n outer products and an n-long
cumulative sum); the recurrent form (n sequential steps) is measured at
``--recurrent-n`` (default: the full n).  The table says which rows are extrapolated.

Run from the repository root::

    python benchmarks/bench_kernel.py            # full size
    python benchmarks/bench_kernel.py --n 4096   # quicker

Writes ``benchmarks/results/kernel.json`` and ``benchmarks/results/kernel.md``.
Timings are the best of ``--repeat`` runs (wall clock); peak memory is a separate run
under ``tracemalloc`` (NumPy reports its buffers to it), net of the inputs.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arrayattn import efficient_attention, linear_attention  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def best_time(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_bytes(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def machine_rates(repeat):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    t_mm = best_time(lambda: a @ a, repeat)
    x = rng.standard_normal(2**24, dtype=np.float32)
    t_exp = best_time(lambda: np.exp(x), repeat)
    return 2 * 2048**3 / t_mm, x.size / t_exp


def flops(kind, n, m, dv, h, c=64):
    """Multiply-add FLOPs of the products (features and divisions not counted)."""
    dv1 = dv + 1  # the denominator rides along as an extra value column
    if kind == "noncausal":
        return h * (2 * n * m * dv1 * 2)
    if kind == "chunked":
        return h * (2 * n * m * dv1 * 2 + 2 * n * c * m + 2 * n * c * dv1)
    if kind in ("cumsum", "recurrent"):
        return h * (n * m * dv1 + 2 * n * m * dv1)
    if kind == "efficient":
        return h * (2 * n * m * dv * 2)
    raise ValueError(kind)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--small-n", type=int, default=2048,
                    help="n at which cumsum and recurrent are measured (then scaled)")
    ap.add_argument("--recurrent-n", type=int, default=None,
                    help="n at which the recurrent form is measured (default: --n)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tag", default="", help="suffix for the result files")
    args = ap.parse_args(argv)
    n, h, d = args.n, args.heads, args.d
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, h, n, d), dtype=np.float32) for _ in range(3))
    mm_rate, exp_rate = machine_rates(args.repeat)

    rows = []

    def run(label, kind, fn, n_run, *, c=64, note="", repeat=None):
        t = best_time(fn, args.repeat if repeat is None else repeat)
        mem = peak_bytes(fn)
        scale = n / n_run
        f = flops(kind, n, d, d, h, c)
        rows.append(dict(
            variant=label, n_measured=n_run, time_s=t * scale,
            measured_time_s=t, peak_mib=mem * scale / 2**20,
            measured_peak_mib=mem / 2**20,
            peak_over_input=mem / (q[..., :n_run, :].nbytes),
            gflops=f / (t * scale) / 1e9, frac_matmul=f / (t * scale) / mm_rate,
            extrapolated=n_run != n, note=note))
        print(f"{label:34s} n={n_run:6d} {t * scale * 1e3:10.1f} ms "
              f"(measured {t * 1e3:.1f} ms) peak {mem / 2**20:8.1f} MiB", flush=True)

    run("elu+1 non-causal", "noncausal", lambda: linear_attention(q, k, v), n)
    for c in (32, 64, 128):
        run(f"elu+1 causal chunked (chunk {c})", "chunked",
            lambda c=c: linear_attention(q, k, v, causal=True, chunk_size=c), n, c=c)
    m = min(args.small_n, n)
    qs, ks, vs = (x[..., :m, :] for x in (q, k, v))
    note = f"measured at n={m}, time and memory scaled by n/{m}" if m != n else ""
    run("elu+1 causal cumsum", "cumsum",
        lambda: linear_attention(qs, ks, vs, causal=True, method="cumsum"), m, note=note)
    mr = n if args.recurrent_n is None else min(args.recurrent_n, n)
    qr, kr, vr = (x[..., :mr, :] for x in (q, k, v))
    note_r = f"measured at n={mr}, time and memory scaled by n/{mr}" if mr != n else ""
    run("elu+1 causal recurrent", "recurrent",
        lambda: linear_attention(qr, kr, vr, causal=True, method="recurrent"), mr,
        note=note_r, repeat=1)
    run("efficient (Shen) non-causal", "efficient", lambda: efficient_attention(q, k, v), n)

    by = {r["variant"]: r for r in rows}
    chunk = by["elu+1 causal chunked (chunk 64)"]
    ratios = dict(
        recurrent_over_chunked=by["elu+1 causal recurrent"]["time_s"] / chunk["time_s"],
        chunked_over_noncausal=chunk["time_s"] / by["elu+1 non-causal"]["time_s"],
        cumsum_over_chunked=by["elu+1 causal cumsum"]["time_s"] / chunk["time_s"],
    )
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    meta = dict(
        shape=dict(batch=1, heads=h, n=n, d=d, dv=d, dtype="float32", backend="numpy"),
        numpy=np.__version__, machine=platform.machine(), cpus=os.cpu_count(),
        load_average=load, openblas_threads=os.environ.get("OPENBLAS_NUM_THREADS"),
        matmul_gflops=mm_rate / 1e9, exp_gelems=exp_rate / 1e9,
        time=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "kernel" + (f"_{args.tag}" if args.tag else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        dict(meta=meta, rows=rows, ratios=ratios), indent=2))
    lines = [
        f"Kernel attention, NumPy {np.__version__}, batch 1 x {h} heads, n = s = {n}, "
        f"d = dv = {d}, float32.  Machine: {os.cpu_count()} CPUs, load average "
        f"{'/'.join(f'{x:.1f}' for x in load) if load else '?'} (shared with other jobs), "
        f"OPENBLAS_NUM_THREADS={meta['openblas_threads']}, measured matmul rate "
        f"{mm_rate / 1e9:.1f} GFLOP/s, exp {exp_rate / 1e9:.2f} Gelem/s.  {meta['time']}.",
        "",
        "| variant | time (ms) | peak memory (MiB) | peak / one input | GFLOP/s | "
        "of matmul rate | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['time_s'] * 1e3:.1f} | {r['peak_mib']:.1f} | "
            f"{r['peak_over_input']:.1f} | {r['gflops']:.1f} | {r['frac_matmul']:.0%} | "
            f"{r['note']} |")
    lines += ["", "Ratios (chunk 64): recurrent / chunked = "
              f"{ratios['recurrent_over_chunked']:.0f}x, chunked / non-causal = "
              f"{ratios['chunked_over_noncausal']:.2f}x, cumsum / chunked = "
              f"{ratios['cumsum_over_chunked']:.1f}x.", ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
