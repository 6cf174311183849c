"""XLA's backend optimisation level for the JAX report's programs (issue #26, point 3).

    python benchmarks/report_xla_level.py [--variants gla,lsh] [--repeats 7]

``arrayattn report --backend jax`` compiles every variant once per input shape of its
default workload -- ``(1, 2, 1024, 64)`` and the real heads' ``(1, 36, 256, 32)``,
float32 -- and on a CPU it compiles them with
:data:`arrayattn.report.calls.CPU_COMPILER_OPTIONS` (LLVM at XLA's backend optimisation
level 1 instead of the default 2).  Per variant and shape, this measures both programs
in one process: compile seconds, run time (the fastest of ``--repeats`` calls, the two
programs alternated, so the machine's load falls on both alike) and the largest
difference of their outputs relative to the output's largest entry.

Writes ``benchmarks/results/report_xla_level.{json,md}``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def measure(rec, args, repeats: int, options: dict) -> dict:
    """Both programs of ``rec``'s report call on ``args``: default and ``options``."""
    import jax
    import numpy as np

    from arrayattn.registry import jit_uniform

    call = jit_uniform(rec, jax.jit)
    lowered, drawn = call.lower(*args), call.drawn(args[0])
    t0 = time.perf_counter()
    default = lowered.compile()
    t1 = time.perf_counter()
    level = lowered.compile(compiler_options=options)
    t2 = time.perf_counter()
    out_d, out_l = (np.asarray(p(*args, drawn), dtype=np.float64) for p in (default, level))
    times = {"default": [], "level": []}
    for _ in range(repeats):
        for which, program in (("default", default), ("level", level)):
            s = time.perf_counter()
            jax.block_until_ready(program(*args, drawn))
            times[which].append(time.perf_counter() - s)
    scale = max(float(np.abs(out_d).max()), np.finfo(np.float32).tiny)
    run_d, run_l = (min(times[w]) * 1e3 for w in ("default", "level"))
    return {"variant": rec.name, "shape": str(tuple(args[0].shape)),
            "compile_default_s": t1 - t0, "compile_level_s": t2 - t1,
            "compile_ratio": (t2 - t1) / (t1 - t0),
            "run_default_ms": run_d, "run_level_ms": run_l, "run_ratio": run_l / run_d,
            "max_rel_diff": float(np.abs(out_l - out_d).max()) / scale}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=None, help="comma-separated registry names")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="report_xla_level")
    args = p.parse_args(argv)

    import numpy as np
    import jax

    from _measure import machine, write_results
    from arrayattn.registry import get_variant, variants
    from arrayattn.report.run import CASES, Workload, _round, make_inputs
    from arrayattn.report.calls import CPU_COMPILER_OPTIONS

    w = Workload(backend="jax")
    shapes = {}
    for case in CASES:
        host = [_round(x, w.dtype) for x in make_inputs(w, case)]
        shapes.setdefault(host[0].shape,
                          [jax.numpy.asarray(x, dtype=jax.numpy.float32) for x in host])
    recs = ([get_variant(n) for n in args.variants.split(",")] if args.variants
            else list(variants()))
    rows = []
    for rec in recs:
        for inputs in shapes.values():
            row = measure(rec, inputs, args.repeats, CPU_COMPILER_OPTIONS)
            rows.append(row)
            print(f"{row['variant']:22s} {row['shape']:18s} compile "
                  f"{row['compile_default_s']:5.2f} -> {row['compile_level_s']:5.2f} s, run "
                  f"{row['run_default_ms']:7.1f} -> {row['run_level_ms']:7.1f} ms, "
                  f"diff {row['max_rel_diff']:.1e}", flush=True)
    total = {"variant": "**all**", "shape": "",
             **{key: sum(r[key] for r in rows) for key in
                ("compile_default_s", "compile_level_s", "run_default_ms", "run_level_ms")},
             "max_rel_diff": max(r["max_rel_diff"] for r in rows)}
    total["compile_ratio"] = total["compile_level_s"] / total["compile_default_s"]
    total["run_ratio"] = total["run_level_ms"] / total["run_default_ms"]
    rows.append(total)
    meta = {"machine": machine(), "jax": jax.__version__, "options": CPU_COMPILER_OPTIONS,
            "repeats": args.repeats,
            "workload": "the report's default workload's two input shapes, float32",
            "numpy": np.__version__}
    columns = [("variant", "variant"), ("shape", "q shape"),
               ("compile_default_s", "compile s (default)"),
               ("compile_level_s", "compile s (level 1)"), ("compile_ratio", "ratio"),
               ("run_default_ms", "run ms (default)"), ("run_level_ms", "run ms (level 1)"),
               ("run_ratio", "ratio"), ("max_rel_diff", "max |diff| / max |out|")]
    print(write_results(args.out, rows, columns, meta))


if __name__ == "__main__":
    main()
