r"""Nyströmformer and the two-softmax landmark attention it is derived from.

.. math::

    \operatorname{softmax}(Q K^\top) \approx
    \underbrace{\operatorname{softmax}(Q \tilde K^\top)}_{F\ (n\times m)}\;
    \operatorname{pinv}\!\big(\underbrace{\operatorname{softmax}(\tilde Q \tilde K^\top)}_{A\
    (m\times m)}\big)\;
    \underbrace{\operatorname{softmax}(\tilde Q K^\top)}_{B\ (m\times s)}

with landmarks :math:`\tilde Q, \tilde K` the means of ``m`` contiguous segments of the
queries and keys (Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for
Approximating Self-Attention", AAAI).  Every logit carries the same ``scale`` (the
official code divides q and k by :math:`d^{1/4}` each, which is the same thing).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator

from ._validate import (check_choice, check_key_mask, check_no_causal, check_positive_int,
                        check_qkv, check_same_array_kind, check_scale)
from ._parallel import (blas_single, broadcast_shape, exp_shifted_, fill_where_, map_rows,
                        matmul_into, parallel_map, reduce_axis, scratch, split_rows,
                        update_, zero_where_)
from ._xp import compute_dtype, xp_device, xp_namespace
from .exact import (_shifted_exp, masked_softmax, merge_blocks, unshifted_first,
                    unshifted_quietly, unshifted_sums_ok)
from .linalg import PINV_INITS, PINV_METHODS, _iterative_pinv, _svd_pinv
from .registry import Variant, register

__all__ = ["segment_means", "nystrom_attention", "landmark_attention"]

_NOT_CAUSAL = ("its landmarks are means over segments of the whole sequence, so every "
               "output would depend on future tokens")


def segment_lengths(n: int, m: int) -> list[int]:
    """Lengths of the ``m`` contiguous segments of ``n`` tokens: the first ``n mod m``
    segments have ``ceil(n/m)`` tokens, the others ``floor(n/m)``."""
    base, extra = divmod(n, m)
    return [base + 1] * extra + [base] * (m - extra)


def _segment_start(n: int, m: int, g: int) -> int:
    """Index of the first token of segment ``g`` (``g = m``: ``n``)."""
    base, extra = divmod(n, m)
    return g * (base + 1) if g <= extra else extra * (base + 1) + (g - extra) * base


def _segment_blocks(xp, n: int, m: int, *, token_bytes: int) -> list[tuple[int, int]]:
    """Ranges ``(g0, g1)`` of whole segments covering all ``m``, for
    :func:`~arrayattn._parallel.split_rows` blocks of ``token_bytes`` per token; a block
    never mixes the longer and the shorter segments, so its tokens reshape to
    ``(g1 - g0, length, c)``."""
    base, extra = divmod(n, m)
    blocks = []
    for first, count, length in ((0, extra, base + 1), (extra, m - extra, base)):
        if count:
            blocks += [(first + a, first + b) for a, b in
                       split_rows(xp, count, row_bytes=token_bytes * length)]
    return blocks


def _block_segment_sums(xp, x, keep, n: int, m: int, segments, lead):
    """Sums ``(..., g1 - g0, c)`` of the tokens of ``x (..., n, c)`` in the ``segments``
    ``(g0, g1)`` of one :func:`_segment_blocks` block; with ``keep (..., n)`` only those
    tokens (a masked token's value, even inf or NaN, never enters)."""
    g0, g1 = segments
    t0, t1 = _segment_start(n, m, g0), _segment_start(n, m, g1)
    xb = xp.reshape(x[..., t0:t1, :], (*x.shape[:-2], g1 - g0, -1, x.shape[-1]))
    if keep is not None:
        drop = xp.reshape(~keep[..., t0:t1], (*keep.shape[:-1], g1 - g0, -1, 1))
        buf = scratch(xp, (*lead, *xb.shape[-3:]), x.dtype, "masked")
        if buf is None:
            xb = xp.where(drop, 0.0, xb)
        else:  # NumPy: a reused buffer, masked rows zeroed by index
            buf[...] = xb
            xb = zero_where_(xp, buf, drop)
    return reduce_axis(xp, xp.sum, xb, axis=-2)[..., 0, :]


def _segment_sums(xp, x, m: int, keep=None):
    """Sums of ``x (..., n, c)`` over the segments of :func:`segment_lengths`:
    ``(..., m, c)``, by reshapes of blocks of whole segments (in parallel threads on
    NumPy; O(n c), no padding, no loop over tokens).

    ``keep (..., n)``: only those tokens are summed, masked block by block, so no masked
    copy of ``x`` is made.
    """
    n, c = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    if keep is not None:
        lead = broadcast_shape(lead, keep.shape[:-1])
    blocks = _segment_blocks(xp, n, m, token_bytes=4 * math.prod(lead) * c)
    return map_rows(xp, lambda g, out: _block_segment_sums(xp, x, keep, n, m, g, lead),
                    blocks, shape=(*lead, m, c), dtype=x.dtype, blas=False)


def _segment_means(xp, x, m: int, mask):
    """Means of ``x (..., n, c)`` over ``m`` segments, counting only ``mask`` tokens.

    Returns ``(means (..., m, c), counts)`` where ``counts`` is ``None`` without a
    mask and the float number of real tokens per segment ``(..., m)`` with one; a
    segment with no real token has mean 0.
    """
    return _means_of_sums(xp, _segment_sums(xp, x, m, keep=mask), x.shape[-2], mask)


def _means_of_sums(xp, sums, n: int, mask):
    """:func:`_segment_means` from the masked segment sums ``(..., m, c)`` of ``n`` tokens."""
    m = sums.shape[-2]
    if mask is None:
        lengths = xp.asarray(segment_lengths(n, m), dtype=sums.dtype, device=xp_device(sums))
        return sums / lengths[:, None], None
    counts = _segment_sums(xp, xp.astype(mask[..., None], sums.dtype), m)
    return sums / xp.where(counts > 0, counts, 1.0), counts[..., 0]


def segment_means(x, m, /, *, key_mask=None, return_counts=False):
    r"""Landmarks: the means of ``m`` contiguous segments of the tokens of ``x``.

    When ``m`` does not divide ``n`` the segments are uneven -- the first ``n mod m``
    have :math:`\lceil n/m\rceil` tokens, the others :math:`\lfloor n/m\rfloor` -- instead
    of zero padding, whose zeros would be counted in the means and shrink them.

    Parameters
    ----------
    x : array, shape ``(..., n, c)``
        Tokens (queries or keys).
    m : int
        Number of segments, ``1 <= m <= n``.
    key_mask : boolean array, shape ``(..., n)``, optional
        ``True`` marks a real token; masked tokens are left out of the means (their
        values, even inf or NaN, never enter).  A segment without any real token has
        mean 0 and count 0.
    return_counts : bool
        Also return the number of real tokens of each segment (floating, shape
        ``(..., m)``; without ``key_mask``, shape ``(m,)``: the segment lengths).

    Returns
    -------
    means : array, shape ``(..., m, c)``
        Same namespace, device and dtype as ``x``.
    counts : array
        Only with ``return_counts=True``.

    Raises
    ------
    ValueError
        ``m > n`` or ``m < 1``, or a ``key_mask`` of the wrong shape.
    TypeError
        Non-floating ``x``, non-boolean ``key_mask``, mixed libraries.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import segment_means
    >>> x = np.arange(5.0)[:, None]              # n = 5 tokens, m = 2 -> lengths 3, 2
    >>> segment_means(x, 2)[:, 0]
    array([1. , 3.5])
    >>> means, counts = segment_means(x, 2, key_mask=np.array([1, 0, 1, 0, 0], bool),
    ...                               return_counts=True)
    >>> means[:, 0], counts
    (array([1., 0.]), array([2., 0.]))
    """
    xp = xp_namespace(x, key_mask, names=("x", "key_mask"))
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., n, c); got shape "
                         f"{tuple(x.shape)}")
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"x must have a real floating dtype; got {x.dtype}")
    n = x.shape[-2]
    m = check_positive_int("m", m)
    if m > n:
        raise ValueError(f"m={m} segments cannot be formed from n={n} tokens "
                         f"(x of shape {tuple(x.shape)}); need m <= n")
    if key_mask is not None:
        check_same_array_kind(xp, "x", x, "key_mask", key_mask)
        if key_mask.dtype != xp.bool:
            raise TypeError(f"key_mask must be a boolean array (True = keep); got dtype "
                            f"{key_mask.dtype}")
        if key_mask.ndim < 1 or key_mask.shape[-1] != n:
            raise ValueError(f"key_mask must have shape (..., n) with n={n} tokens; got "
                             f"shape {tuple(key_mask.shape)}")
    work = compute_dtype(xp, x.dtype)
    means, counts = _segment_means(xp, xp.astype(x, work, copy=False), m, key_mask)
    means = xp.astype(means, x.dtype, copy=False)
    if not return_counts:
        return means
    if counts is None:
        counts = xp.asarray(segment_lengths(n, m), dtype=work, device=xp_device(x))
    return means, xp.astype(counts, x.dtype, copy=False)


