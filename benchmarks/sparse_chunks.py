"""The block-sparse executor's chunk budget on the CPU: run time (NumPy engine and
``jax.jit``), ``jax.jit`` compile time and peak memory, per budget.

    python benchmarks/sparse_chunks.py [--variants local,longformer] [--sizes 1024,4096]
                                       [--budgets 18,20,23] [--heads 8] [--repeats 5]

Per pattern, ``n`` and budget ``2^b`` elements (:data:`arrayattn.core.devices.CPU_CHUNK`,
patched for the run): the uniform call ``rec(q, k, v)`` (``causal=True`` where the record
supports it) on ``(1, heads, n, 64)`` float32 inputs -- NumPy: the median of
``--repeats`` calls and the traced peak of one; JAX: XLA compile seconds (a fresh
``jax.jit``), the while loops kept in the compiled program and the median call.  The
budget chosen for the CPU is the one at which the calls run fastest across ``n`` without
more memory; the compiled program then has the same loops at every ``n``
(``benchmarks/jit_compile.py``).

Writes ``benchmarks/results/sparse_chunks.{json,md}`` (``--out`` for another stem).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def measure(rec, n: int, heads: int, repeats: int) -> dict:
    """One configuration at the budget in force: NumPy and ``jax.jit`` numbers."""
    import numpy as np
    from _measure import median_time, traced_peak

    opts = {"causal": True} if rec.causal else {}
    rng = np.random.default_rng(0)
    q, k, v = (np.asarray(0.3 * rng.standard_normal((1, heads, n, 64)), np.float32)
               for _ in range(3))
    row = {"numpy_ms": 1e3 * median_time(lambda: rec(q, k, v, **opts), repeats),
           "numpy_peak_mb": traced_peak(lambda: rec(q, k, v, **opts)) / 2**20}
    try:
        import jax
    except ImportError:
        return row
    jq, jk, jv = (jax.numpy.asarray(x) for x in (q, k, v))
    lowered = jax.jit(lambda q, k, v: rec(q, k, v, **opts)).lower(jq, jk, jv)
    t = time.perf_counter()
    compiled = lowered.compile()
    row.update(compile_s=time.perf_counter() - t, loops=compiled.as_text().count(" while("),
               jit_ms=1e3 * median_time(lambda: compiled(jq, jk, jv).block_until_ready(),
                                        repeats))
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="local,longformer,bigbird,poolingformer,fixed")
    ap.add_argument("--sizes", default="1024,4096,16384")
    ap.add_argument("--budgets", default="18,20,21,23", help="log2 of the chunk elements")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "sparse_chunks"))
    args = ap.parse_args(argv)

    import arrayattn
    import arrayattn.core.devices as devices
    from _measure import machine, write_results

    chosen = devices.CPU_CHUNK
    rows = []
    for name in args.variants.split(","):
        rec = arrayattn.get_variant(name)
        for n in (int(x) for x in args.sizes.split(",")):
            for b in (int(x) for x in args.budgets.split(",")):
                devices.CPU_CHUNK = 1 << b
                try:
                    row = {"variant": name, "n": n, "budget": b,
                           **measure(rec, n, args.heads, args.repeats)}
                finally:
                    devices.CPU_CHUNK = chosen
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"machine": machine(), "heads": args.heads, "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "workload": f"(1, {args.heads}, n, 64) float32, causal where supported"}
    columns = [("variant", "variant"), ("n", "n"), ("budget", "log2 budget"),
               ("in_code", "CPU budget in the code"), ("numpy_ms", "NumPy ms (median)"),
               ("numpy_peak_mb", "NumPy peak MiB"), ("jit_ms", "jit ms (median)"),
               ("compile_s", "jit compile s"), ("loops", "loops")]
    for r in rows:
        r["in_code"] = "yes" if 1 << r["budget"] == chosen else ""
    print(write_results(os.path.basename(args.out), rows, columns, meta,
                        os.path.dirname(args.out)))


if __name__ == "__main__":
    main()
