"""The NumPy engine of Performer attention: the stabilised features block by block.

The reference form (:mod:`arrayattn.reference.performer`) makes every feature, then one
kernel-attention product.  Here the exponential kinds make their features one row block
at a time inside :func:`arrayattn._numpy.kernel.kernel_attention`'s threads: the additive
terms of an exponent are folded into the projection matmul as extra columns
(``[k, ‖k̃‖²/2, 1] @ [W, -1, a - c]^T``), then one in-place ``exp``; non-causal keys are
shifted per block and the block states merged to one global shift (as the online softmax
merges blocks), so the keys are read once.  Trig and relu make their features block by
block too (trig's key factor ``e^{-‖k̃‖²/2}``, shifted by one max over all keys where not
causal, first); a user's function of ``ω·x`` gets the whole features with one matmul each
(under the process lock every NumPy call holds, so the BLAS thread count is the same
whatever other threads do).

Measured (2 cores, 8 heads, n = 16384, d = 64, m = 256, float32): 0.21x the time of
performer-pytorch's FastAttention on the same machine (2026-11-22,
bench_performer.py, removed since, in git at b047db6; tables: benchmarks/results/performer.md).
"""
from __future__ import annotations

import numpy as np

from .kernel import rows_of

__all__ = ["performer_maps"]

#: Stands in for +inf in sums that go through a matmul: ``exp(-_BIG) == 0`` exactly in every
#: float dtype, and BLAS never sees an inf (``0 * inf`` would give NaN).
_BIG = 1e30


def _augment(x, *cols):
    """``[x, c_1, c_2, ...]`` along the last axis (batch dims broadcast); a Python float
    ``c`` is a constant column."""
    batch = np.broadcast_shapes(x.shape[:-1], *(c.shape[:-1] for c in cols
                                                if not isinstance(c, float)))
    parts = [np.broadcast_to(x, (*batch, x.shape[-1]))]
    for c in cols:
        c = np.full((*batch, 1), c, dtype=x.dtype) if isinstance(c, float) else c
        parts.append(np.broadcast_to(c, (*batch, c.shape[-1])))
    return np.concatenate(parts, axis=-1)


def _exp_shifted(a, shift):
    a -= shift
    return np.exp(a, out=a)


def _signed_maps(q, k, w, a, *, kind, causal: bool, keys, keep):
    """:func:`performer_maps` of the kinds without a max-shifted exponential: trig
    (``sin``/``cos`` of ``ω·x``, times ``e^{-‖k̃‖²/2}`` on the keys), relu and a user
    function of ``ω·x``."""
    if kind == "trig":
        _, hk = keys(0, k.shape[-2])
        wp = np.swapaxes(_augment(w, np.swapaxes(a, -1, -2)), -1, -2)
        if not causal:   # not causal-safe: a key max over the whole sequence
            top = np.max(hk, axis=-2, keepdims=True)
            hk = hk - np.where(top == -np.inf, 0.0, top)
        eh = np.exp(hk)
        # the features of a block of rows, made in the engine's threads
        return (lambda i0, i1: np.sin(_augment(q[..., i0:i1, :], 1.0) @ wp),
                lambda j0, j1: np.sin(_augment(k[..., j0:j1, :], 1.0) @ wp)
                * eh[..., j0:j1, :])
    wt = np.swapaxes(w, -1, -2)
    if kind != "relu":   # a user's function of ω·x: on the whole features, as given
        phi_q, phi_k = kind(q @ wt), kind(k @ wt)
        if keep is not None:
            phi_k = np.where(keep, phi_k, 0.0)
        return rows_of(phi_q), rows_of(phi_k)

    def key_features(j0, j1):
        phi = np.maximum(k[..., j0:j1, :] @ wt, 0.0)
        return phi if keep is None else np.where(keep[..., j0:j1, :], phi, 0.0)
    return (lambda i0, i1: np.maximum(q[..., i0:i1, :] @ wt, 0.0)), key_features


def performer_maps(q, k, rows, *, kind, scale: float, causal: bool, key_mask=None):
    """Row-block callables ``(i0, i1) -> φq[..., i0:i1, :]`` and ``(j0, j1) -> φk`` (for
    non-causal exponential kinds ``(φk / exp(shift), shift)``) of the stabilised features.

    ``q``, ``k`` in the working dtype with masked keys zeroed; ``rows = (W, a, c)`` from
    :func:`arrayattn.reference.favor_rows`.  Masked keys get zero features.
    """
    w, a, c = rows
    a = None if isinstance(a, float) else a
    wt = np.swapaxes(w, -1, -2)
    col = lambda x: np.swapaxes(x, -1, -2)   # noqa: E731  (..., 1, m') -> (..., m', 1)
    if scale < 0:
        q = -q
    exp_kind = kind in ("positive", "hyperbolic", "favor++")
    keep = None if key_mask is None else key_mask[..., None]
    fill = _BIG if exp_kind else -np.inf   # a masked key's ‖k̃‖²/2

    def keys(j0, j1):
        kb = k[..., j0:j1, :]
        hb = np.sum(kb * kb, axis=-1, keepdims=True) * (abs(scale) / 2)
        if keep is not None:
            hb = np.where(keep[..., j0:j1, :], hb, fill)
        return kb, hb

    if not exp_kind:
        return _signed_maps(q, k, w, a, kind=kind, causal=causal, keys=keys, keep=keep)
    if causal:
        # keys: a_f + B ω_f·k̃ - ‖k̃‖²/2 - c_f = -‖k̃ - B ω_f‖²/2 <= 0 depends on that key
        # alone; queries carry +c_f and are divided by their own row max
        cq = c if a is None else a + c
        ck = -c if a is None else a - c
        wq = np.swapaxes(_augment(w, col(cq)), -1, -2)
        wk = np.swapaxes(_augment(w, -1.0, col(ck)), -1, -2)

        def key_features(j0, j1):
            ek = _augment(*keys(j0, j1), 1.0) @ wk
            return np.exp(ek, out=ek)
    else:
        # one shift per block of keys, max_j (rowmax(a_j) - ‖k̃_j‖²/2), floored so that
        # an all-masked block (every exponent ~ -_BIG) keeps zero features
        wq = wt if a is None else np.swapaxes(_augment(w, col(a)), -1, -2)

        def key_features(j0, j1):
            kb, hb = keys(j0, j1)
            ak = (kb if a is None else _augment(kb, 1.0)) @ wq   # ω·k̃ (+ a)
            top = np.max(np.max(ak, axis=-1, keepdims=True) - hb, axis=-2, keepdims=True)
            top = np.maximum(top, -_BIG / 2)
            return _exp_shifted(ak, hb + top), top
    augment_q = causal or a is not None

    def query_features(i0, i1):
        qb = q[..., i0:i1, :]
        aq = (_augment(qb, 1.0) if augment_q else qb) @ wq
        return _exp_shifted(aq, np.max(aq, axis=-1, keepdims=True))
    return query_features, key_features