def _check_query_mask(p, query_mask, q):
    """``query_mask (..., n)`` boolean, broadcastable to the batch."""
    if query_mask is None:
        return None
    if query_mask.ndim < 1 or query_mask.shape[-1] != p.n:
        raise ValueError(f"query_mask must have shape (..., n) with n={p.n} queries; got "
                         f"shape {tuple(query_mask.shape)}")
    # The same dtype, device and batch checks as a key mask, on the query axis.
    return check_key_mask(dataclasses.replace(p, s=p.n), query_mask, q, name="query_mask")


def _landmarks(p, q, k, v, *, num_landmarks, scale, key_mask, query_mask, variant):
    """Shared front of both variants: validated, scaled working arrays and landmarks.

    Returns ``wq``, ``wv`` (working dtype), ``qt`` (query landmarks times scale), ``kt``
    (key landmarks), ``kts`` (key landmarks times scale), ``qvalid``/``kvalid`` (``(..., m)`` booleans, ``None`` when no
    landmark can be empty) and ``bv = softmax(qt k^T) v`` ``(..., m, dv)`` (rows of
    empty query landmarks are 0; masked keys take no part).
    """
    xp = p.xp
    check_key_mask(p, key_mask, q)
    _check_query_mask(p, query_mask, q)
    m = check_positive_int("num_landmarks", num_landmarks)
    if m > min(p.n, p.s):
        raise ValueError(
            f"{variant}: num_landmarks={m} exceeds the number of queries n={p.n} or keys "
            f"s={p.s}; each landmark is the mean of at least one token (use m <= "
            f"{min(p.n, p.s)})")
    scale = check_scale(scale, p.d)
    # The scale is folded into the (m, d) landmarks, never into the (n, d) queries: every
    # logit pairs a landmark with a token or with another landmark.
    wq = xp.astype(q, p.work_dtype, copy=False)
    wk = xp.astype(k, p.work_dtype, copy=False)
    wv = xp.astype(v, p.work_dtype, copy=False)
    qt, qcount = _segment_means(xp, wq, m, query_mask)
    qt = qt * scale
    qvalid = None if qcount is None else qcount > 0
    # The key landmarks are summed in the same pass over the keys as bv.
    bv, ksums = _landmark_values(p, qt, wk, wv, key_mask, qvalid)
    kt, kcount = _means_of_sums(xp, ksums, p.s, key_mask)
    kvalid = None if kcount is None else kcount > 0
    return wq, wv, qt, kt, kt * scale, qvalid, kvalid, bv


