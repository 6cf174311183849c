"""The backward adapter of :func:`arrayattn.pooling_attention` (``poolingformer``).

The equations are in :mod:`arrayattn.reference.pooling_vjp`: level 1 and level 2 run the
gathered sparse backward (:func:`arrayattn.backward.sparse.block_sparse_vjp`) on their
layouts, and the pooled keys' and values' cotangents go back to the positions they pool
through the gather adjoint :func:`arrayattn.reference.pool_windows_vjp` (``O(s κ c)``).
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np

from .. import reference
from ..core.engine import entry
from ..sparse.tiles import host_indices
from ..core.pipeline import implementation, working
from ..sparse.pooling import SPEC, checked_pooling, dense_masks, level2, pool_keys
from ..reference.exact_vjp import sum_to_shape
from .sparse import block_sparse_vjp

__all__ = ["pooling_attention_vjp", "pool_windows", "VJP_SPEC"]


def pool_windows(start, end, s: int):
    """Host index data of the pooling windows: ``idx (m, κ)`` the position read by each
    window slot (clamped), ``inside (m, κ)`` which slots are in the interval, and
    ``spread (s, u)`` the flat slots ``t κ + o`` that hold each position (padded with
    ``m κ``, a slot of zeros): the map that turns the pooling's adjoint into a gather."""
    kappa = int((end - start).max()) + 1
    offs = start[:, None] + np.arange(kappa)
    inside = offs <= end[:, None]
    slots = np.flatnonzero(inside)
    pos = offs.reshape(-1)[slots]
    order = np.argsort(pos, kind="stable")
    pos, slots = pos[order], slots[order]
    rank = np.arange(pos.size) - np.searchsorted(pos, pos)        # index among its windows
    spread = np.full((s, int(rank.max()) + 1), inside.size, dtype=np.int64)
    spread[pos, rank] = slots
    return np.minimum(offs, s - 1), inside, spread


def _unpool(xp, x, dbar, windows, key_mask, pool, dev):
    """``x``'s cotangent from the pooled rows' (``windows`` of :func:`pool_windows`)."""
    idx, inside, spread = windows
    m, kappa = idx.shape
    flat = host_indices(xp, idx.reshape(-1), dev)
    rows = xp.reshape(xp.take(x, flat, axis=x.ndim - 2), (*x.shape[:-2], m, kappa, x.shape[-1]))
    keep = xp.expand_dims(host_indices(xp, inside, dev), axis=-1) > 0         # (m, κ, 1)
    if key_mask is not None:
        kmg = xp.take(key_mask, flat, axis=key_mask.ndim - 1)
        keep = keep & xp.reshape(kmg, (*key_mask.shape[:-1], m, kappa, 1))
    return reference.pool_windows_vjp(rows, keep, dbar, host_indices(xp, spread, dev),
                                      pool=pool)


def pooling_attention_vjp(q, k, v, do, /, *, window=128, pool_window=512, pool_size=4,
                          pool_stride=None, pool="mean", q2=None, k2=None, v2=None,
                          scale=None, causal=False, key_mask=None, block_size=64):
    """``{"q", "k", "v"[, "q2", "k2", "v2"]}`` of :func:`~arrayattn.pooling_attention`:
    the level-2 arguments get their own cotangent when given, else theirs is added to
    ``q``, ``k``, ``v``.  Max pooling: each channel's cotangent goes to the positions
    that attain the maximum, split evenly between ties (as ``torch.amax`` and
    ``jax.numpy.max``)."""
    c = checked_pooling(q, k, v, window=window, pool_window=pool_window, pool_size=pool_size,
                        pool_stride=pool_stride, pool=pool, q2=q2, k2=k2, v2=v2, scale=scale,
                        causal=causal, key_mask=key_mask, block_size=block_size)
    p, xp, dev, km = c.p, c.p.xp, c.p.device, c.key_mask
    args = {"q": q, "k": k, "v": v, "q2": q2, "k2": k2, "v2": v2}
    if p.empty:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=dev)
                for name, x in args.items() if x is not None}
    w = working(p, q, k, v, km)
    wdo = xp.astype(do, p.work_dtype, copy=False)
    with entry(xp):
        grads = implementation(VJP_SPEC, c, w)(c, w, wdo)
    for name in ("q", "k", "v"):
        if args[name + "2"] is None:          # level 2 ran on q, k, v themselves
            grads[name] = grads[name] + grads.pop(name + "2")
    return {name: sum_to_shape(g, args[name].shape) for name, g in grads.items()}


def _dense_vjp(c, w, do) -> dict:
    return reference.pooling_attention_vjp(
        w.q, w.k, w.v, *level2(c, w), *dense_masks(c), do, scale=c.scale, scale2=c.scale2,
        key_mask=c.key_mask, pool=c.pool)


def _levels_vjp(c, w, do, *, threads: bool) -> dict:
    """Both levels' gathered backwards (``threads``: their chunks on the NumPy engine's
    threads), the pooled keys' and values' cotangents taken back to the positions."""
    p, xp, dev, km = c.p, c.p.xp, c.p.device, c.key_mask
    wq2, wk2, wv2 = level2(c, w)
    g1 = block_sparse_vjp(p, w.q * c.scale, w.k, w.v, do, c.lay1, causal=c.causal,
                          key_mask=km, threads=threads)
    kbar, valid = pool_keys(xp, wk2, c.start, c.end, c.pool, km, device=dev)
    vbar, _ = pool_keys(xp, wv2, c.start, c.end, c.pool, km, device=dev)
    g2 = block_sparse_vjp(c.pm, wq2 * c.scale2, kbar, vbar, do, c.lay2, causal=c.causal,
                          key_mask=valid, threads=threads)
    windows = pool_windows(c.start, c.end, p.s)
    return {"q": g1["q"] * c.scale, "k": g1["k"], "v": g1["v"], "q2": g2["q"] * c.scale2,
            "k2": _unpool(xp, wk2, g2["k"], windows, km, c.pool, dev),
            "v2": _unpool(xp, wv2, g2["v"], windows, km, c.pool, dev)}


#: The backward of :func:`~arrayattn.pooling_attention`, as the pipeline chooses it
#: (:func:`arrayattn.core.pipeline.implementation`): the forward's spec -- its work estimate
#: (the larger level's scores) and score count -- with the backward's forms, which take
#: the cotangent ``do`` too.
VJP_SPEC = replace(SPEC, name="pooling_attention_vjp",
                   reference=partial(_levels_vjp, threads=False),
                   engine=partial(_levels_vjp, threads=True), dense=_dense_vjp)
