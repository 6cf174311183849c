"""The float64 oracle for exact attention, written as plainly as possible.

One query row at a time, in NumPy float64, straight from the definition:
weights_j = exp(l_j) / sum_{allowed j'} exp(l_j') over the allowed keys j,
with l_j = scale * q.k_j.  A query with no allowed key returns zeros.
"""
from __future__ import annotations

import math

import numpy as np


def allowed_matrix(n, s, *, batch=(), causal=False, key_mask=None, mask=None):
    """Boolean ``(*batch, n, s)``: may query i attend to key j."""
    allowed = np.ones((*batch, n, s), dtype=bool)
    if causal:
        for i in range(n):
            for j in range(s):
                if j > i + (s - n):  # end-aligned: the last query sees every key
                    allowed[..., i, j] = False
    if key_mask is not None:
        allowed = allowed & np.asarray(key_mask, dtype=bool)[..., None, :]
    if mask is not None:
        allowed = allowed & np.asarray(mask, dtype=bool)
    return allowed


def softmax_attention(q, k, v, *, scale=None, causal=False, key_mask=None, mask=None):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, d = q.shape[-2:]
    s = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    allowed = allowed_matrix(n, s, batch=batch, causal=causal, key_mask=key_mask, mask=mask)
    batch = allowed.shape[:-2]
    q = np.broadcast_to(q, (*batch, n, d))
    k = np.broadcast_to(k, (*batch, s, d))
    v = np.broadcast_to(v, (*batch, s, v.shape[-1]))
    out = np.zeros((*batch, n, v.shape[-1]))
    for idx in np.ndindex(*batch):
        for i in range(n):
            keys = np.flatnonzero(allowed[idx][i])
            if keys.size == 0:
                continue  # no key to attend to: zeros
            logits = np.array([scale * np.dot(q[idx][i], k[idx][j]) for j in keys])
            w = np.exp(logits - logits.max())
            w = w / w.sum()
            out[idx][i] = w @ v[idx][keys]
    return out
