"""Poolingformer: sliding-window attention plus attention to pooled keys of a larger window.

Zhang et al. 2021, "Poolingformer: Long Document Modeling with Pooling Attention"
(ICML 2021, arXiv:2105.04371). Both levels run on the block-sparse executor of
:mod:`arrayattn.sparse`: the first is a :func:`~arrayattn.local_layout` band, the second a
band over pooled keys, each of which stands for the interval of positions it pools.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .. import reference
from ..core.checks import (Problem, check_band, check_choice, check_flag, check_key_mask,
                           check_positive_int, check_qkv, check_scale)
from .checks import check_level2
from ..core.xp import xp_from_host
from ..core.pipeline import Spec, Working, run
from ..reference.indexing import take_in_bounds
from ..reference.masks import zero_masked_keys
from .executor import block_sparse_attention
from .._numpy.sparse import take_rows
from .layout import BlockLayout, num_blocks
from .patterns import local_layout
from .tiles import host_indices

__all__ = ["pooling_attention", "pooled_spans", "pool_keys", "PoolingCall", "checked_pooling",
           "level2", "dense_masks", "SPEC"]


def pooled_spans(s: int, pool_size: int, pool_stride: int | None = None):
    """Intervals pooled into the compressed keys: ``(start, end)`` host int arrays.

    Pooled key ``t`` covers positions ``t*stride ... min(t*stride + pool_size, s) - 1``
    for ``t = 0 ... m-1``, ``m = ceil(max(s - pool_size, 0) / stride) + 1``: every
    position is covered when ``stride <= pool_size``; the last interval may be short.

    Examples
    --------
    >>> from arrayattn import pooled_spans
    >>> start, end = pooled_spans(10, 4, 3)
    >>> start.tolist(), end.tolist()
    ([0, 3, 6], [3, 6, 9])
    >>> [e.tolist() for e in pooled_spans(11, 4, 3)]  # the last interval is short
    [[0, 3, 6, 9], [3, 6, 9, 10]]
    """
    s = check_positive_int("s", s)
    kappa = check_positive_int("pool_size", pool_size)
    zeta = kappa if pool_stride is None else check_positive_int("pool_stride", pool_stride)
    m = -(-max(s - kappa, 0) // zeta) + 1
    start = np.arange(m, dtype=np.int64) * zeta
    end = np.minimum(start + kappa, s) - 1
    return start, end


def pool_keys(xp, x, start, end, kind: str, key_mask, *, device, threads: bool = False):
    """Pool ``x (..., s, c)`` over the intervals: ``(..., m, c)`` and which pooled
    rows saw at least one real key ``(..., m)`` (``None`` when all did).  ``threads``
    (the NumPy engine): the gathered rows in the engine's workspace, the rows outside
    an interval set in place (the same values as the ``where``)."""
    kappa = int((end - start).max()) + 1
    offs = start[:, None] + np.arange(kappa)                       # (m, kappa)
    inside = offs <= end[:, None]
    idx = np.minimum(offs, x.shape[-2] - 1).reshape(-1)
    m = start.size
    idx = host_indices(xp, idx, device)
    g = (take_rows(x, idx) if threads else take_in_bounds(x, idx, axis=x.ndim - 2))
    g = xp.reshape(g, (*x.shape[:-2], m, kappa, x.shape[-1]))      # (..., m, kappa, c)
    keep = xp.expand_dims(host_indices(xp, inside, device), axis=-1) > 0   # (m, kappa, 1)
    if key_mask is not None:
        kmg = take_in_bounds(key_mask, idx, axis=key_mask.ndim - 1)
        kmg = xp.reshape(kmg, (*key_mask.shape[:-1], m, kappa, 1))
        keep = keep & kmg
    count = xp.sum(xp.astype(keep, x.dtype), axis=-2)              # (..., m, 1)
    zero = xp.zeros((), dtype=x.dtype, device=device)
    fill = zero if kind == "mean" else -xp.inf
    if threads and np.broadcast_shapes(keep.shape, g.shape) == g.shape:
        np.copyto(g, fill, where=~keep)      # the where's value, in the workspace
    else:
        g = xp.where(keep, g, fill)
    if kind == "mean":
        pooled = xp.sum(g, axis=-2) / xp.where(count > 0, count, 1.0)
    else:
        pooled = xp.where(count > 0, xp.max(g, axis=-2), zero)
    valid = None
    if key_mask is not None:
        valid = count[..., 0] > 0
    return pooled, valid


def pooling_attention(q, k, v, /, *, window=128, pool_window=512, pool_size=4,
                      pool_stride=None, pool="mean", q2=None, k2=None, v2=None, scale=None,
                      causal=False, key_mask=None, block_size=64):
    r"""Poolingformer's two-level attention (Zhang et al. 2021).

    .. math::

        O_i = \underbrace{\sum_{|j - i'| \le w_1} \operatorname{softmax}_j(\mathrm{scale}\;
              q_i \cdot k_j)\, v_j}_{y_i:\ \text{level 1, sliding window}}
            \;+\; \underbrace{\sum_{t:\ P_t \subseteq [i' - w_2,\, i' + w_2]}
              \operatorname{softmax}_t(\mathrm{scale}_2\; q^{(2)}_i \cdot \bar k_t)\,
              \bar v_t}_{z_i:\ \text{level 2, pooled}}

    where ``P_t`` is the interval of :func:`pooled_spans` (``pool_size`` κ, ``pool_stride``
    ζ) and ``k̄_t = Pool(k^{(2)}_{P_t})``, ``v̄_t = Pool(v^{(2)}_{P_t})`` (mean or max over
    the real keys of the interval). Each level is a separately normalised exact softmax;
    the paper adds the two outputs (its residual connection around the layer is the
    caller's). Level 2 sees only pooled keys whose whole interval lies in the larger
    window ``w_2`` (and, when causal, ends at or before ``i'``), so no future key ever
    enters a past query's pooled keys. Both levels run block-sparse: time and memory
    ``O(n (w_1 + w_2/ζ + 2b) d)``.

    Parameters
    ----------
    q, k, v : arrays ``(..., n, d)``, ``(..., s, d)``, ``(..., s, dv)``
        Level-1 queries, keys, values (also level 2's unless ``q2``/``k2``/``v2``).
    window : int or (int, int)
        ``w_1``: keys on each side of the first-level window (as :func:`local_attention`).
    pool_window : int or (int, int)
        ``w_2``: positions on each side of the second-level window.
    pool_size, pool_stride : int
        Kernel κ and stride ζ of the pooling (``pool_stride=None`` means ζ = κ).
    pool : {"mean", "max"}
        Element-wise mean or max over the real keys of each interval. (Max pooling is
        not linear in ``v``; mean pooling is.)
    q2, k2, v2 : arrays, optional
        Level-2 queries ``(..., n, d2)``, keys ``(..., s, d2)`` and values
        ``(..., s, dv)``. In the paper they are learned projections (of the first
        level's output, in its stacked form); arrayattn has no weights, so the caller
        passes them. ``None`` uses ``q``, ``k``, ``v``.
    scale : float, optional
        Both levels; ``None`` means ``1/sqrt(d)`` (``1/sqrt(d2)`` for level 2).
    causal : bool
        Level 1 sees ``i' - w_1 ... i'``; level 2 pooled keys whose interval ends by ``i'``.
    key_mask : boolean array ``(..., s)``, optional
        Padded keys are left out of level 1 and of the pooling; a pooled key with no
        real key is masked.
    block_size : int
        Granularity of the block-sparse computation (not of the result).

    Returns
    -------
    array, shape ``(..., n, dv)``
        ``y + z``; rows of the implied matrix sum to 2 where both levels see a key.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import local_attention, pooling_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 64, 8)) for _ in range(3))
    >>> out = pooling_attention(q, k, v, window=4, pool_window=16, pool_size=4)
    >>> out.shape
    (2, 64, 8)
    >>> bool(np.allclose(pooling_attention(q, k, np.ones((2, 64, 1)), window=4,
    ...                                    pool_window=16, pool_size=4), 2.0))
    True
    """
    return run(SPEC, q, k, v, window=window, pool_window=pool_window, pool_size=pool_size,
               pool_stride=pool_stride, pool=pool, q2=q2, k2=k2, v2=v2, scale=scale,
               causal=causal, key_mask=key_mask, block_size=block_size)


@dataclass(frozen=True)
class PoolingCall:
    """A validated :func:`pooling_attention` call: the problem ``p`` and the pooled
    level's ``pm``; the level-2 arrays ``q2, k2, v2`` in the working dtype, masked keys'
    rows zeroed (``None``: level 2 runs on ``q``, ``k``, ``v``); the scales, the pooling,
    causal; the spans ``start, end`` and the layouts ``lay1, lay2`` of the two levels
    (``None`` when ``s = 0``)."""

    p: Problem
    pm: Problem | None
    key_mask: Any
    q2: Any
    k2: Any
    v2: Any
    scale: float
    scale2: float
    pool: str
    causal: bool
    start: Any = None
    end: Any = None
    lay1: BlockLayout | None = None
    lay2: BlockLayout | None = None


def checked_pooling(q, k, v, *, window=128, pool_window=512, pool_size=4, pool_stride=None,
                    pool="mean", q2=None, k2=None, v2=None, scale=None, causal=False,
                    key_mask=None, block_size=64) -> PoolingCall:
    """Validate a :func:`pooling_attention` call once (shared with its backward): the
    options, the level-2 arrays (cast, masked keys zeroed) and the two levels' layouts."""
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    check_key_mask(p, key_mask, q)
    pool = check_choice("pool", pool, {"mean", "max"})
    w1 = check_band("window", window)
    w2 = check_band("pool_window", pool_window)
    kappa = check_positive_int("pool_size", pool_size)
    zeta = kappa if pool_stride is None else check_positive_int("pool_stride", pool_stride)
    b = check_positive_int("block_size", block_size)
    p2 = check_level2(p, q, k, v, q2, k2, v2)
    xp, wd = p.xp, p.work_dtype
    wq2 = None if q2 is None else xp.astype(q2, wd, copy=False)
    # A padded key's row (even NaN or inf) must not matter: zeroed once, both levels.
    wk2, wv2 = (None if x is None else zero_masked_keys(key_mask, xp.astype(x, wd, copy=False))
                for x in (k2, v2))
    level = dict(p=p, key_mask=key_mask, q2=wq2, k2=wk2, v2=wv2, scale=check_scale(scale, p.d),
                 scale2=check_scale(scale, p2.d), pool=pool, causal=causal)
    if p.empty:                  # no query, key or head: no layout (the output is zeros)
        return PoolingCall(pm=None, **level)
    start, end = pooled_spans(p.s, kappa, zeta)
    lay2 = BlockLayout(n=p.n, s=start.size, block_size=b,
                       blocks=np.zeros((num_blocks(p.n, b), num_blocks(start.size, b)), bool),
                       window=(w2[0], 0 if causal else w2[1]), causal=causal,
                       key_start=start, key_end=end, query_offset=p.s - p.n, pattern="pooled")
    pm = type(p2)(xp=xp, n=p.n, s=start.size, d=p2.d, dv=p.dv, batch=p.batch,
                  dtype=p.dtype, work_dtype=wd, device=p.device)
    return PoolingCall(pm=pm, start=start, end=end, lay2=lay2, **level,
                       lay1=local_layout(p.n, s=p.s, window=w1, block_size=b, causal=causal))


def level2(call: PoolingCall, w: Working):
    """The level-2 ``(q2, k2, v2)`` in the working dtype (``w``'s where not given)."""
    return tuple(w_x if x is None else x
                 for x, w_x in ((call.q2, w.q), (call.k2, w.k), (call.v2, w.v)))


def dense_masks(c: PoolingCall):
    """The dense reference form's masks of a checked call: the window ``(n, s)``, the
    intervals ``inside (m, s)`` and the pooled window ``(n, m)``, on ``c.p``'s device."""
    xp, dev = c.p.xp, c.p.device
    pos = np.arange(c.p.s)
    inside = (c.start[:, None] <= pos) & (pos <= c.end[:, None])
    return (c.lay1.dense_mask(xp, device=dev), xp_from_host(xp, inside, dtype=xp.bool, device=dev),
            c.lay2.dense_mask(xp, device=dev))


def _dense(call: PoolingCall, w: Working):
    return reference.pooling_attention(w.q, w.k, w.v, *level2(call, w), *dense_masks(call),
                                       scale=call.scale, scale2=call.scale2,
                                       key_mask=call.key_mask, pool=call.pool)


def _levels(call: PoolingCall, w: Working, *, threads: bool):
    """Both levels on the block-sparse executor (``threads``: its chunks on the NumPy
    engine's threads, else its scans)."""
    xp, dev, km = call.p.xp, call.p.device, call.key_mask
    q2, k2, v2 = level2(call, w)
    y = block_sparse_attention(call.p, w.q, w.k, w.v, call.lay1, scale=call.scale,
                               causal=call.causal, key_mask=km, threads=threads)
    kbar, valid = pool_keys(xp, k2, call.start, call.end, call.pool, km, device=dev,
                            threads=threads)
    vbar, _ = pool_keys(xp, v2, call.start, call.end, call.pool, km, device=dev,
                        threads=threads)
    # NumPy: the level-2 output in the engine's workspace, added into y (this call's own
    # array): no output-sized array but the result
    y2 = block_sparse_attention(call.pm, q2, kbar, vbar, call.lay2, scale=call.scale2,
                                causal=call.causal, key_mask=valid, threads=threads,
                                into="pooled_level" if threads else None)
    if threads and np.broadcast_shapes(y.shape, y2.shape) == y.shape:
        y += y2
        return y
    return y + y2


def _work(call: PoolingCall, w: Working) -> int:
    """The bytes of the larger level's scores (each level's executor weighs its own)."""
    p = call.p
    scores = max(call.lay1.count_computed(), call.lay2.count_computed())
    return scores * math.prod(p.batch) * (p.xp.finfo(p.work_dtype).bits // 8)


#: The pipeline of :func:`pooling_attention`.
SPEC = Spec(name="pooling_attention", check=checked_pooling,
            reference=partial(_levels, threads=False), engine=partial(_levels, threads=True),
            work=_work, dense=_dense,
            scores=lambda call: math.prod(call.p.batch) * call.p.n * call.p.s,
            none_means={"pool_stride": "pool_size (no overlap)", "q2": "q", "k2": "k",
                        "v2": "v", "scale": "1/sqrt(d) (1/sqrt(d2) for level 2)",
                        "key_mask": "every key is real"})
