"""The NumPy engine of exact attention's backward: query row blocks in threads.

Each block of ``R`` query rows of one batch element takes its scores against every key it may see at once
(``R x s`` per batch element: the softmax normalises there and then, so no log-sum-exp
has to be kept between passes), and applies FlashAttention-2's backward equations to it
in place: ``P``, ``O = P V``, ``D = rowsum(dO O)``, ``dV += P^T dO``,
``dS = P (dO V^T - D)``, ``dQ = scale dS K``, ``dK += scale dS^T Q``.  Two ``R x s``
tiles per thread in reused scratch buffers; ``dK``, ``dV`` are accumulated per thread and
summed at the end.  Causal blocks read only the keys up to their last visible one.
Equal to :func:`arrayattn.reference.softmax_attention_vjp` to rounding.

Memory: ``2 R s`` per thread for the tiles (``R`` chosen so that a tile
is about :data:`TILE_BYTES`), plus ``dK``, ``dV`` per thread and the returned gradients.
Measured numbers: ``benchmarks/results/backward.md``.
"""
from __future__ import annotations

import threading

import numpy as np

from .exact import allowed_tile, mask_scores
from .parallel import parallel_map, scratch

__all__ = ["vjp", "TILE_BYTES"]

#: Target size of one ``R x s`` score tile (one batch element; ``R`` at least 64 rows, so
#: that the matmuls stay efficient).
TILE_BYTES = 1 << 23


def vjp(q, k, v, do, *, scale, causal, key_mask, mask):
    """``{"q": dQ, "k": dK, "v": dV}`` (broadcast batch shapes) of exact attention."""
    n, s, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    shift = s - n
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], do.shape[:-2])
    rows = max(64, min(n, TILE_BYTES // max(1, s * q.itemsize)))
    items = [(b, i0, min(i0 + rows, n)) for b in np.ndindex(batch) for i0 in range(0, n, rows)]
    dq = np.zeros((*batch, n, d), dtype=q.dtype)
    accumulators, guard = {}, threading.Lock()

    def at(x, b, tail: int):
        """Batch element ``b`` of ``x`` (broadcast axes read at index 0)."""
        lead = x.shape[:x.ndim - tail]
        return x[tuple(i if size > 1 else 0 for i, size in zip(b[len(b) - len(lead):], lead))]

    def block(item):
        b, i0, i1 = item
        end = max(0, min(s, i1 + shift)) if causal else s
        if end == 0:
            return
        with guard:
            dk, dv_ = accumulators.setdefault(threading.get_ident(), (
                np.zeros((*batch, s, d), dtype=q.dtype), np.zeros((*batch, s, dv), dtype=q.dtype)))
        qb, dob = at(q, b, 2)[i0:i1] * scale, at(do, b, 2)[i0:i1]
        kb, vb = at(k, b, 2)[:end], at(v, b, 2)[:end]
        p = np.matmul(qb, kb.T, out=scratch((i1 - i0, end), q.dtype, "p"))
        # Causal alone: only the columns from the block's first diagonal key on can be
        # hidden, so only that (R, <= R) slab is masked.
        c0 = max(0, min(end, i0 + shift + 1)) if key_mask is None and mask is None else 0
        slab = p[:, c0:end]
        masked = mask_scores(slab, allowed_tile(
            i1 - i0, end - c0, causal=causal, shift=shift, row0=i0, col0=c0,
            key_mask=None if key_mask is None else at(key_mask, b, 1)[c0:end],
            mask=None if mask is None else at(mask, b, 2)[i0:i1, c0:end]))
        if masked is not slab:
            slab[...] = masked
        m = p.max(axis=-1, keepdims=True)
        m[m == -np.inf] = 0.0
        p -= m
        np.exp(p, out=p)
        total = p.sum(axis=-1, keepdims=True)
        p /= np.where(total > 0, total, 1.0)
        delta = np.sum(dob * (p @ vb), axis=-1, keepdims=True)
        dv_[b][:end] += p.T @ dob
        ds = np.matmul(dob, vb.T, out=scratch(p.shape, q.dtype, "ds"))
        ds -= delta
        ds *= p
        np.matmul(ds, kb, out=dq[b][i0:i1])
        dq[b][i0:i1] *= scale
        dk[b][:end] += ds.T @ qb

    parallel_map(block, items)
    if not accumulators:
        return {"q": dq, "k": np.zeros((*batch, s, d), q.dtype),
                "v": np.zeros((*batch, s, dv), q.dtype)}
    (dk, dv_), *rest = accumulators.values()
    for other_k, other_v in rest:
        dk += other_k
        dv_ += other_v
    return {"q": dq, "k": dk, "v": dv_}
