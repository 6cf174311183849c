"""Exact softmax attention, dense and blockwise (FlashAttention's online softmax).

.. math::

    \\operatorname{Attn}(Q, K, V) = \\operatorname{softmax}(Q K^\\top \\cdot \\text{scale}
    + \\text{masks})\\, V

Vaswani et al. 2017, "Attention Is All You Need"; the blockwise recurrence is that of
Dao et al. 2022 / Dao 2023 ("FlashAttention", "FlashAttention-2"), itself the online
softmax of Milakov & Gimelshein 2018.
"""
from __future__ import annotations

import functools
import operator

import array_api_compat

from ._validate import (Problem, check_key_mask, check_mask, check_positive_int,
                        check_qkv, check_scale)
from ._parallel import exp_shifted_, fill_where_, map_rows, matmul_into, reduce_axis, update_
from ._xp import xp_causal_mask
from .registry import Variant, register

__all__ = ["softmax_attention", "masked_softmax", "attend", "combine_masks", "merge_blocks"]


def combine_masks(xp, *, n: int, s: int, device, causal: bool = False, key_mask=None,
                  mask=None, row0: int = 0, col0: int = 0, shift: int | None = None):
    """AND of the causal pattern, ``key_mask (..., s)`` and ``mask (..., n, s)``.

    Returns ``None`` when nothing is masked.  ``row0``/``col0`` place an ``(n, s)`` tile
    inside a larger problem whose causal shift (``S - N``) is ``shift``.
    """
    allowed = None
    if causal:
        shift = s - n if shift is None else shift
        allowed = xp_causal_mask(xp, n, s, device=device, row0=row0 + shift, col0=col0)
    if key_mask is not None:
        km = xp.expand_dims(key_mask, axis=-2)
        allowed = km if allowed is None else (allowed & km)
    if mask is not None:
        allowed = mask if allowed is None else (allowed & mask)
    return allowed


def _shifted_exp(xp, scores, allowed, axis: int = -1, consume: bool = False):
    """``exp(scores - rowmax)`` over the ``allowed`` entries, its row sums and row max.

    The row max cancels in every ratio that uses these, so logits of any size are
    safe.  A row with no allowed entry is shifted by 0 (not by ``-inf``, which would
    give NaN) and so is all zeros.  ``consume``: ``scores`` is the caller's temporary
    and may be overwritten (NumPy, CuPy: no second score-sized array).
    """
    if allowed is not None:
        scores = fill_where_(xp, scores, ~allowed, -xp.inf) if consume else \
            xp.where(allowed, scores, -xp.inf)
        consume = True
    m = reduce_axis(xp, xp.max, scores, axis)
    if allowed is not None:
        m = xp.where(m == -xp.inf, 0.0, m)
    p = exp_shifted_(xp, scores, m) if consume else xp.exp(scores - m)
    return p, reduce_axis(xp, xp.sum, p, axis), m


def unshifted_first(xp) -> bool:
    """Whether to try ``exp`` without a stabilising shift first (NumPy only).

    The max and the subtraction of a stabilised softmax are two of its five passes over
    the scores.  For the logits of real inputs (``|logit|`` in the tens) ``exp`` needs no
    shift, but only the sums can tell, and reading them on the host is free on NumPy
    alone (a device sync elsewhere); see :func:`unshifted_sums_ok`.
    """
    return array_api_compat.is_numpy_namespace(xp)


def unshifted_quietly(xp):
    """Context for an unshifted attempt: NumPy's overflow and invalid-value warnings
    off, since :func:`unshifted_sums_ok` catches those cases and the caller redoes them
    (NumPy's error state is per thread: enter it inside each worker)."""
    import numpy as np
    return np.errstate(over="ignore", under="ignore", invalid="ignore")


def unshifted_sums_ok(xp, total, weight: float = 1.0) -> bool:
    """Whether the sums ``total`` of unshifted ``exp(logits)`` say that no shift was needed.

    Every sum must be finite (no ``exp`` overflowed) and at least ``sqrt(1 / max)`` of
    the dtype (``e^-44`` in float32, ``e^-354`` in float64).  The terms that ``exp``
    flushed to subnormals or zero are each below the smallest normal number (``e^-87``
    in float32), so ``t`` of them are below ``t e^-43`` of the sum: less than one float32
    rounding of it for any ``t`` up to ``10^11``.  Large sums lose nothing (floating
    point is relative), but a product of the weights with values of size up to
    ``weight`` must not overflow: ``max(total) * weight`` must stay finite too.  NaN
    fails.  False: redo with the max shift.
    """
    info = xp.finfo(total.dtype)
    top = info.max / max(1.0, weight) if weight == weight else -info.max  # NaN: fail
    return bool(xp.min(total) >= info.max ** -0.5) and bool(xp.max(total) <= top)


