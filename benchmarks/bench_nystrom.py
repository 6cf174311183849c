"""Benchmark: Nyströmformer attention with both pseudo-inverses, NumPy float32.

Shape of the issue: 8 heads, n = s = 16384, d = dv = 64, m = 64 landmarks.  Reports the
time (min and median of several runs), the peak memory of one call (tracemalloc: NumPy
reports its buffers to it), the FLOP count and the fraction of the measured float32
matmul rate achieved, and the cost of the m x m pseudo-inverse alone.  Writes
``benchmarks/results/nystrom.json`` and ``nystrom.md``.

Run from the repository root:  python benchmarks/bench_nystrom.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arrayattn import nystrom_attention, pinv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _time(fn, repeats, cpu=False):
    """(min, median) wall time; with ``cpu`` also the min CPU time of this process (all
    threads), which a loaded machine inflates far less than the wall time."""
    fn()  # warm-up (allocator, BLAS threads)
    ts, cs = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        ts.append(time.perf_counter() - t0)
        cs.append(time.process_time() - c0)
    out = (min(ts), statistics.median(ts))
    return (*out, min(cs)) if cpu else out


def _peak_bytes(fn):
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def flops(h, n, s, d, dv, m):
    """Multiply-adds x 2 of the four n x m / m x s products (+ the small m x m ones)."""
    big = 2 * (n * m * d + m * s * d + m * s * dv + n * m * dv)
    return h * big, h * (n * m + m * s + m * m)


def machine_rates(repeats):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    t, _ = _time(lambda: a @ a, repeats)
    x = rng.standard_normal(1 << 24, dtype=np.float32)
    te, _ = _time(lambda: np.exp(x), repeats)
    return 2 * 2048**3 / t, (1 << 24) / te


def torch_port(q, k, v, m, iters=6):
    """The official Nyströmformer forward as popular PyTorch ports have it, written here
    for a same-machine reference: ``q, k`` divided by ``d^(1/4)``, landmarks by a
    reshape-mean (``n`` divisible by ``m``), the iterative pseudo-inverse with one
    ``Z0`` scale over the whole batch, and ``(F pinv(A)) (B V)``.  torch on the CPU, its
    own threads, no autograd."""
    import torch

    d = q.shape[-1]
    q, k = q / d ** 0.25, k / d ** 0.25
    ql = q.reshape(*q.shape[:-2], m, -1, d).mean(-2)
    kl = k.reshape(*k.shape[:-2], m, -1, d).mean(-2)
    f = torch.softmax(q @ kl.transpose(-1, -2), dim=-1)
    a = torch.softmax(ql @ kl.transpose(-1, -2), dim=-1)
    b = torch.softmax(ql @ k.transpose(-1, -2), dim=-1)
    eye = torch.eye(m, dtype=a.dtype)
    z = a.transpose(-1, -2) / (a.abs().sum(-2).max() * a.abs().sum(-1).max())
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return (f @ z) @ (b @ v)


def _peer_rows(q, k, v, m, repeats):
    try:
        import torch
    except ImportError:
        return []
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    with torch.no_grad():
        t_min, t_med = _time(lambda: torch_port(tq, tk, tv, m), repeats)
        ref = nystrom_attention(q, k, v, num_landmarks=m, pinv_init="global")
        diff = float(np.abs(torch_port(tq, tk, tv, m).numpy() - ref).max())
    return [dict(peer=f"official algorithm in torch {torch.__version__} (CPU, "
                      f"{torch.get_num_threads()} threads)",
                 time_ms_min=1e3 * t_min, time_ms_median=1e3 * t_med,
                 max_abs_diff_vs_arrayattn_global_init=diff)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="n = 4096, fewer repeats")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    h, n, d, m = 8, 16384, 64, 64
    if args.quick:
        n, args.repeats = 4096, 3
    rng = np.random.default_rng(0)
    # Sharp inputs (row norm 8 at d = 64, as in trained BERT heads).
    q, k, v = (rng.standard_normal((h, n, d), dtype=np.float32) for _ in range(3))
    for x in (q, k):
        x *= 8.0 / np.linalg.norm(x, axis=-1, keepdims=True)
    matmul_rate, exp_rate = machine_rates(args.repeats)
    fl, exps = flops(h, n, n, d, d, m)
    rows = []
    for method in ("iterative", "svd"):
        def call():
            return nystrom_attention(q, k, v, num_landmarks=m, pinv=method)
        t_min, t_med, t_cpu = _time(call, args.repeats, cpu=True)
        peak = _peak_bytes(call)
        a = rng.random((h, m, m), dtype=np.float32)
        a /= a.sum(-1, keepdims=True)
        tp, _ = _time(lambda: pinv(a, method=method), args.repeats)
        rows.append(dict(
            pinv=method, n=n, heads=h, d=d, m=m, dtype="float32", backend="numpy",
            time_ms_min=1e3 * t_min, time_ms_median=1e3 * t_med, cpu_ms_min=1e3 * t_cpu,
            peak_mib=peak / 2**20, pinv_only_ms=1e3 * tp,
            gflop=fl / 1e9, mexp=exps / 1e6,
            achieved_gflops=fl / t_min / 1e9,
            fraction_of_matmul=fl / t_min / matmul_rate,
            # the floor: FLOPs at the matmul rate plus exps at the exp rate
            model_floor_ms=1e3 * (fl / matmul_rate + exps / exp_rate),
        ))
    peers = _peer_rows(q, k, v, m, args.repeats)
    load = os.getloadavg()
    meta = dict(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                numpy=np.__version__, load_avg_1_5_15=load,
                matmul_gflops=matmul_rate / 1e9, exp_gelem_per_s=exp_rate / 1e9,
                note="other processes were loading the machine when load_avg > cpus")
    RESULTS.mkdir(exist_ok=True)
    name = "nystrom_quick" if args.quick else "nystrom"
    (RESULTS / f"{name}.json").write_text(json.dumps(dict(meta=meta, rows=rows, peers=peers),
                                                        indent=2))
    lines = [
        f"Nyström attention, NumPy float32, {h} heads, n = s = {n}, d = {d}, m = {m} "
        f"({rows[0]['gflop']:.2f} GFLOP + {rows[0]['mexp']:.1f} M exp per call).",
        "",
        f"Machine: {meta['cpus']} CPUs, float32 matmul {meta['matmul_gflops']:.0f} GFLOP/s, "
        f"exp {meta['exp_gelem_per_s']:.2f} G/s, load average {load[0]:.1f} "
        f"(>{meta['cpus']} means other jobs shared the machine).",
        "",
        "| pinv | time min (ms) | median (ms) | CPU time, all threads (ms) "
        "| peak memory (MiB) | pinv alone (ms) | GFLOP/s | of matmul rate | model floor (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pinv']} | {r['time_ms_min']:.1f} | {r['time_ms_median']:.1f} | "
            f"{r['cpu_ms_min']:.1f} | "
            f"{r['peak_mib']:.1f} | {r['pinv_only_ms']:.2f} | {r['achieved_gflops']:.1f} | "
            f"{100 * r['fraction_of_matmul']:.0f}% | {r['model_floor_ms']:.1f} |")
    if peers:
        lines += ["", "Same inputs, same machine, for reference:", "",
                  "| peer | time min (ms) | median (ms) | max abs difference from arrayattn "
                  "(pinv_init='global') |", "|---|---|---|---|"]
        for r in peers:
            lines.append(f"| {r['peer']} | {r['time_ms_min']:.1f} | "
                         f"{r['time_ms_median']:.1f} | "
                         f"{r['max_abs_diff_vs_arrayattn_global_init']:.1e} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