def _landmark_values(p, qt, wk, wv, key_mask, qvalid):
    """``(softmax(q̃ k^T) v, key segment sums)``: ``(..., m, dv)`` over the keys of
    ``key_mask (..., s)`` (the rows of the landmarks that ``qvalid (..., m)`` marks empty
    are 0) and the masked segment sums of ``k`` ``(..., m, d)``, in one pass over blocks
    of whole key segments.

    The ``m x s`` scores are made transposed, ``k q̃^T`` (a tall, thin matmul, which BLAS
    runs far faster than the short, wide ``q̃ k^T``), block by block over the keys (in
    parallel threads and cache-sized blocks on NumPy).  Each block is softmaxed with its
    own column max ``c_b`` and the blocks are merged as the online softmax does:
    ``sum_b e^{c_b - c} E_b^T V_b / sum_b e^{c_b - c} l_b`` with ``c = max_b c_b``, the
    result of one softmax over all keys, to rounding.  A landmark with no allowed key
    gets a zero row.  NumPy first tries no shift at all (``c_b = 0``, a plain sum of the
    blocks; :func:`~arrayattn.exact.unshifted_first`).
    """
    xp = p.xp
    allowed_t = None
    if key_mask is not None:
        allowed_t = key_mask[..., None]                                 # (..., s, 1)
    if qvalid is not None:
        cols = qvalid[..., None, :]                                     # (..., 1, m)
        allowed_t = cols if allowed_t is None else (allowed_t & cols)
    multi = allowed_t is not None and allowed_t.shape[-2] != 1

    m = qt.shape[-2]
    lead = tuple(wk.shape[:-2]) if key_mask is None else broadcast_shape(
        wk.shape[:-2], key_mask.shape[:-1])

    def key_block(segments, shifted=True, sums=True):
        # Whole key segments: the key landmarks' sums come from the same block of k.
        ksum = _block_segment_sums(xp, wk, key_mask, p.s, m, segments, lead) if sums \
            else None
        j0, j1 = _segment_start(p.s, m, segments[0]), _segment_start(p.s, m, segments[1])
        st = matmul_into(xp, wk[..., j0:j1, :], xp.matrix_transpose(qt), "scores")  # (b, m)
        if shifted:
            e, total, c = _shifted_exp(
                xp, st, allowed_t[..., j0:j1, :] if multi else allowed_t, axis=-2,
                consume=True)
            # The true block max: -inf where the block has no allowed key for a landmark.
            return (xp.matrix_transpose(e) @ wv[..., j0:j1, :], total,
                    xp.where(total > 0, c, -xp.inf), ksum)
        with unshifted_quietly(xp):
            if key_mask is not None:
                st = fill_where_(xp, st, ~key_mask[..., j0:j1, None], -xp.inf)
            e = exp_shifted_(xp, st)
            return (xp.matrix_transpose(e) @ wv[..., j0:j1, :],
                    reduce_axis(xp, xp.sum, e, -2), None, ksum)

    blocks = _segment_blocks(xp, p.s, m, token_bytes=4 * math.prod(p.batch) * m)
    ksums = None
    if unshifted_first(xp):
        # An empty query landmark (a zero row of qt: finite logits) is computed with
        # the others and its row dropped afterwards.
        parts = parallel_map(xp, lambda g: key_block(g, shifted=False), blocks)
        ksums = xp.concat([part[3] for part in parts], axis=-2)
        num = functools.reduce(operator.add, [part[0] for part in parts])
        total = functools.reduce(operator.add, [part[1] for part in parts])  # (..., 1, m)
        if qvalid is not None:
            total = xp.where(qvalid[..., None, :], total, 1.0)
            num = xp.where(qvalid[..., None], num, 0.0)
        with unshifted_quietly(xp):
            ok = unshifted_sums_ok(xp, total) and bool(xp.all(xp.isfinite(num)))
        if ok:
            return num / xp.matrix_transpose(total), ksums
    parts = parallel_map(xp, lambda g: key_block(g, sums=ksums is None), blocks)
    if ksums is None:
        ksums = xp.concat([part[3] for part in parts], axis=-2)
    shifts = [part[2] for part in parts]                               # (..., 1, m) each
    num = merge_blocks(xp, [part[0] for part in parts],
                       [xp.matrix_transpose(c) for c in shifts])
    total = xp.matrix_transpose(merge_blocks(xp, [part[1] for part in parts], shifts))
    return num / xp.where(total > 0, total, 1.0), ksums


