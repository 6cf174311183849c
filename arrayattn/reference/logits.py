r"""The logits pipeline of exact attention, one tile at a time.

Every option of :func:`arrayattn.softmax_attention` acts on the logits in one order, so
that the options compose and the backward mirrors them (``DESIGN.md`` section 5b):

.. math::

    x = \mathrm{scale}\; q_i\cdot k_j \;\to\; c \tanh(x / c) \;\to\;
    \mathrm{score\_mod}(x, b, h, i, j) \;\to\; x + B_{ij} - m_h\, |i + \delta_i - j|
    \;\to\; \text{visibility}

where ``delta_i`` aligns query ``i`` with key ``i + delta_i`` (``s - n``: end-aligned as
FlashAttention; per segment for packed sequences; per batch element for a paged cache),
and a key is visible when it lies in the window ``[i + delta_i - left, i + delta_i +
right]`` (``causal``: ``right = 0``), in the query's segment, is not masked by
``key_mask``, ``query_mask``, ``mask`` or ``mask_mod``.  :func:`tile_logits` computes the
final logits of the tile ``rows x cols``, which of them are visible, and ``dx/dx_raw``
(the softcap's ``1 - tanh^2`` times ``score_mod``'s slope), what the backward needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from array_api_compat import array_namespace, device

from .finite import poisoned_logits
from .indexing import take_in_bounds

__all__ = ["Logits", "tile_logits", "tile_logits_at", "pick", "segment_ids"]


@dataclass(frozen=True)
class Logits:
    """The options of one exact-attention call, as the pipeline applies them.

    ``shift`` is ``delta``: an int, or an array ``(..., n)`` (per row or batch element).
    ``segments`` is ``(seg_q (n,), seg_k (s,))`` integer arrays for packed sequences.
    ``left``/``right`` ``None`` = unbounded.  ``heads`` is the number of batch axes that
    index heads for ``score_mod``/``mask_mod`` and ALiBi (the axes after the first batch
    axis; grouped-query heads are two axes that flatten to the query head).  ``poison``
    ``(..., s)`` marks the keys whose key or value row is not finite (zeroed by the
    caller): their logits column is NaN, so exactly the rows that see them are NaN
    (:mod:`arrayattn.reference.finite`).
    """

    scale: float
    shift: Any = 0
    left: int | None = None
    right: int | None = None
    softcap: float | None = None
    score_mod: Callable | None = None
    bias: Any = None
    alibi_slopes: Any = None
    key_mask: Any = None
    query_mask: Any = None
    mask: Any = None
    mask_mod: Callable | None = None
    segments: tuple | None = None
    heads: tuple = ()
    poison: Any = None

    @property
    def plain(self) -> bool:
        """Only scale, causal, bias and boolean masks (what the NumPy engine runs)."""
        return (self.left is None and self.right in (None, 0) and self.softcap is None
                and self.score_mod is None and self.alibi_slopes is None
                and self.query_mask is None and self.mask_mod is None
                and self.segments is None and isinstance(self.shift, int))


def segment_ids(cu_seqlens, total: int):
    """The segment of each of ``total`` packed tokens: ``#{b >= 1: cu[b] <= t}``."""
    xp = array_namespace(cu_seqlens)
    t = xp.arange(total, device=device(cu_seqlens))
    return xp.sum(xp.astype(t[:, None] >= cu_seqlens[None, 1:-1], xp.int64), axis=-1)


def _indices(xp, lg: Logits, shape: tuple, rows, cols, dev):
    """FlexAttention's broadcast index arrays ``(b, h, q_idx, kv_idx)`` for a tile of
    ``ndim`` axes: ``b`` the first batch axis, ``h`` the flat index over the head axes."""
    ndim = len(shape)
    q_idx = xp.reshape(rows, (*(1,) * (ndim - 2), -1, 1))
    kv_idx = xp.reshape(cols, (*(1,) * (ndim - 1), -1))
    nb = ndim - 2
    h = xp.zeros((1,) * ndim, dtype=xp.int64, device=dev)
    for axis, size in zip(range(nb - len(lg.heads), nb), lg.heads):
        h = h * size + xp.reshape(xp.arange(size, device=dev),
                                  tuple(size if a == axis else 1 for a in range(ndim)))
    first = nb - len(lg.heads) - 1
    b = (xp.zeros((1,) * ndim, dtype=xp.int64, device=dev) if first < 0 else
         xp.reshape(xp.arange(shape[first], device=dev), tuple(-1 if a == first else 1
                                                              for a in range(ndim))))
    return b, h, q_idx, kv_idx


