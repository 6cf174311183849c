"""The states between chunks of the causal kernel forms under ``jax.jit`` on the CPU:
XLA's cumulative sum against :func:`arrayattn.reference.scan.running_sum`'s loop.

    python benchmarks/chunk_states.py [--variants linear_relu,performer_relu]
                                      [--sizes 1024,2048,16384] [--heads 8] [--repeats 3]

Per variant and ``n``: the uniform call ``rec(q, k, v, causal=True)`` on
``(1, heads, n, 64)`` float32 (64-token chunks: ``n / 64`` steps), compiled by a fresh
``jax.jit`` once with every running sum a ``cumulative_sum`` and once with every one a
loop (:data:`~arrayattn.reference.scan.XLA_CPU_CUMSUM_STEPS` patched to ``n`` and to 0),
the calls interleaved: XLA compile seconds (the fastest of ``--repeats``), the median
call, and the reduce-windows and loops in the compiled program.  The code keeps the
cumulative sum up to ``XLA_CPU_CUMSUM_STEPS`` steps: the ``in_code`` column marks the
form it runs.

Writes ``benchmarks/results/chunk_states.{json,md}`` (``--out`` for another stem).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

os.environ.setdefault("JAX_PLATFORMS", "cpu")

FORMS = {"cumulative_sum": lambda n: n, "loop": lambda n: 0}


def measure(rec, n: int, heads: int, repeats: int) -> list[dict]:
    """Both forms of one configuration, compiled and called in turn ``repeats`` times."""
    import numpy as np
    import jax
    from _measure import median_time
    from arrayattn.reference import scan as scan_module

    chosen = scan_module.XLA_CPU_CUMSUM_STEPS
    rng = np.random.default_rng(0)
    q, k, v = (jax.numpy.asarray(0.3 * rng.standard_normal((1, heads, n, 64)),
                                 jax.numpy.float32) for _ in range(3))
    rows = {form: {"compile": [], "call": []} for form in FORMS}
    try:
        for _ in range(repeats):
            for form, steps in FORMS.items():
                scan_module.XLA_CPU_CUMSUM_STEPS = steps(n)
                lowered = jax.jit(lambda q, k, v: rec(q, k, v, causal=True)).lower(q, k, v)
                t = time.perf_counter()
                compiled = lowered.compile()
                rows[form]["compile"].append(time.perf_counter() - t)
                rows[form]["call"].append(median_time(
                    lambda: compiled(q, k, v).block_until_ready(), repeats=2))
                text = compiled.as_text()
                rows[form].update(reduce_windows=text.count("reduce-window("),
                                  loops=text.count(" while("))
    finally:
        scan_module.XLA_CPU_CUMSUM_STEPS = chosen
    steps = -(-n // 64)
    in_code = "cumulative_sum" if steps <= chosen else "loop"
    return [{"n": n, "steps": steps, "form": form, "in_code": "yes" if form == in_code else "",
             "compile_s": min(r["compile"]), "jit_ms": 1e3 * statistics.median(r["call"]),
             "reduce_windows": r["reduce_windows"], "loops": r["loops"]}
            for form, r in rows.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants",
                    default="linear_relu,linear_cosine,performer_positive,performer_relu,rfa")
    ap.add_argument("--sizes", default="1024,2048,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "chunk_states"))
    args = ap.parse_args(argv)

    import arrayattn
    from _measure import machine, write_results

    rows = []
    for name in args.variants.split(","):
        rec = arrayattn.get_variant(name)
        for n in (int(x) for x in args.sizes.split(",")):
            for row in measure(rec, n, args.heads, args.repeats):
                rows.append({"variant": name, **row})
                print(json.dumps(rows[-1]), flush=True)
    meta = {"machine": machine(), "heads": args.heads, "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "workload": f"(1, {args.heads}, n, 64) float32, causal, 64-token chunks"}
    columns = [("variant", "variant"), ("n", "n"), ("steps", "chunks"), ("form", "form"),
               ("in_code", "in the code"), ("compile_s", "jit compile s"),
               ("jit_ms", "jit ms (median)"), ("reduce_windows", "reduce-windows"),
               ("loops", "loops")]
    print(write_results(os.path.basename(args.out), rows, columns, meta,
                        os.path.dirname(args.out)))


if __name__ == "__main__":
    main()
