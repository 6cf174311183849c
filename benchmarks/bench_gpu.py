"""The GPU table of issue #16: arrayattn on CuPy, torch and jitted JAX against the peers.

    python benchmarks/bench_gpu.py                       # on a CUDA machine: n = 16384
    python benchmarks/bench_gpu.py --n 256 --long-n 512 --backends numpy,torch,jax
                                                         # the CPU smoke run of the tests

B = 1, 8 heads, d = 64, float32, ``(1, 8, n, 64)`` inputs.  For every case and backend:
the median of ``--repeats`` calls after one warm-up call (JAX: ``jax.jit`` of the call,
compiled by the warm-up), each call closed by the backend's synchronisation
(``cupy.cuda.Device().synchronize()``, ``torch.cuda.synchronize()``,
``block_until_ready()``), and the output's largest difference from NumPy float32 on the
same inputs relative to its largest entry (the precision check: no TF32 anywhere).
Peers, when importable: torch SDPA (exact), fla's ``chunk_linear_attn`` (causal linear),
performer-pytorch's ``FastAttention`` and lucidrains' Nystrom core are listed when the
package runs on the device.  Backends missing here are skipped with the reason.
Writes ``results/gpu.json`` and ``results/gpu.md`` (``--out`` for another folder).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import machine, write_results  # noqa: E402

#: case -> (expression on aa, q, k, v; n of the case: "n" or "long")
CASES = {
    "exact dense": ("aa.softmax_attention(q, k, v)", "n"),
    "exact dense causal": ("aa.softmax_attention(q, k, v, causal=True)", "n"),
    "exact blockwise (registry default block)":
        ("aa.get_variant('softmax_blockwise')(q, k, v)", "n"),
    "exact blockwise, long n": ("aa.softmax_attention(q, k, v, block_size='auto')", "long"),
    "linear elu+1": ("aa.linear_attention(q, k, v)", "n"),
    "linear elu+1 causal": ("aa.linear_attention(q, k, v, causal=True)", "n"),
    "performer m=256": ("aa.performer_attention(q, k, v, num_features=256)", "n"),
    "performer m=256 causal":
        ("aa.performer_attention(q, k, v, num_features=256, causal=True)", "n"),
    "nystrom m=64 iterative": ("aa.nystrom_attention(q, k, v, num_landmarks=64)", "n"),
    "nystrom m=64 svd": ("aa.nystrom_attention(q, k, v, num_landmarks=64, pinv='svd')", "n"),
    "strided (registry defaults)": ("aa.get_variant('strided')(q, k, v)", "n"),
    "fixed (registry defaults)": ("aa.get_variant('fixed')(q, k, v)", "n"),
    "bigbird (registry defaults)": ("aa.get_variant('bigbird')(q, k, v)", "n"),
}


def _backend(name):
    """``(asarray, sync, wrap, device label)`` or a reason string."""
    import numpy as np
    try:
        if name == "numpy":
            return np.asarray, (lambda x: x), (lambda f: f), "cpu"
        if name == "cupy":
            import cupy
            cupy.cuda.runtime.getDeviceCount()
            return cupy.asarray, (lambda x: cupy.cuda.Device().synchronize()), \
                (lambda f: f), "cuda"
        if name == "torch":
            import torch
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            sync = (lambda x: torch.cuda.synchronize()) if dev == "cuda" else (lambda x: x)
            return (lambda a: torch.asarray(a, device=dev)), sync, (lambda f: f), dev
        if name == "jax":
            import jax
            return jax.numpy.asarray, (lambda x: x.block_until_ready()), jax.jit, \
                jax.devices()[0].platform
    except Exception as exc:   # not installed, or no GPU
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    return f"unknown backend {name!r}"


def _peers(backend, device):
    """Peer callables for torch on this device, when the packages import."""
    out = {}
    if backend != "torch":
        return out
    import torch
    import torch.nn.functional as F
    out["exact dense"] = ("torch SDPA", lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    out["exact dense causal"] = ("torch SDPA", lambda q, k, v:
                                 F.scaled_dot_product_attention(q, k, v, is_causal=True))
    out["exact blockwise, long n"] = out["exact dense causal"][0], (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    if device == "cuda":
        try:
            from fla.ops.linear_attn import chunk_linear_attn
            out["linear elu+1 causal"] = ("fla chunk_linear_attn", lambda q, k, v:
                                          chunk_linear_attn(F.elu(q) + 1, F.elu(k) + 1, v,
                                                            normalize=True)[0])
        except Exception:
            pass
    try:
        from performer_pytorch import FastAttention
        fa = FastAttention(dim_heads=64, nb_features=256).to(device)
        out["performer m=256"] = ("performer-pytorch", lambda q, k, v: fa(q, k, v))
    except Exception:
        pass
    return out


def _time(fn, sync, repeats):
    out = fn()
    sync(out)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        ts.append(time.perf_counter() - t0)
    return out, statistics.median(ts)


def run(n: int, long_n: int, heads: int, d: int, repeats: int, backends) -> list[dict]:
    import numpy as np

    import arrayattn as aa
    rng = np.random.default_rng(0)
    host = {size: [rng.standard_normal((1, heads, size, d)).astype(np.float32)
                   for _ in range(3)] for size in {n, long_n}}
    base = {}
    rows = []
    for backend in ["numpy"] + [b for b in backends if b != "numpy"]:
        got = _backend(backend)
        if isinstance(got, str):
            rows.append({"backend": backend, "case": "-", "note": f"skipped: {got}"})
            continue
        asarray, sync, wrap, device = got
        peers = _peers(backend, device)
        for case, (expr, which) in CASES.items():
            size = long_n if which == "long" else n
            q, k, v = (asarray(x) for x in host[size])
            g = eval("lambda q, k, v: " + expr, {"aa": aa})  # noqa: S307 - our own table
            f = wrap(g)
            row = {"backend": backend, "device": device, "case": case, "n": size}
            try:
                out, t = _time(lambda: f(q, k, v), sync, repeats)
                host_out = np.asarray(aa.core.xp.to_numpy(out), dtype=np.float64)
                row["ms"] = t * 1e3
                if backend == "numpy":
                    base[case] = host_out
                elif case in base:
                    ref = base[case]
                    row["rel_diff_vs_numpy"] = float(np.abs(host_out - ref).max()
                                                     / max(np.abs(ref).max(), 1e-30))
            except Exception as exc:
                row["note"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
            if case in peers:
                name, pf = peers[case]
                try:
                    _, tp = _time(lambda: pf(q, k, v), sync, repeats)
                    row["peer"], row["peer_ms"] = name, tp * 1e3
                    if "ms" in row:
                        row["x_peer"] = row["ms"] / row["peer_ms"]
                except Exception as exc:
                    row["peer"] = f"{name}: {type(exc).__name__}"
            rows.append(row)
            print(row, file=sys.stderr)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--long-n", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", default="cupy,torch,jax")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = run(args.n, args.long_n, args.heads, args.d, args.repeats,
               args.backends.split(","))
    meta = {"machine": machine(), "n": args.n, "long_n": args.long_n, "heads": args.heads,
            "d": args.d, "dtype": "float32", "repeats": args.repeats}
    cols = [("backend", "backend"), ("device", "device"), ("case", "case"), ("n", "n"),
            ("ms", "ms (median)"), ("rel_diff_vs_numpy", "max diff vs NumPy f32 (rel.)"),
            ("peer", "peer"), ("peer_ms", "peer ms"), ("x_peer", "x peer"),
            ("note", "note")]
    print(write_results("gpu", rows, cols, meta, folder=args.out))


if __name__ == "__main__":
    main()