def _attend_landmarks(p, wq, kts, lv, kcols):
    """``softmax(q k̃^T scale) lv`` over the valid landmarks ``kcols (..., 1, m)``, by
    blocks of query rows (in parallel threads and cache-sized blocks on NumPy): a block's
    scores are made, exponentiated and used in place, never held whole.

    Stabilised, the scores are made transposed, ``(m, rows)``: the max and sum over the
    ``m`` landmarks are then reductions across rows, which NumPy vectorises (over a short
    last axis it runs a loop per row, ~3x slower), and ``P^T`` enters the last matmul as
    a transposed operand at no cost.  NumPy first tries no shift
    (:func:`~arrayattn.exact.unshifted_first`): then nothing is reduced along the
    landmarks but the sum, which a matmul with a column of ones does, so the scores are
    made ``(rows, m)``, the layout BLAS runs ~1.8x faster here; a block whose sums say a
    shift was needed is redone stabilised.
    """
    xp = p.xp
    allowed = None if kcols is None else xp.matrix_transpose(kcols)    # (..., m, 1)

    def stabilised(rows, out):
        st = matmul_into(xp, kts, xp.matrix_transpose(wq[..., rows[0]:rows[1], :]),
                         "scores")                                     # (..., m, rows)
        e, total, _ = _shifted_exp(xp, st, allowed, axis=-2, consume=True)
        total = xp.where(total > 0, total, 1.0)                         # (..., 1, rows)
        if e.shape[-2] <= lv.shape[-1]:
            # Normalise the weights, not the output: as many divisions or fewer, and
            # along long rows (an (rows, dv) / (rows, 1) division runs a loop per row).
            e = update_(xp, e, operator.truediv, total)
            return matmul_into(xp, xp.matrix_transpose(e), lv, out)
        return update_(xp, matmul_into(xp, xp.matrix_transpose(e), lv, out),
                       operator.truediv, xp.matrix_transpose(total))

    blocks = split_rows(xp, p.n, row_bytes=4 * math.prod(p.batch) * kts.shape[-2])
    shape = (*p.batch, p.n, lv.shape[-1])
    if not unshifted_first(xp):
        return map_rows(xp, stabilised, blocks, shape=shape, dtype=p.work_dtype)

    # The sum over the valid landmarks is a matmul with their indicator; the invalid
    # ones (zero rows of kts: finite logits) get zero rows of lv.
    if kcols is None:
        ones, lv0 = xp.ones((kts.shape[-2], 1), dtype=kts.dtype, device=xp_device(kts)), lv
    else:
        ones, lv0 = xp.astype(allowed, kts.dtype), xp.where(allowed, lv, 0.0)
    # |e @ lv| <= total max|lv|: the sums' check keeps that finite (a host scalar).
    lv_max = float(xp.max(xp.abs(lv0)))

    def unshifted(rows, out):
        with unshifted_quietly(xp):
            e = exp_shifted_(xp, matmul_into(xp, wq[..., rows[0]:rows[1], :],
                                             xp.matrix_transpose(kts), "scores"))  # (rows, m)
            total = matmul_into(xp, e, ones, "total")                   # (..., rows, 1)
            ok = unshifted_sums_ok(xp, total, lv_max)
        if not ok:
            return stabilised(rows, out)
        return update_(xp, matmul_into(xp, e, lv0, out), operator.truediv, total)

    return map_rows(xp, unshifted, blocks, shape=shape, dtype=p.work_dtype)


