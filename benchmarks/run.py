"""Benchmark every registered variant: time, peak memory, fraction of the matmul rate.

    python benchmarks/run.py                       # n = 1024 ... 65536, numpy and torch
    python benchmarks/run.py --n 1024,2048,4096 --max-seconds 3 --update-readme

For each backend (NumPy, and torch when installed; ``--backends`` to choose), the
machine's matmul rate is measured first (median of a few float32 ``a @ b`` products of
2048 x 2048 matrices).  Then every registered variant (through its registry record, with
its default options) and every installed peer (torch's ``scaled_dot_product_attention``)
runs on q, k, v of shape (batch, heads, n, d) with N(0, 1) entries, for each n in turn:

* median wall time of ``--repeats`` calls after a warm-up call (one call when a call
  takes more than 10 s), the backend synchronised before the clock is read;
* peak memory of one call: tracemalloc for NumPy, the CUDA allocator for torch on a GPU,
  otherwise (torch on the CPU, JAX) the growth of the process's peak resident set size
  (``_measure.peak_rss_growth``, Linux);
* the *exact-equivalent* fraction of the matmul rate: ``4 n s d batch heads / time``
  divided by the measured rate -- the FLOPs of exact attention's two products.  For exact
  variants it is the achieved fraction; for approximations, which do fewer FLOPs, a value
  above that of exact attention is the speed-up at equal output size.

A point is skipped, with the reason in the results, when the time or memory predicted from
the variant's previous two points (their measured growth exponent; quadratic before two
points exist) exceeds ``--max-seconds`` or ``--max-memory-gb`` (default: half of the
available memory), or when the variant raises.  Outputs: ``results/run.json``,
``results/run.md`` (the Markdown tables) and ``results/run.png`` (log-log time vs n),
and with ``--update-readme`` the table section of ``benchmarks/README.md``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import arrayattn  # noqa: E402
from arrayattn.report.backends import BackendUnavailable, get_array_backend  # noqa: E402
from arrayattn.report.run import Workload, make_inputs  # noqa: E402
from arrayattn.report.calls import timed  # noqa: E402
from _measure import machine, peak_rss_growth  # noqa: E402

DEFAULT_N = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
MARK_BEGIN = "<!-- benchmark table: begin (written by benchmarks/run.py --update-readme) -->"
MARK_END = "<!-- benchmark table: end -->"


def available_memory_bytes() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def fixed_mmap_threshold(threshold: int = 1 << 16) -> bool:
    """Make glibc serve every allocation >= 64 KiB by mmap and unmap it on free.

    By default glibc raises its mmap threshold after large frees (up to 32 MiB), so later
    buffers come from a heap that keeps its pages: the peak-RSS growth of a call then
    misses them (0 MiB for a 16 MiB score matrix).  A fixed threshold makes the RSS
    measurement of torch and JAX calls see their buffers.  No-op outside glibc.
    """
    try:
        import ctypes
        return bool(ctypes.CDLL("libc.so.6").mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def matmul_rate(be, dtype: str, size: int = 2048, repeats: int = 3) -> float:
    """Measured FLOP/s of a ``size`` x ``size`` matrix product (2 size^3 FLOPs)."""
    rng = np.random.default_rng(0)
    a = be.asarray(rng.standard_normal((size, size)), dtype)
    b = be.asarray(rng.standard_normal((size, size)), dtype)
    be.sync(a @ b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = a @ b
        be.sync(c)
        times.append(time.perf_counter() - t0)
    return 2.0 * size**3 / statistics.median(times)


class _Peer:
    """An installed reference implementation, called like a registry record."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, q, k, v, **opts):
        return self.fn(q, k, v)


def peers(backend: str):
    if backend == "torch":
        import torch
        return [_Peer("peer:torch.sdpa", torch.nn.functional.scaled_dot_product_attention)]
    return []


def _predict(points, key, n):
    """Extrapolate ``key`` to ``n`` from the last two measured points (exponent 2 with one)."""
    pts = [(p["n"], p[key]) for p in points if p.get(key)]
    if not pts:
        return None
    if len(pts) == 1:
        (n0, y0), expo = pts[-1], 2.0
    else:
        (n1, y1), (n0, y0) = pts[-2], pts[-1]
        expo = max(1.0, math.log(max(y0, 1e-12) / max(y1, 1e-12)) / math.log(n0 / n1))
    return y0 * (n / n0) ** expo


