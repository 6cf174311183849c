"""``arrayattn report``: every registered variant on a default workload, one row each.

The default workload (documented in the README and ``docs/report``): batch 1, 4 heads,
n = s = 1024 tokens, d = dv = 64, float32, seed 0, in two cases --

* ``gaussian``: q, k, v with i.i.d. N(0, 1) entries (logits q.k/sqrt(d) ~ N(0, 1));
* ``sharp``: the same, with every q and k row rescaled to l2 norm 8 -- the norms of
  trained BERT heads, where attention is peaked and approximations are put to the test.
"""
from __future__ import annotations

import statistics
import time
import tracemalloc
from dataclasses import asdict, dataclass

import numpy as np

from .registry import variants

__all__ = ["Workload", "make_inputs", "reference", "run_report", "format_table"]


@dataclass(frozen=True)
class Workload:
    batch: int = 1
    heads: int = 4
    n: int = 1024
    d: int = 64
    dtype: str = "float32"
    seed: int = 0
    repeats: int = 3


CASES = {"gaussian": None, "sharp": 8.0}


def make_inputs(w: Workload, case: str):
    """Host float64 ``q, k, v (batch, heads, n, d)`` for ``case`` (see module docstring)."""
    rng = np.random.default_rng(w.seed)
    shape = (w.batch, w.heads, w.n, w.d)
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    norm = CASES[case]
    if norm is not None:
        q = q / np.linalg.norm(q, axis=-1, keepdims=True) * norm
        k = k / np.linalg.norm(k, axis=-1, keepdims=True) * norm
    return q, k, v


def reference(q, k, v):
    """Exact softmax attention in float64 on the host (the report's yardstick)."""
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


@dataclass
class Row:
    variant: str
    case: str
    parameter: str
    rel_error: float
    median_ms: float
    peak_mib: float


def _measure(rec, q, k, v, repeats):
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    out = rec(q, k, v)
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rec(q, k, v)
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times), peak


def run_report(w: Workload = Workload(), names=None):
    """Run every registered variant (or ``names``) on the workload; a list of rows."""
    rows = []
    recs = [r for r in variants() if names is None or r.name in names]
    for case in CASES:
        q64, k64, v64 = make_inputs(w, case)
        ref = reference(q64, k64, v64)
        q, k, v = (x.astype(w.dtype) for x in (q64, k64, v64))
        for rec in recs:
            out, t, peak = _measure(rec, q, k, v, w.repeats)
            err = float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))
            param = "" if rec.parameter is None else f"{rec.parameter}={rec.parameter_value}"
            rows.append(Row(rec.name, case, param, err, t * 1e3, peak / 2**20))
    return rows


def format_table(rows) -> str:
    head = ["variant", "case", "parameter", "rel. error", "median ms", "peak MiB"]
    body = [[r.variant, r.case, r.parameter, f"{r.rel_error:.2e}", f"{r.median_ms:.1f}",
             f"{r.peak_mib:.1f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(h.ljust(wd) for h, wd in zip(head, widths)),
             "  ".join("-" * wd for wd in widths)]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(row, widths)) for row in body]
    return "\n".join(lines)


def rows_as_dicts(rows):
    return [asdict(r) for r in rows]