def _conv_skip(p, v, key_mask, conv_kernel):
    """Depthwise convolution of ``v`` along the tokens (the official model's skip):
    ``out_i = sum_t w_t v_{i + t - K//2}`` with zero padding, one kernel per head."""
    xp = p.xp
    if p.n != p.s:
        raise ValueError(f"conv_kernel needs self-attention (n == s) to add a convolution "
                         f"of v to the output; got n={p.n}, s={p.s}")
    check_same_array_kind(xp, "v", v, "conv_kernel", conv_kernel)
    if not xp.isdtype(conv_kernel.dtype, "real floating"):
        raise TypeError(f"conv_kernel must have a real floating dtype; got {conv_kernel.dtype}")
    if conv_kernel.ndim < 1 or conv_kernel.shape[-1] % 2 == 0:
        raise ValueError(f"conv_kernel must have shape (..., K) with an odd K (the output "
                         f"is centred); got shape {tuple(conv_kernel.shape)}")
    width = conv_kernel.shape[-1]
    w = xp.astype(conv_kernel, p.work_dtype, copy=False)
    wv = xp.astype(v, p.work_dtype, copy=False)
    if key_mask is not None:
        wv = xp.where(key_mask[..., None], wv, 0.0)   # padded tokens do not leak
    half = width // 2
    pad = xp.zeros((*wv.shape[:-2], half, wv.shape[-1]), dtype=wv.dtype, device=p.device)
    padded = xp.concat([pad, wv, pad], axis=-2) if half else wv
    out = 0.0
    for t in range(width):  # a loop over the K taps, not over tokens
        out = out + w[..., t, None, None] * padded[..., t:t + p.n, :]
    return out