def bench_backend(backend, names, ns, args, log, measured=()):
    """Every variant (and peer) of ``names`` at every n on ``backend``; a list of points.

    ``measured``: points of a backend that measures memory (NumPy), used to predict the
    memory of the same variant where this backend cannot measure it (torch on the CPU).
    """
    be = get_array_backend(backend, args.dtype)
    rate = matmul_rate(be, args.dtype, args.matmul_size)
    log(f"[{backend}] matmul rate {rate / 1e9:.1f} GFLOP/s ({args.dtype}, "
        f"{args.matmul_size}^3)")
    recs = [arrayattn.get_variant(n) for n in names] + peers(backend)
    mem_limit = args.max_memory_gb * 2**30
    results = []
    for rec in recs:
        points = []
        for n in ns:
            point = {"backend": backend, "variant": rec.name, "n": n}
            t_pred = _predict(points, "seconds", n)
            m_pred = _predict(points, "peak_bytes", n)
            if m_pred is None:
                m_pred = _predict([m for m in measured if m["variant"] == rec.name
                                   and m["n"] <= n], "peak_bytes", n)
            if points and "skipped" in points[-1]:
                point["skipped"] = f"n={points[-1]['n']} was skipped"
            elif t_pred is not None and t_pred > args.max_seconds:
                point["skipped"] = f"predicted {t_pred:.0f} s > --max-seconds {args.max_seconds:g}"
            elif m_pred is not None and m_pred > mem_limit:
                point["skipped"] = (f"predicted {m_pred / 2**30:.1f} GiB > --max-memory-gb "
                                    f"{args.max_memory_gb:.1f}")
            else:
                w = Workload(batch=args.batch, heads=args.heads, n=n, d=args.d,
                             dtype=args.dtype, seed=0)
                q, k, v = (be.asarray(x, args.dtype) for x in make_inputs(w, "gaussian"))
                try:
                    t0 = time.perf_counter()
                    out = rec(q, k, v)
                    be.sync(out)
                    first = time.perf_counter() - t0
                    del out
                    repeats = 1 if first > 10 else args.repeats
                    _, times, peak = timed(be, rec, q, k, v, repeats)
                    memory = be.memory
                    if peak is None:  # torch on the CPU, JAX: growth of the peak RSS
                        def call():
                            res = rec(q, k, v)
                            be.sync(res)
                        peak, _ = peak_rss_growth(call)
                        memory = "rss"
                    t = statistics.median(times)
                    flops = 4.0 * n * n * args.d * args.batch * args.heads
                    point.update(seconds=t, times=times, peak_bytes=peak, memory=memory,
                                 exact_equiv_fraction=flops / t / rate)
                except Exception as exc:  # a variant that cannot run this size
                    point["skipped"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                del q, k, v
            points.append(point)
            if "seconds" in point:
                mem = ("-" if point["peak_bytes"] is None
                       else f"{point['peak_bytes'] / 2**20:.0f} MiB")
                log(f"[{backend}] {rec.name:24s} n={n:6d} {point['seconds'] * 1e3:10.1f} ms "
                    f"{mem:>9s} {100 * point['exact_equiv_fraction']:6.1f}%")
            else:
                log(f"[{backend}] {rec.name:24s} n={n:6d} skipped: {point['skipped']}")
        results += points
    return rate, results


def markdown(results, rates, ns, args, info) -> str:
    load = info.get("load_average")
    lines = [f"Machine: {info.get('cpu', info['machine'])}, {info['cpus']} cores; "
             f"Python {info['python']}, NumPy {info['numpy']}"
             + (f", torch {info['torch']}" if "torch" in info else "")
             + (f"; load average at the end {load[0]:.1f}" if load else "") + ".",
             f"Workload: batch {args.batch}, {args.heads} head(s), n = s, d = dv = {args.d}, "
             f"{args.dtype}, N(0, 1) inputs, default options of each registry record. "
             f"Run {info['date']}."]
    if args.note:
        lines.append(args.note)
    lines.append("")
    lines.append("Each cell: median time, peak memory of one call (NumPy: tracemalloc; "
                 "torch on the CPU: growth of the process's peak RSS; `-`: not measured), "
                 "exact-equivalent fraction of the measured matmul rate "
                 "(4 n s d batch heads FLOPs / time / rate). `skip`: predicted over the "
                 "time or memory budget, or the variant raised (see run.json).")
    for backend, rate in rates.items():
        lines += ["", f"**{backend}** (matmul rate {rate / 1e9:.1f} GFLOP/s)", "",
                  "| variant | " + " | ".join(f"n={n}" for n in ns) + " |",
                  "|---|" + "---|" * len(ns)]
        names = list(dict.fromkeys(r["variant"] for r in results if r["backend"] == backend))
        for name in names:
            cells = []
            for n in ns:
                p = next(r for r in results if r["backend"] == backend
                         and r["variant"] == name and r["n"] == n)
                if "seconds" not in p:
                    cells.append("skip")
                    continue
                t = p["seconds"]
                tt = f"{t:.3g} s" if t >= 1 else f"{t * 1e3:.3g} ms"
                mem = "-" if p["peak_bytes"] is None else f"{p['peak_bytes'] / 2**20:.0f} MiB"
                cells.append(f"{tt}, {mem}, {100 * p['exact_equiv_fraction']:.0f}%")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(results, rates, path, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(rates)
    fig, axes = plt.subplots(1, len(backends), figsize=(7.5 * len(backends), 5.5),
                             squeeze=False)
    for ax, backend in zip(axes[0], backends):
        names = list(dict.fromkeys(r["variant"] for r in results if r["backend"] == backend))
        cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
        for i, name in enumerate(names):
            pts = [r for r in results if r["backend"] == backend and r["variant"] == name
                   and "seconds" in r]
            if not pts:
                continue
            peer = name.startswith("peer:")
            exact = not peer and arrayattn.get_variant(name).exact
            ax.plot([p["n"] for p in pts], [p["seconds"] * 1e3 for p in pts],
                    "s:" if peer else ("o--" if exact else "o-"),
                    color="black" if peer else cmap(i % cmap.N), label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n (= s)")
        ax.set_ylabel("median time per call [ms]")
        ax.set_title(f"{backend}, {args.dtype}, batch {args.batch} x {args.heads} heads, "
                     f"d={args.d}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("arrayattn benchmarks: time vs n (dashed: exact variants, dotted: peers)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(table: str):
    path = os.path.join(HERE, "README.md")
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{MARK_BEGIN}\n{table}{MARK_END}"
    if MARK_BEGIN in text and MARK_END in text:
        text = text[:text.index(MARK_BEGIN)] + block + text[text.index(MARK_END) + len(MARK_END):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(path, "w") as fh:
        fh.write(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="numpy,torch",
                   help="comma-separated; not installed ones are skipped with a message")
    p.add_argument("--n", default=",".join(map(str, DEFAULT_N)))
    p.add_argument("--variants", default="", help="registry names (default: all)")
    p.add_argument("--d", type=int, default=64)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=30.0,
                   help="skip a point predicted to take longer per call")
    p.add_argument("--max-memory-gb", type=float,
                   default=available_memory_bytes() / 2 / 2**30)
    p.add_argument("--matmul-size", type=int, default=2048,
                   help="size of the square product that measures the matmul rate")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--note", default="", help="a line printed under the machine (e.g. load)")
    p.add_argument("--update-readme", action="store_true")
    args = p.parse_args(argv)
    fixed_mmap_threshold()
    ns = sorted(int(x) for x in args.n.split(","))
    names = ([x.strip() for x in args.variants.split(",") if x.strip()]
             or [r.name for r in arrayattn.variants()])
    for name in names:
        arrayattn.get_variant(name)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rates, results = {}, []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        try:
            get_array_backend(backend, args.dtype)
        except BackendUnavailable as exc:
            log(f"skipping backend {backend}: {exc}")
            continue
        if backend == "torch":
            import torch
            log(f"[torch] {torch.get_num_threads()} threads")
        rates[backend], res = bench_backend(backend, names, ns, args, log, measured=results)
        results += res
    info = machine()
    if "torch" in rates:
        import torch
        info["torch"] = torch.__version__
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "run.json"), "w") as fh:
        json.dump({"machine": info, "settings": vars(args), "n": ns,
                   "matmul_flops_per_s": rates, "results": results}, fh, indent=1)
    table = markdown(results, rates, ns, args, info)
    with open(os.path.join(args.out, "run.md"), "w") as fh:
        fh.write(table)
    print(table)
    try:
        plot(results, rates, os.path.join(args.out, "run.png"), args)
    except ImportError:
        log("matplotlib is not installed: no run.png (pip install '.[plot]')")
    if args.update_readme:
        update_readme(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