def masked_softmax(xp, scores, allowed=None, *, axis: int = -1, consume: bool = False):
    """``softmax(scores)`` along ``axis`` over the ``allowed`` entries.

    Disallowed entries get weight 0; a row with no allowed entry is all zeros (not NaN).
    ``consume=True`` lets it overwrite ``scores`` (a temporary of the caller).
    """
    p, total, _ = _shifted_exp(xp, scores, allowed, axis, consume)
    return p / xp.where(total > 0, total, 1.0)


def attend(xp, scores, v, allowed=None, *, return_lse: bool = False,
           consume: bool = False):
    """``softmax(scores) @ v`` over ``allowed`` keys, with empty rows -> 0.

    ``scores (..., n, s)`` are already scaled.  With ``return_lse`` also returns the
    log-sum-exp of the allowed scores ``(..., n)`` (``-inf`` for an empty row), which
    lets partial attentions over disjoint key sets be merged exactly.  Normalising
    after the product costs ``n dv`` divisions instead of ``n s``.  ``consume=True``
    lets it overwrite ``scores`` (a temporary of the caller).
    """
    p, total, m = _shifted_exp(xp, scores, allowed, consume=consume)
    safe = xp.where(total > 0, total, 1.0)
    out = update_(xp, p @ v, operator.truediv, safe)
    if not return_lse:
        return out
    lse = xp.where(total > 0, xp.log(safe) + m, -xp.inf)
    return out, lse[..., 0]


def merge_blocks(xp, terms, shifts):
    """``sum_b e^{shift_b - max_b shift_b} term_b``: partial results of disjoint key blocks,
    each computed with its own stabiliser ``shift_b`` (divided by ``e^{shift_b}``), merged
    as the online softmax merges blocks (the same as one shift for all keys).

    ``shifts`` broadcast against their terms; a shift may be ``-inf`` (a block with no
    allowed key, whose term is 0): it gets weight 0, and an all ``-inf`` shift no NaN.
    """
    if len(terms) == 1:
        return terms[0]
    top = functools.reduce(xp.maximum, shifts)
    top = xp.where(top == -xp.inf, 0.0, top)
    return functools.reduce(operator.add,
                            (xp.exp(c - top) * t for t, c in zip(terms, shifts)))


def _dense(p: Problem, q, k, v, *, causal, key_mask, mask):
    xp = p.xp
    scores = q @ xp.matrix_transpose(k)
    allowed = combine_masks(xp, n=p.n, s=p.s, device=p.device, causal=causal,
                            key_mask=key_mask, mask=mask)
    return attend(xp, scores, v, allowed, consume=True)


def _blockwise(p: Problem, q, k, v, *, causal, key_mask, mask, block_size: int):
    """FlashAttention's online softmax over query blocks and key blocks.

    For each query block the running row max ``m`` and the unnormalised output ``acc``
    are carried over key blocks: ``m' = max(m, rowmax(S_ij))``,
    ``acc' = acc e^{m - m'} + e^{S_ij - m'} [V_j, 1]``; the block's output is
    ``acc[:, :dv] / acc[:, dv]``.  The column of ones appended to ``V`` makes the
    denominator ``l`` the last column of the same matmul (no row-sum pass).  Query blocks
    are independent: on NumPy they run in parallel threads (:mod:`arrayattn._parallel`),
    one ``(block, block)`` score tile per batch element and thread.
    """
    xp = p.xp
    n, s, shift = p.n, p.s, p.s - p.n
    masked = causal or key_mask is not None or mask is not None
    v1 = xp.concat([v, xp.ones((*v.shape[:-1], 1), dtype=v.dtype, device=p.device)],
                   axis=-1)

    def query_block(rows, out):
        i0, i1 = rows
        qb = q[..., i0:i1, :]
        m = xp.full((*p.batch, i1 - i0, 1), -xp.inf, dtype=p.work_dtype, device=p.device)
        acc = xp.zeros((*p.batch, i1 - i0, p.dv + 1), dtype=p.work_dtype, device=p.device)
        # Causal: key blocks entirely after the last query of this block are skipped.
        j_end = s if not causal else max(0, min(s, i1 + shift))
        for j0 in range(0, j_end, block_size):
            j1 = min(j0 + block_size, s)
            # Slice k's rows, then transpose: a contiguous block whose transpose BLAS
            # reads in place (slicing columns of k^T gives a strided operand, ~3x slower).
            sc = matmul_into(xp, qb, xp.matrix_transpose(k[..., j0:j1, :]), "scores")
            tile_causal = causal and (j1 - 1 > i0 + shift)  # some key in the future
            allowed = combine_masks(
                xp, n=i1 - i0, s=j1 - j0, device=p.device, causal=tile_causal,
                key_mask=None if key_mask is None else key_mask[..., j0:j1],
                mask=None if mask is None else mask[..., i0:i1, j0:j1],
                row0=i0, col0=j0, shift=shift,
            )
            if allowed is not None:
                sc = fill_where_(xp, sc, ~allowed, -xp.inf)
            m_new = xp.maximum(m, xp.max(sc, axis=-1, keepdims=True))
            # A row with no allowed key yet keeps m = -inf (so a later, smaller max is
            # still taken as its max) but is shifted by 0, not -inf: exp(-inf) = 0, no NaN.
            shift_by = xp.where(m_new == -xp.inf, 0.0, m_new) if masked else m_new
            pt = exp_shifted_(xp, sc, shift_by)
            corr = xp.exp(m - shift_by)
            acc = update_(xp, update_(xp, acc, operator.mul, corr), operator.add,
                          matmul_into(xp, pt, v1[..., j0:j1, :], "pv"))
            m = m_new
        l = acc[..., p.dv:]
        return acc[..., :p.dv] / xp.where(l > 0, l, 1.0)

    return map_rows(xp, query_block,
                    [(i0, min(i0 + block_size, n)) for i0 in range(0, n, block_size)],
                    shape=(*p.batch, n, p.dv), dtype=p.work_dtype)


