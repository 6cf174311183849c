"""Statistics of the random-feature kernel estimate: bias and error per projection, norms
and feature kind (the numbers quoted on the Performer docs page).

    python benchmarks/stats_performer.py [--reps 2000] [--d 16] [--m 16,64]

For a fixed set of (q, k) pairs at several norms, the m-feature estimate of
exp(q·k/sqrt(d)) is drawn with seeds 0..reps-1 and summarised per configuration by

* relative bias ``mean_pairs |mean_seeds(K̂) - K| / K`` and its standard error,
* relative RMSE ``sqrt(mean_pairs mean_seeds (K̂ - K)² / K²)``.

Writes benchmarks/results/performer_stats.{json,md}.

With ``--favorpp``: FAVOR++ (GERF with the optimal A*) against FAVOR+ (positive) and
hyperbolic features on trained-BERT-like norms (‖q‖ = ‖k‖ = 8, d = 32), same m:

* closed-form relative variance ``Var / K²`` of the kernel estimate (iid rows), geometric
  mean over 16 random pairs;
* mean ``|log(K̂ / K)|`` over the pairs and seeds (the typical error; FAVOR+'s variance is
  too heavy-tailed to be estimated by sampling), with its standard error over seeds;
* attention (n = s = 128, 8 seeds): mean |output error| and mean row L1 distance of the
  implied attention matrix from exact softmax.

Writes benchmarks/results/performer_favorpp.{json,md}.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _measure import machine, write_results  # noqa: E402

CONFIGS = [
    ("positive", "iid", "chi"),
    ("positive", "orthogonal", "chi"),
    ("positive", "orthogonal", "quasi"),
    ("positive", "orthogonal", "fixed"),
    ("hyperbolic", "orthogonal", "chi"),
    ("trig", "orthogonal", "chi"),
]


def pairs(d, norm, count=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, count, d))
    q = q / np.linalg.norm(q, axis=1, keepdims=True) * norm
    k = k / np.linalg.norm(k, axis=1, keepdims=True) * norm
    return q, k


def summarise(kind, projection, norms, q, k, m, reps):
    import arrayattn

    d = q.shape[1]
    truth = np.exp(np.sum(q * k, axis=1) / math.sqrt(d))
    est = np.empty((reps, len(q)))
    for s in range(reps):
        f = arrayattn.RandomFeatures.draw(d, m, projection=projection, norms=norms, seed=s)
        est[s] = np.diagonal(arrayattn.estimate_kernel(q, k, f, kind=kind))
    rel = est / truth - 1
    bias = np.abs(rel.mean(axis=0))
    se = rel.std(axis=0, ddof=1) / math.sqrt(reps)
    return {"rel_bias": float(bias.mean()), "bias_in_se": float((bias / se).mean()),
            "rel_rmse": float(np.sqrt((rel ** 2).mean()))}


def favorpp(ms=(64, 256, 1024), d=32, norm=8.0, reps=200, seeds=8):
    import arrayattn

    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 16, d))
    q = q / np.linalg.norm(q, axis=1, keepdims=True) * norm
    k = k / np.linalg.norm(k, axis=1, keepdims=True) * norm
    truth = np.exp(np.sum(q * k, axis=1) / math.sqrt(d))
    a_pairs = float(arrayattn.gerf_parameter(q[None], k[None])[0, 0, 0])
    rng = np.random.default_rng(0)
    qa, ka, va = rng.standard_normal((3, 1, 128, d))
    qa = qa / np.linalg.norm(qa, axis=-1, keepdims=True) * norm
    ka = ka / np.linalg.norm(ka, axis=-1, keepdims=True) * norm
    exact = arrayattn.softmax_attention(qa, ka, va)
    amat = arrayattn.softmax_attention(qa, ka, np.eye(128)[None])
    rows = []
    for m in ms:
        for kind in ("positive", "hyperbolic", "favor++"):
            opt = {"gerf_a": a_pairs} if kind == "favor++" else {}
            var = np.diagonal(arrayattn.kernel_variance(q, k, num_features=m, kind=kind,
                                                        **opt)) / truth ** 2
            logerr = np.array([np.mean(np.abs(np.log(np.abs(np.diagonal(
                arrayattn.estimate_kernel(q, k, arrayattn.RandomFeatures.draw(d, m, seed=s),
                                          kind=kind, **opt))) / truth))) for s in range(reps)])
            out_err, row_l1 = [], []
            for s in range(seeds):
                f = arrayattn.RandomFeatures.draw(d, m, seed=s)
                out_err.append(np.abs(arrayattn.performer_attention(
                    qa, ka, va, features=f, kind=kind) - exact).mean())
                a_hat = arrayattn.attention_matrix(arrayattn.performer_attention, qa, ka,
                                                   features=f, kind=kind)
                row_l1.append(np.abs(a_hat - amat).sum(-1).mean())
            rows.append({"m": m, "kind": kind, "A": a_pairs if kind == "favor++" else None,
                         "rel_var_geomean": float(np.exp(np.mean(np.log(var)))),
                         "mean_abs_log_err": float(logerr.mean()),
                         "log_err_se": float(logerr.std(ddof=1) / math.sqrt(reps)),
                         "attn_out_err": float(np.mean(out_err)),
                         "attn_row_l1": float(np.mean(row_l1))})
            print(rows[-1], file=sys.stderr)
    meta = {"machine": machine(), "d": d, "norm": norm, "reps": reps, "attention_seeds": seeds,
            "baseline_mean_v_out_err": float(np.abs(va.mean(-2, keepdims=True)
                                                    - exact).mean())}
    cols = [("m", "m"), ("kind", "kind"), ("rel_var_geomean", "closed-form Var/K² (geo. mean)"),
            ("mean_abs_log_err", "mean abs log(K̂/K)"), ("log_err_se", "± SE"),
            ("attn_out_err", "attention mean abs error"), ("attn_row_l1", "row L1 of A error")]
    print(write_results("performer_favorpp", rows, cols, meta))
    print(f"baseline (every query outputs mean(v)): mean |error| "
          f"{meta['baseline_mean_v_out_err']:.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--favorpp", action="store_true")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--m", default="16,64")
    ap.add_argument("--norms", default="2,3")
    args = ap.parse_args(argv)
    if args.favorpp:
        favorpp()
        return
    rows = []
    for norm in (float(x) for x in args.norms.split(",")):
        q, k = pairs(args.d, norm)
        for m in (int(x) for x in args.m.split(",")):
            for kind, projection, norms in CONFIGS:
                row = {"norm": norm, "m": m, "kind": kind, "projection": projection,
                       "norms": norms}
                row.update(summarise(kind, projection, norms, q, k, m, args.reps))
                rows.append(row)
                print(row, file=sys.stderr)
    meta = {"machine": machine(), "d": args.d, "reps": args.reps, "pairs": 8,
            "scale": "1/sqrt(d)"}
    cols = [("norm", "‖q‖ = ‖k‖"), ("m", "m"), ("kind", "kind"), ("projection", "projection"),
            ("norms", "norms"), ("rel_bias", "|rel. bias|"), ("bias_in_se", "bias / SE"),
            ("rel_rmse", "rel. RMSE")]
    print(write_results("performer_stats", rows, cols, meta))


if __name__ == "__main__":
    main()
