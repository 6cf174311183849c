"""Statistics of the random-feature kernel estimate: bias and error per projection, norms
and feature kind (the numbers quoted on the Performer docs page).

    python benchmarks/stats_performer.py [--reps 2000] [--d 16] [--m 16,64]

For a fixed set of (q, k) pairs at several norms, the m-feature estimate of
exp(q·k/sqrt(d)) is drawn with seeds 0..reps-1 and summarised per configuration by

* relative bias ``mean_pairs |mean_seeds(K̂) - K| / K`` and its standard error,
* relative RMSE ``sqrt(mean_pairs mean_seeds (K̂ - K)² / K²)``.

Writes benchmarks/results/performer_stats.{json,md}.
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--d", type=int, default=16)
    ap.add_argument("--m", default="16,64")
    ap.add_argument("--norms", default="2,3")
    args = ap.parse_args(argv)
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