def nystrom_attention(q, k, v, /, *, num_landmarks=64, pinv="iterative", pinv_iters=6,
                      pinv_init="per_matrix", pinv_rtol=None, scale=None, key_mask=None,
                      query_mask=None, conv_kernel=None, causal=False):
    r"""Nyströmformer attention (Xiong et al. 2021).

    .. math::

        O = \operatorname{softmax}(Q\tilde K^\top c)\;
            \operatorname{pinv}\!\big(\operatorname{softmax}(\tilde Q\tilde K^\top c)\big)\;
            \operatorname{softmax}(\tilde Q K^\top c)\, V \;[+\ \operatorname{conv}(V)]

    with ``c = scale`` on every logit and landmarks :math:`\tilde Q, \tilde K` the means
    of ``m`` contiguous segments of ``q`` and ``k`` (:func:`segment_means`: uneven
    segments when ``m`` does not divide the length, never zero padding).  Computed
    right to left: ``O(n m d + s m d + m^3)`` time, ``O((n + s) m)`` memory; the
    ``n x s`` matrix is never formed.

    ``num_landmarks == n == s`` is not special-cased: every token is its own landmark,
    :math:`\tilde Q = Q`, :math:`\tilde K = K`, and with ``pinv="svd"`` the formula is
    :math:`S S^+ S V = S V`, exact softmax attention (tested to ~1e-10 in float64).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
        Leading dimensions broadcast (batch, heads).
    num_landmarks : int
        ``m``, at most ``min(n, s)``.  Default 64 (the paper's value for long inputs).
    pinv : {"iterative", "svd"}
        Pseudo-inverse of the ``m x m`` landmark matrix: Razavi's iteration (the
        paper's) or the exact SVD one; see :func:`arrayattn.pinv`.
    pinv_iters : int
        Iterations of the ``"iterative"`` pseudo-inverse (paper: 6).
    pinv_init : {"per_matrix", "global"}
        ``Z0`` scaling of the iterative pseudo-inverse: per matrix (default) or one
        maximum over the whole batch and all heads (the official code's; converges no
        faster and usually slower).
    pinv_rtol : float, optional
        Singular-value cutoff of ``"svd"`` (default ``m * eps``).
    scale : float, optional
        Logit scale, ``None`` means ``1/sqrt(d)``; applied to all three softmaxes.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key.  Masked keys are left out of the key landmarks and of
        the softmax over keys, so they have no influence at all; a key segment with no
        real key is dropped from the landmarks.
    query_mask : boolean array, shape ``(..., n)``, optional
        ``True`` marks a real query.  Masked queries are left out of the query
        landmarks (so padding does not bias them); their own outputs are still
        computed.  For padded self-attention pass the padding mask as both masks.
    conv_kernel : array, shape ``(..., K)``, optional
        Adds the official model's depthwise convolution skip,
        :math:`\sum_t w_t V_{i + t - \lfloor K/2\rfloor}` (zero padding, odd ``K``, one
        kernel per head broadcast against the batch dims; masked values are zeroed
        first).  Self-attention only (``n == s``).
    causal : bool
        Must be False: the landmarks mix future tokens into every output.

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q`` (half precisions computed in float32).

    Raises
    ------
    ValueError
        ``causal=True``; ``num_landmarks > min(n, s)``; bad shapes or options.
    TypeError
        Bad dtypes, mixed libraries.

    Notes
    -----
    Rows of the implied matrix sum to 1 when the landmark matrix is invertible (its
    rows do, so its inverse maps 1 to 1) -- to rounding with ``"svd"``, to the
    pseudo-inverse residual :math:`\lVert I - AZ\rVert` with ``"iterative"``.  The
    iterative pseudo-inverse is differentiable on every backend.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import nystrom_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))
    >>> out = nystrom_attention(q, k, v, num_landmarks=3)
    >>> out.shape
    (2, 10, 4)
    >>> exact = nystrom_attention(q, k, v, num_landmarks=10, pinv="svd")  # m = n
    >>> bool(np.allclose(exact, softmax_attention(q, k, v), rtol=0, atol=1e-10))
    True
    """
    p = check_qkv(q, k, v)
    check_no_causal(causal, "nystrom_attention", _NOT_CAUSAL)
    check_choice("pinv", pinv, PINV_METHODS)
    check_choice("pinv_init", pinv_init, PINV_INITS)
    iters = check_positive_int("pinv_iters", pinv_iters, minimum=0)
    if pinv_rtol is not None and pinv != "svd":
        raise ValueError("pinv_rtol applies to pinv='svd' only")
    xp = p.xp
    wq, wv, qt, kt, kts, qvalid, kvalid, bv = _landmarks(
        p, q, k, v, num_landmarks=num_landmarks, scale=scale, key_mask=key_mask,
        query_mask=query_mask, variant="nystrom_attention")
    kcols = None if kvalid is None else kvalid[..., None, :]
    allowed = kcols
    if qvalid is not None:
        allowed = qvalid[..., None] if allowed is None else (qvalid[..., None] & allowed)
    with blas_single(xp):  # (m, m) work: one BLAS thread (see blas_single)
        # A: empty landmarks are zero rows/columns, whose pseudo-inverse is zero there too.
        a = masked_softmax(xp, qt @ xp.matrix_transpose(kt), allowed, consume=True)
        if pinv == "svd":
            z = _svd_pinv(xp, a, pinv_rtol)
        else:
            z = _iterative_pinv(xp, a, iters, pinv_init)
        zbv = z @ bv
    out = _attend_landmarks(p, wq, kts, zbv, kcols)
    if conv_kernel is not None:
        out = out + _conv_skip(p, v, key_mask, conv_kernel)
    return xp.astype(out, p.dtype, copy=False)


