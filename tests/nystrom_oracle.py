"""Float64 oracles of Nyströmformer, landmark attention and segment means, written plainly.

One batch element, one segment, one row at a time, straight from the definitions
(Xiong et al. 2021): landmarks are the means of the real tokens of m contiguous
segments (the first n mod m segments one token longer), F = softmax(scale q k~^T),
A = softmax(scale q~ k~^T), B = softmax(scale q~ k^T) over real keys, output F pinv(A) B v.
"""
from __future__ import annotations

import math

import numpy as np


def segment_bounds(n, m):
    """[(start, stop)] of the m segments: n mod m of length ceil(n/m) first."""
    bounds, start = [], 0
    for j in range(m):
        length = n // m + (1 if j < n % m else 0)
        bounds.append((start, start + length))
        start += length
    assert start == n
    return bounds


def segment_means(x, m, mask=None):
    """``(means (..., m, c), counts (..., m))`` of ``x (..., n, c)``."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[-2]
    batch = x.shape[:-2] if mask is None else np.broadcast_shapes(x.shape[:-2], mask.shape[:-1])
    x = np.broadcast_to(x, (*batch, *x.shape[-2:]))
    mask = np.ones((*batch, n), bool) if mask is None else np.broadcast_to(mask, (*batch, n))
    means = np.zeros((*batch, m, x.shape[-1]))
    counts = np.zeros((*batch, m))
    for idx in np.ndindex(*batch):
        for j, (a, b) in enumerate(segment_bounds(n, m)):
            rows = [t for t in range(a, b) if mask[idx][t]]
            counts[idx][j] = len(rows)
            if rows:
                means[idx][j] = sum(x[idx][t] for t in rows) / len(rows)
    return means, counts


def _softmax_row(logits, allowed):
    out = np.zeros(len(logits))
    if not allowed.any():
        return out
    w = np.exp(logits[allowed] - logits[allowed].max())
    out[allowed] = w / w.sum()
    return out


def razavi_pinv(a, iters, alpha):
    z = alpha * a.T
    eye = np.eye(a.shape[0])
    for _ in range(iters):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_factors(q, k, m, *, scale=None, key_mask=None, query_mask=None):
    """F (..., n, m), A (..., m, m), B (..., m, s) of every batch element."""
    q, k = np.asarray(q, float), np.asarray(k, float)
    n, d = q.shape[-2:]
    s = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2],
                                () if key_mask is None else key_mask.shape[:-1],
                                () if query_mask is None else query_mask.shape[:-1])
    q = np.broadcast_to(q, (*batch, n, d))
    k = np.broadcast_to(k, (*batch, s, d))
    km = np.ones((*batch, s), bool) if key_mask is None else np.broadcast_to(key_mask, (*batch, s))
    qm = np.ones((*batch, n), bool) if query_mask is None else np.broadcast_to(query_mask, (*batch, n))
    qt, qc = segment_means(q, m, qm)
    kt, kc = segment_means(k, m, km)
    F = np.zeros((*batch, n, m))
    A = np.zeros((*batch, m, m))
    B = np.zeros((*batch, m, s))
    for idx in np.ndindex(*batch):
        kvalid = kc[idx] > 0
        qvalid = qc[idx] > 0
        for i in range(n):
            F[idx][i] = _softmax_row(np.array([scale * q[idx][i] @ kt[idx][j] for j in range(m)]),
                                     kvalid)
        for i in range(m):
            if not qvalid[i]:
                continue
            A[idx][i] = _softmax_row(np.array([scale * qt[idx][i] @ kt[idx][j]
                                               for j in range(m)]), kvalid)
            B[idx][i] = _softmax_row(np.array([scale * qt[idx][i] @ k[idx][t]
                                               for t in range(s)]), km[idx])
    return F, A, B


def pinvs(A, method, *, iters=6, init="per_matrix", rtol=None):
    """Pseudo-inverses of every matrix of ``A (..., m, m)``, by the given method."""
    m = A.shape[-1]
    Z = np.zeros_like(A)
    if init == "global":
        alpha = 1.0 / (np.abs(A).sum(-2).max() * np.abs(A).sum(-1).max())
    for idx in np.ndindex(*A.shape[:-2]):
        a = A[idx]
        if method == "svd":
            Z[idx] = np.linalg.pinv(a, rcond=m * np.finfo(float).eps if rtol is None else rtol)
        else:
            al = alpha if init == "global" else 1.0 / (np.abs(a).sum(0).max() * np.abs(a).sum(1).max())
            Z[idx] = razavi_pinv(a, iters, al)
    return Z


def nystrom_attention(q, k, v, m, *, pinv="iterative", pinv_iters=6, pinv_init="per_matrix",
                      scale=None, key_mask=None, query_mask=None, conv_kernel=None):
    F, A, B = nystrom_factors(q, k, m, scale=scale, key_mask=key_mask, query_mask=query_mask)
    Z = pinvs(A, pinv, iters=pinv_iters, init=pinv_init)
    out = F @ Z @ B @ np.asarray(v, float)
    if conv_kernel is not None:
        out = out + depthwise_conv(v, conv_kernel, key_mask)
    return out


def landmark_attention(q, k, v, m, *, scale=None, key_mask=None, query_mask=None):
    F, A, B = nystrom_factors(q, k, m, scale=scale, key_mask=key_mask, query_mask=query_mask)
    # Landmark j is dropped from both factors when its key or its query segment is empty.
    for idx in np.ndindex(*F.shape[:-2]):
        both = (B[idx].sum(-1) > 0) & (F[idx].sum(0) > 0)
        F[idx] = F[idx] * both
        rs = F[idx].sum(-1, keepdims=True)
        F[idx] = np.where(rs > 0, F[idx] / np.where(rs > 0, rs, 1), 0)
    return F @ B @ np.asarray(v, float)


def depthwise_conv(v, w, key_mask=None):
    """out[i] = sum_t w[t] v[i + t - K//2] (zero outside), per head."""
    v = np.asarray(v, float)
    if key_mask is not None:
        v = v * np.asarray(key_mask, float)[..., None]
    w = np.asarray(w, float)
    n, kw = v.shape[-2], w.shape[-1]
    batch = np.broadcast_shapes(v.shape[:-2], w.shape[:-1])
    v = np.broadcast_to(v, (*batch, *v.shape[-2:]))
    w = np.broadcast_to(w, (*batch, kw))
    out = np.zeros(v.shape)
    for idx in np.ndindex(*batch):
        for i in range(n):
            for t in range(kw):
                j = i + t - kw // 2
                if 0 <= j < n:
                    out[idx][i] += w[idx][t] * v[idx][j]
    return out
