"""The block-sparse executor's chunk budget on the CPU: run time (NumPy engine and
``jax.jit``), ``jax.jit`` compile time and peak memory, per budget.

    python benchmarks/sparse_chunks.py [--variants local,longformer] [--sizes 1024,4096]
                                       [--budgets 18,20,23] [--heads 8] [--repeats 5]

Per pattern, ``n`` and budget ``2^b`` elements (:data:`arrayattn._devices.CPU_CHUNK`,
patched for the run): the uniform call ``rec(q, k, v)`` (``causal=True`` where the record
supports it) on ``(1, heads, n, 64)`` float32 inputs -- NumPy: the fastest of
``--repeats`` calls and the traced peak of one; JAX: XLA compile seconds (a fresh
``jax.jit``), the while loops kept in the compiled program and the fastest call.  The
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
    from _measure import traced_peak

    opts = {"causal": True} if rec.causal else {}
    rng = np.random.default_rng(0)
    q, k, v = (np.asarray(0.3 * rng.standard_normal((1, heads, n, 64)), np.float32)
               for _ in range(3))

    def fastest(call):
        call()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        return 1e3 * min(times)

    row = {"numpy_ms": fastest(lambda: rec(q, k, v, **opts)),
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
               jit_ms=fastest(lambda: compiled(jq, jk, jv).block_until_ready()))
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
    import arrayattn._devices as devices
    from _measure import machine

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
    meta = {"machine": machine(), "heads": args.heads, "chosen": chosen.bit_length() - 1,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    m = meta["machine"]
    lines = [f"Machine: {m.get('cpu', '?')}, {m.get('cpus')} cores, load average "
             f"{tuple(round(x, 1) for x in m.get('load_average', ()))}; {meta['date']}. "
             f"(1, {args.heads}, n, 64) float32, causal where supported.  The CPU budget "
             f"in the code: 2^{meta['chosen']} elements.", "",
             "| variant | n | budget | NumPy ms | NumPy peak MiB | jit ms | jit compile s "
             "| loops |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        jit = (f"{r['jit_ms']:.1f} | {r['compile_s']:.2f} | {r['loops']}" if "jit_ms" in r
               else "- | - | -")
        lines.append(f"| {r['variant']} | {r['n']} | 2^{r['budget']} | {r['numpy_ms']:.1f} "
                     f"| {r['numpy_peak_mb']:.0f} | {jit} |")
    with open(args.out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