def landmark_attention(q, k, v, /, *, num_landmarks=64, scale=None, key_mask=None,
                       query_mask=None, causal=False):
    r"""The two-softmax landmark attention from which Nyströmformer is derived.

    .. math::

        O = \operatorname{softmax}(Q\tilde K^\top c)\,
            \operatorname{softmax}(\tilde Q K^\top c)\, V

    (Xiong et al. 2021, before the middle factor is inserted); ``c = scale``,
    landmarks as in :func:`nystrom_attention`.  Both factors are row-stochastic, so the
    rows of the implied ``n x s`` matrix sum to 1 (attending to a constant returns it).

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, d)``, ``(..., s, d)``, ``(..., s, dv)``
    num_landmarks : int
        ``m <= min(n, s)``.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    key_mask, query_mask : boolean arrays, shapes ``(..., s)``, ``(..., n)``, optional
        As in :func:`nystrom_attention`.  A landmark index ``j`` whose key segment or
        query segment has no real token is dropped from both factors (they are paired
        by index), so rows still sum to 1.
    causal : bool
        Must be False.

    Returns
    -------
    array, shape ``(..., n, dv)``

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import landmark_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 9, 4)), rng.standard_normal((2, 12, 4))
    >>> out = landmark_attention(q, k, np.ones((2, 12, 1)), num_landmarks=4)
    >>> bool(np.allclose(out, 1.0))
    True
    """
    p = check_qkv(q, k, v)
    check_no_causal(causal, "landmark_attention", _NOT_CAUSAL)
    xp = p.xp
    wq, wv, _, _, kts, qvalid, kvalid, bv = _landmarks(
        p, q, k, v, num_landmarks=num_landmarks, scale=scale, key_mask=key_mask,
        query_mask=query_mask, variant="landmark_attention")
    valid = kvalid if qvalid is None else (qvalid if kvalid is None else qvalid & kvalid)
    out = _attend_landmarks(p, wq, kts, bv, None if valid is None else valid[..., None, :])
    return xp.astype(out, p.dtype, copy=False)


