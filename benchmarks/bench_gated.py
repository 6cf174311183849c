"""Gated and delta-rule linear attention (registry family ``gated``) against causal
``linear_attention`` (elu+1, chunked: the non-gated baseline of issue #18).

    python benchmarks/bench_gated.py [--n 16384] [--heads 8] [--d 64] [--repeats 3]
                                     [--backends numpy,jax] [--variants gla,ssd]

float32 ``(heads, n, d)`` inputs, gates drawn once outside the timed call (the uniform
call would draw them on the host every time), each variant at its function's default
chunk size.  ``numpy`` runs eagerly; ``jax`` times ``jax.jit`` of the same function after
one compiling call (XLA fuses the elementwise work of the chunked forms).  Median of
``--repeats`` calls after a warm-up, all in one process, so the ratios compare code
measured in one run.  Writes benchmarks/results/gated.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import machine, median_time, write_results  # noqa: E402


def _cases(xp_asarray, q, k, v, rng):
    """name -> (function of (q, k, v, *gates), gates): the gates are arguments, so that
    ``jax.jit`` traces them instead of folding them in as constants."""
    import numpy as np

    import arrayattn as aa
    h, n, d = q.shape
    sig = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    g_dim = xp_asarray(np.log(sig(rng.standard_normal((h, n, d)) + 3.0)).astype(np.float32))
    g_tok = xp_asarray(np.log(sig(rng.standard_normal((h, n)) + 3.0)).astype(np.float32))
    beta = xp_asarray(sig(rng.standard_normal((h, n))).astype(np.float32))
    return {
        "linear_attention elu+1 causal (baseline)":
            (lambda q, k, v: aa.linear_attention(q, k, v, causal=True), ()),
        "retention": (lambda q, k, v: aa.retention(q, k, v), ()),
        "ssd": (aa.ssd_attention, (g_tok,)),
        "gla": (aa.gla_attention, (g_dim,)),
        "deltanet": (lambda q, k, v, b: aa.delta_attention(q, k, v, b, normalize_qk=True),
                     (beta,)),
        "gated_deltanet": (lambda q, k, v, b, g: aa.gated_delta_attention(
            q, k, v, b, g, normalize_qk=True), (beta, g_tok)),
    }


def run(n: int, heads: int, d: int, repeats: int, backends, only=None) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(0)
    host = [(0.3 * rng.standard_normal((heads, n, d))).astype(np.float32)
            for _ in range(3)]
    rows = []
    for backend in backends:
        if backend == "numpy":
            asarray, wrap, sync = np.asarray, (lambda f: f), (lambda x: x)
        elif backend == "jax":
            try:
                import jax
                import jax.numpy as jnp
            except ImportError:
                print("jax not installed: skipped", file=sys.stderr)
                continue
            asarray, wrap, sync = jnp.asarray, jax.jit, (lambda x: x.block_until_ready())
        else:
            raise ValueError(f"unknown backend {backend!r}")
        q, k, v = (asarray(x) for x in host)
        base = None
        for name, (fn, gates) in _cases(asarray, q, k, v, np.random.default_rng(1)).items():
            if only and base is not None and name not in only:
                continue
            f = wrap(fn)
            t = median_time(lambda: sync(f(q, k, v, *gates)), repeats=repeats, warmup=1)
            base = t if base is None else base
            rows.append({"backend": backend, "variant": name, "n": n, "time_ms": t * 1e3,
                         "vs_baseline": t / base})
            print(rows[-1], file=sys.stderr)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="numpy,jax")
    ap.add_argument("--variants", default="",
                    help="comma-separated subset (the baseline always runs)")
    ap.add_argument("--out", default=None, help="results folder (default results/)")
    args = ap.parse_args(argv)
    rows = run(args.n, args.heads, args.d, args.repeats, args.backends.split(","),
               [x for x in args.variants.split(",") if x])
    meta = {"machine": machine(), "n": args.n, "heads": args.heads, "d": args.d,
            "dtype": "float32", "goal": "chunked forms within 3x of causal linear_attention"}
    cols = [("backend", "backend"), ("variant", "variant"), ("n", "n"),
            ("time_ms", "time ms"), ("vs_baseline", "x baseline (goal <= 3)")]
    print(write_results("gated", rows, cols, meta, folder=args.out))


if __name__ == "__main__":
    main()
