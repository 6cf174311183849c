"""Shared measurement helpers for the benchmark scripts.

Peak memory is measured as the growth of the process's peak resident set size during one
call (Linux: the peak is reset through /proc/self/clear_refs before the call), so NumPy,
torch and JAX allocations are all seen; tracemalloc (NumPy only) is reported beside it.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
import tracemalloc

import numpy as np


def _vm(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_growth(fn) -> tuple[float, object]:
    """Bytes by which the peak RSS grows above the current RSS while ``fn()`` runs."""
    reset_peak_rss()
    base = _vm("VmRSS:")
    out = fn()
    return max(0, _vm("VmHWM:") - base), out


def traced_peak(fn) -> float:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak


def median_time(fn, repeats: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matmul_rate(n: int = 4096, repeats: int = 3) -> float:
    """The machine's float32 matmul rate in FLOP/s (NumPy's BLAS, an n x n product)."""
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    t = median_time(lambda: a @ a, repeats=repeats)
    return 2.0 * n**3 / t


def machine() -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def write_results(name: str, rows: list[dict], columns: list[tuple[str, str]], meta: dict,
                  folder: str | None = None):
    """Write ``<folder>/<name>.json`` and ``<folder>/<name>.md`` (default ``results/``);
    return the Markdown table."""
    out_dir = folder or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2, default=str)
    head = "| " + " | ".join(title for _, title in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _ in columns:
            val = r.get(key, "")
            cells.append(f"{val:.4g}" if isinstance(val, float) else str(val))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as fh:
        fh.write(f"Machine: {meta.get('machine')}\n\n{table}\n")
    return table