def _register_nystrom(pinv: str, citation: str, notes: str) -> None:
    # Neither record is ``normalized`` in the registry's sense (rows sum to 1 up to
    # 16 s eps): the iterative rows only to the pinv residual ||I - AZ||, the SVD rows
    # to ~eps * cond(A), and the landmark matrix of near-uniform attention has cond
    # 1e4-1e5.  tests/test_nystrom.py checks both bounds.
    register(Variant(
        name=f"nystrom_{pinv}",
        fn=nystrom_attention,
        family="low_rank",
        exact=False,
        causal=False,
        key_mask=True,
        normalized=False,
        defaults={"num_landmarks": 64, "pinv": pinv},
        parameter="num_landmarks",
        complexity="O((n + s) m d + m^3) time, O((n + s) m) memory",
        citation=citation,
        notes=notes,
    ))


_register_nystrom(
    "iterative", "Xiong et al. 2021, Nyströmformer (AAAI); pinv: Razavi et al. 2014",
    "6 iterations; rows sum to 1 only up to the pseudo-inverse residual ||I - AZ||")
_register_nystrom(
    "svd", "Xiong et al. 2021, Nyströmformer (AAAI)",
    "exact SVD pseudo-inverse (cutoff m*eps); equals exact attention when m = n = s; "
    "rows sum to 1 to ~eps * cond(landmark matrix)")

register(Variant(
    name="landmark",
    fn=landmark_attention,
    family="low_rank",
    exact=False,
    causal=False,
    key_mask=True,
    normalized=True,
    defaults={"num_landmarks": 64},
    parameter="num_landmarks",
    complexity="O((n + s) m d) time, O((n + s) m) memory",
    citation="Xiong et al. 2021, Nyströmformer (AAAI), the two-softmax form",
))
