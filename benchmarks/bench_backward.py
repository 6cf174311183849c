"""The backward pass (``arrayattn.vjp``): time and extra peak memory against torch autograd.

    python benchmarks/bench_backward.py [--sizes 4096,16384] [--heads 8] [--d 64]
                                        [--variants softmax,...] [--repeats 1]

Exact attention (issue #23's bar: at b = 1, h = 8, n = s = 16384, d = 64, float32 on
NumPy, extra peak memory <= 400 MB and time <= 2x torch's CPU autograd of
``scaled_dot_product_attention`` measured in the same run): ``arrayattn.vjp`` on NumPy
(forward recomputed inside, the returned gradients counted in the peak) vs torch's
forward + backward.  Other variants given by ``--variants`` are timed through their
registry record's vjp (their memory shows whether the backward stays O(n d + d^2)).
Each configuration runs in its own subprocess (clean peak-memory figures).  Writes
``benchmarks/results/backward.{json,md}`` (``--name`` for another stem, e.g. the causal
linear and gated families: ``--variants linear_elu,gla,... --causal true --no-torch --name
backward_linear``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import machine, median_time, peak_rss_growth, write_results  # noqa: E402


def _one(impl: str, n: int, heads: int, d: int, repeats: int, causal: bool) -> dict:
    import numpy as np

    import arrayattn

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, heads, n, d), dtype=np.float32) for _ in range(4))
    if impl == "torch_sdpa_autograd":
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        tdo = torch.from_numpy(do)

        def fn():
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                   is_causal=causal)
            return torch.autograd.grad(out, (tq, tk, tv), tdo)
    else:
        opts = {"causal": causal} if arrayattn.get_variant(impl).causal else {}
        fn = lambda: arrayattn.vjp(impl, q, k, v, do, **opts)  # noqa: E731
    rss, _ = peak_rss_growth(fn)
    t = median_time(fn, repeats=repeats, warmup=0)
    return {"impl": impl, "n": n, "heads": heads, "d": d, "causal": causal, "time_s": t,
            "peak_extra_mb": rss / 1e6}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--variants", default="softmax")
    ap.add_argument("--causal", default="false,true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--name", default="backward",
                    help="results file stem: benchmarks/results/NAME.{json,md}")
    ap.add_argument("--no-torch", action="store_true",
                    help="leave out torch's SDPA autograd row (for variants it does not run)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        impl, n, causal = args.one.split(":")
        print(json.dumps(_one(impl, int(n), args.heads, args.d, args.repeats,
                              causal == "True")))
        return
    impls = [x for x in args.variants.split(",") if x]
    try:
        import torch  # noqa: F401
        if not args.no_torch:
            impls.append("torch_sdpa_autograd")
    except ImportError:
        pass
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        for causal in (c.strip() == "true" for c in args.causal.split(",")):
            base = None
            for impl in impls:
                res = subprocess.run(
                    [sys.executable, __file__, "--one", f"{impl}:{n}:{causal}", "--heads",
                     str(args.heads), "--d", str(args.d), "--repeats", str(args.repeats)],
                    capture_output=True, text=True)
                if res.returncode:
                    rows.append({"impl": impl, "n": n, "causal": causal,
                                 "note": res.stderr.strip().splitlines()[-1][:120]})
                    continue
                row = json.loads(res.stdout)
                rows.append(row)
                print(row, flush=True)
            torch_t = next((r["time_s"] for r in rows if r.get("n") == n and
                            r.get("causal") == causal and r["impl"] == "torch_sdpa_autograd"
                            and "time_s" in r), None)
            for r in rows:
                if (r.get("n") == n and r.get("causal") == causal and "time_s" in r
                        and torch_t):
                    r["vs_torch"] = r["time_s"] / torch_t
    cols = [("impl", "implementation"), ("n", "n"), ("causal", "causal"),
            ("time_s", "time (s)"), ("vs_torch", "time / torch autograd"),
            ("peak_extra_mb", "extra peak RSS (MB)"), ("note", "note")]
    meta = {"machine": machine(), "heads": args.heads, "d": args.d, "dtype": "float32",
            "what": "vjp = forward recomputed + backward; torch = SDPA forward + autograd"}
    print(write_results(args.name, rows, cols, meta))


if __name__ == "__main__":
    main()
