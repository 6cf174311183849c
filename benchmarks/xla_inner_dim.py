"""XLA's CPU compile time of one elementwise kernel against its innermost dimension.

    python benchmarks/xla_inner_dim.py [--dims 8,16,32,48,64,128] [--rows 36,256]

No arrayattn code: ``exp``, ``log`` and ``where(isfinite(x), x, 0)`` on a float32
``(*rows, d)`` array, each compiled alone under ``jax.jit`` (the fastest of three
compiles, a fresh program each), and the same on the array flattened to one axis.  It
shows why the report's real-heads case (``d = 32``) costs more to compile than the
gaussian case (``d = 64``): a transcendental kernel whose innermost dimension is 16-40
compiles several times slower than at 64 or flattened (the LLVM code XLA emits for it is
unrolled), whatever the library around it does.

Writes ``benchmarks/results/xla_inner_dim.{json,md}`` (``--out`` for another stem).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_COUNT = [0]


def compile_s(fn, shape, repeats: int = 3) -> float:
    """The fastest of ``repeats`` XLA compiles of ``fn`` on a float32 ``shape`` array."""
    import jax
    import jax.numpy as jnp

    best = float("inf")
    for _ in range(repeats):
        _COUNT[0] += 1
        c = float(_COUNT[0])               # a new constant: a new program, no cache hit
        lowered = jax.jit(lambda x: fn(x) * c).lower(jax.ShapeDtypeStruct(shape, jnp.float32))
        t = time.perf_counter()
        lowered.compile()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="8,16,32,48,64,128")
    ap.add_argument("--rows", default="36,256", help="the leading dimensions")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "xla_inner_dim"))
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    from _measure import machine, write_results

    kernels = {"exp": jnp.exp, "log": jnp.log,
               "isfinite select": lambda x: jnp.where(jnp.isfinite(x), x, 0.0)}
    rows_shape = tuple(int(x) for x in args.rows.split(","))
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        shape = (*rows_shape, d)
        flat = (math.prod(shape),)
        for name, fn in kernels.items():
            row = {"kernel": name, "d": d, "compile_s": compile_s(fn, shape),
                   "flat_compile_s": compile_s(fn, flat)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"machine": machine(), "jax": jax.__version__, "leading": rows_shape,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    columns = [("kernel", "kernel"), ("d", "innermost d"), ("compile_s", "compile s"),
               ("flat_compile_s", "compile s, flattened")]
    print(write_results(os.path.basename(args.out), rows, columns, meta,
                        os.path.dirname(args.out)))


if __name__ == "__main__":
    main()