def tile_logits(lg: Logits, q, k, i0: int, i1: int, j0: int, j1: int, *, slope=False):
    """``(x, visible, dx)`` of the tile ``q[..., i0:i1, :]`` x ``k[..., j0:j1, :]``
    (``q``, ``k`` the whole arrays): the final logits, the boolean visibility (``None``:
    all visible) and, when ``slope`` is asked, ``dx/dx_raw`` (``None``: 1)."""
    return tile_logits_at(lg, q, k, slice(i0, i1), slice(j0, j1), slope=slope)


def pick(x, idx, axis: int):
    """``x`` at ``idx`` along ``axis``: a slice, or an integer index array (a block at an
    offset that is traced under ``jax.jit``; every index in bounds)."""
    axis = axis % x.ndim
    if isinstance(idx, slice):
        return x[(slice(None),) * axis + (idx, ...)]
    return take_in_bounds(x, idx, axis=axis)


def _positions(xp, idx, dev):
    return xp.arange(idx.start, idx.stop, device=dev) if isinstance(idx, slice) else idx


def tile_logits_at(lg: Logits, q, k, rows, cols, *, slope=False):
    """:func:`tile_logits` of the query positions ``rows`` and key positions ``cols``,
    each a slice or an integer index array (see :func:`pick`)."""
    xp = array_namespace(q, k)
    dev = device(q)
    x = (pick(q, rows, -2) * lg.scale) @ xp.matrix_transpose(pick(k, cols, -2))
    r, c = _positions(xp, rows, dev), _positions(xp, cols, dev)
    diag = (r + lg.shift)[:, None] if isinstance(lg.shift, int) else (
        pick(lg.shift, rows, -1)[..., None] + r[:, None])
    dx = None
    if lg.softcap is not None:
        t = xp.tanh(x / lg.softcap)
        x, dx = lg.softcap * t, (1.0 - t * t if slope else None)
    idx = (_indices(xp, lg, tuple(x.shape), r, c, dev)
           if lg.score_mod is not None or lg.mask_mod is not None else None)
    if lg.score_mod is not None:
        x, mod_dx = _with_slope(lg.score_mod, x, idx) if slope else (lg.score_mod(x, *idx), None)
        dx = mod_dx if dx is None else (None if mod_dx is None else dx * mod_dx)
    if lg.bias is not None:
        x = x + pick(pick(lg.bias, rows, -2), cols, -1)
    if lg.alibi_slopes is not None:
        x = x - lg.alibi_slopes[..., None, None] * xp.astype(xp.abs(diag - c), x.dtype)
    if lg.poison is not None:
        x = poisoned_logits(x, pick(lg.poison, cols, -1))
    visible = []
    if lg.left is not None:
        visible.append(c >= diag - lg.left)
    if lg.right is not None:
        visible.append(c <= diag + lg.right)
    if lg.segments is not None:
        visible.append(pick(lg.segments[0], rows, 0)[:, None]
                       == pick(lg.segments[1], cols, 0)[None, :])
    if lg.key_mask is not None:
        visible.append(pick(lg.key_mask, cols, -1)[..., None, :])
    if lg.query_mask is not None:
        visible.append(pick(lg.query_mask, rows, -1)[..., None])
    if lg.mask is not None:
        visible.append(pick(pick(lg.mask, rows, -2), cols, -1))
    if lg.mask_mod is not None:
        visible.append(xp.astype(lg.mask_mod(*idx), xp.bool))
    allowed = None
    for v in visible:
        allowed = v if allowed is None else allowed & v
    return x, allowed, dx


def _with_slope(score_mod, x, idx):
    """``score_mod(x, ...)`` and its elementwise derivative in ``x`` by a central
    difference (``score_mod`` is a user callable: no symbolic derivative), step
    ``eps^(1/3) max(1, |x|)`` -- error ``~eps^(2/3)`` relative."""
    xp = array_namespace(x)
    eps = 2.0 ** -52 if x.dtype == xp.float64 else 2.0 ** -23
    h = eps ** (1 / 3) * xp.maximum(xp.abs(x), 1.0)
    up, down = score_mod(x + h, *idx), score_mod(x - h, *idx)
    return score_mod(x, *idx), (up - down) / (2.0 * h)