def softmax_attention(q, k, v, /, *, scale=None, causal=False, key_mask=None, mask=None,
                      block_size=None):
    r"""Exact scaled dot-product attention.

    .. math:: O = \operatorname{softmax}\!\left(Q K^\top \cdot \mathrm{scale} + M\right) V

    where :math:`M_{ij} = -\infty` for every key ``j`` that query ``i`` may not see.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
        Queries. Leading dimensions (batch, heads) broadcast against ``k`` and ``v``.
    k : array, shape ``(..., s, d)``
        Keys.
    v : array, shape ``(..., s, dv)``
        Values.
    scale : float, optional
        Multiplies the logits; ``None`` means ``1/sqrt(d)``.
    causal : bool
        End-aligned causal masking (as FlashAttention-2): query ``i`` sees key
        ``j <= i + (s - n)``.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key; masked keys get weight 0.
    mask : boolean array, shape ``(..., n, s)``, optional
        ``True`` where query ``i`` may attend to key ``j``. Combined (AND) with
        ``causal`` and ``key_mask``.
    block_size : int, optional
        When given, run the blockwise online-softmax algorithm (FlashAttention) over
        query and key blocks of this size: memory ``O((n + s) d + block^2)`` per batch
        element instead of ``O(n s)``, same result to rounding.

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q``. A query that may attend to no key
        returns zeros. float16/bfloat16 inputs are computed in float32.

    Raises
    ------
    TypeError
        Non-floating or mismatched dtypes, arrays of different libraries, non-boolean
        masks.
    ValueError
        Shapes that do not fit (the message names the argument and both shapes),
        ``block_size <= 0``.

    Notes
    -----
    The row maximum of the logits is subtracted before ``exp`` (it cancels in the
    ratio), so logits up to ``|q.k.scale| ~ 1e4`` are safe in float32.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    >>> out = softmax_attention(q, k, v, causal=True)
    >>> out.shape
    (2, 5, 4)
    >>> bool(np.allclose(out[:, 0], v[:, 0]))  # the first query sees only the first key
    True
    >>> bool(np.allclose(softmax_attention(q, k, v, block_size=2), softmax_attention(q, k, v)))
    True
    """
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    check_mask(p, mask, q)
    block_size = check_positive_int("block_size", block_size, allow_none=True)
    scale = check_scale(scale, p.d)
    xp = p.xp
    # Fold the scale into q once (O(n d)) instead of into every score (O(n s)).
    wq = xp.astype(q, p.work_dtype, copy=False) * scale
    wk = xp.astype(k, p.work_dtype, copy=False)
    wv = xp.astype(v, p.work_dtype, copy=False)
    if block_size is None or (block_size >= p.n and block_size >= p.s):
        out = _dense(p, wq, wk, wv, causal=causal, key_mask=key_mask, mask=mask)
    else:
        out = _blockwise(p, wq, wk, wv, causal=causal, key_mask=key_mask, mask=mask,
                         block_size=block_size)
    return xp.astype(out, p.dtype, copy=False)


register(Variant(
    name="softmax",
    fn=softmax_attention,
    family="exact",
    exact=True,
    causal=True,
    key_mask=True,
    mask=True,
    normalized=True,
    complexity="O(n s d) time, O(n s) memory",
    citation="Vaswani et al. 2017, Attention Is All You Need",
))

register(Variant(
    name="softmax_blockwise",
    fn=softmax_attention,
    family="exact",
    exact=True,
    causal=True,
    key_mask=True,
    mask=True,
    normalized=True,
    defaults={"block_size": 512},
    parameter="block_size",
    complexity="O(n s d) time, O((n + s) d + block^2) memory",
    citation="Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2",
))
