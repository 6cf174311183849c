"""Tolerances derived from rounding-error bounds, not tuned to pass.

For attention computed in a working precision with unit roundoff ``u = eps/2``:
a logit ``l = scale * q.k`` of length-d dot product carries an absolute error of at
most ``gamma_d * scale * |q||k| ~ d u L`` (Higham, Accuracy and Stability, 3.1) with
``L = max scale |q_i||k_j|``; exp turns that into a relative error of the weight; the
normaliser and the weighted sum over ``s`` keys add ``gamma_s``.  So an output entry is
within ``atol = eps * max|v| * (d L + s + 4)`` of the exact value on the rounded inputs.
"""
from __future__ import annotations

import math

import numpy as np


def eps_of(dtype_name: str) -> float:
    if dtype_name == "bfloat16":
        return 2.0 ** -7
    return float(np.finfo(np.dtype(dtype_name)).eps)


def working_eps(dtype_name: str) -> float:
    """float16/bfloat16 are computed in float32."""
    return eps_of("float32" if dtype_name in ("float16", "bfloat16") else dtype_name)


def logit_bound(q, k, scale=None) -> float:
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qn = np.linalg.norm(q, axis=-1).max(initial=0.0)
    kn = np.linalg.norm(k, axis=-1).max(initial=0.0)
    return abs(scale) * qn * kn


def attention_atol(dtype_name: str, q, k, v, scale=None) -> float:
    """Worst-case absolute error of softmax attention computed in ``dtype_name``."""
    d, s = q.shape[-1], k.shape[-2]
    vmax = float(np.abs(v).max(initial=0.0))
    return working_eps(dtype_name) * max(vmax, 1e-300) * (d * logit_bound(q, k, scale) + s + 4)


def round_to(x, dtype_name: str) -> np.ndarray:
    """``x`` rounded to ``dtype_name`` and returned in float64 (the inputs the oracle sees)."""
    if dtype_name == "bfloat16":
        bits = np.asarray(x, dtype=np.float32).view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(x).astype(dtype_name).astype(np.float64)
