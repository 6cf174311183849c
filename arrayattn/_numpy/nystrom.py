"""The NumPy engine of Nyströmformer and landmark attention (the reference forms:
:mod:`arrayattn.reference.nystrom`).

The same three softmaxes, computed for speed on CPU threads:

* the key pass makes ``B V = softmax(q̃ kᵀ) v`` and the key landmarks' sums in one pass
  over blocks of whole key segments, the scores transposed (``k q̃ᵀ``: a tall, thin
  matmul, which BLAS runs far faster than the short, wide ``q̃ kᵀ``), each block
  softmaxed with its own column max and merged as the online softmax merges blocks;
* the query pass makes ``softmax(q k̃ᵀ) (Z B V)`` by blocks of query rows, a block's
  scores made, exponentiated and used in place in a reused buffer
  (:func:`~arrayattn._numpy.parallel.scratch`);
* both first try ``exp`` **without the max shift** (the max and the subtraction are two
  of five passes over the scores): real logits (|logit| in the tens) need none, and the
  sums tell, read on the host for free on NumPy (:func:`unshifted_sums_ok`); a pass whose
  sums say otherwise is redone stabilised, so the result is always the shifted one's to
  rounding.  Stabilised, the query scores are made ``(m, rows)`` (max and sum across rows,
  which NumPy vectorises); unshifted, ``(rows, m)`` (the layout BLAS runs ~1.8x faster
  here; the sum is a matmul with a column of ones).
* masked keys: their rows are zeroed in the block copies that the key sums make anyway,
  and a block of values is copied and zeroed only when a masked row holds a NaN or inf
  (a padded key or value never enters; the copy cost the padded case ~12 %).

Measured, float32, 8 heads, n = 16384, d = 64, m = 64 on the 2-core machine: 55-60 ms
on a quiet machine (2026-11-22, before the move to this module; the unshifted passes
saved ~25 % of that, the transposed key scores ~2x on the key pass).  After the move,
``benchmarks/compare.py`` against 9fe700d, 9 interleaved rounds on a loaded machine
(load ~6), medians before / after: iterative 145.9 / 143.9 ms, svd 148.3 / 145.1 ms,
10 % padding (key + query masks) 154.9 / 164.2 ms.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..reference.masks import masked_softmax
from .linalg import pinv_razavi, pinv_svd
from .parallel import blas_single, map_rows, parallel_map, reduce_rows, scratch, split_rows

__all__ = ["segment_means", "nystrom_attention", "landmark_attention", "unshifted_sums_ok"]


def _start(n: int, m: int, g: int) -> int:
    """First token of segment ``g`` (``g = m``: ``n``) of the uneven segments."""
    base, extra = divmod(n, m)
    return g * (base + 1) if g <= extra else extra * (base + 1) + (g - extra) * base


def _segment_blocks(n: int, m: int, token_bytes: int) -> list[tuple[int, int]]:
    """Ranges ``(g0, g1)`` of whole segments; a block never mixes the longer and the
    shorter segments, so its tokens reshape to ``(g1 - g0, length, c)``."""
    base, extra = divmod(n, m)
    blocks = []
    for first, count, length in ((0, extra, base + 1), (extra, m - extra, base)):
        if count:
            blocks += [(first + a, first + b)
                       for a, b in split_rows(count, row_bytes=token_bytes * length)]
    return blocks


def _fill_rows(a, drop, value):
    """``a[drop] = value`` in place; ``drop`` broadcasts against ``a``."""
    if drop.ndim == a.ndim and drop.shape[-1] == 1 < a.shape[-1]:
        # Whole rows by index touch only the masked rows (7x faster than copyto).
        a[np.broadcast_to(drop[..., 0], a.shape[:-1])] = value
    else:
        np.copyto(a, value, where=drop)
    return a


def _masked_rows(x, keep, t0, t1, slot):
    """``x[..., t0:t1, :]`` with the rows that ``keep`` drops zeroed, in a scratch copy."""
    rows = x[..., t0:t1, :]
    if keep is None:
        return rows
    drop = ~keep[..., t0:t1, None]
    buf = scratch(np.broadcast_shapes(rows.shape, drop.shape), x.dtype, slot)
    buf[...] = rows
    return _fill_rows(buf, drop, 0.0)


def _masked_values(v, keep, j0, j1):
    """``v[..., j0:j1, :]`` for a product with weights that are exactly 0 at the masked
    keys: ``0 x finite = 0``, so the rows need zeroing only when a masked one holds a
    NaN or inf (checked on the masked rows alone, not a copy of the block)."""
    rows = v[..., j0:j1, :]
    if keep is None:
        return rows
    drop = ~keep[..., j0:j1]
    if drop.shape == rows.shape[:-1] and np.isfinite(rows[drop]).all():
        return rows
    return _masked_rows(v, keep, j0, j1, "values")


def _block_sums(x, keep, m, segments, slot="masked"):
    """Masked sums ``(..., g1 - g0, c)`` of one block of whole segments of ``x``, and the
    block's rows (masked rows zeroed)."""
    n = x.shape[-2]
    t0, t1 = _start(n, m, segments[0]), _start(n, m, segments[1])
    rows = _masked_rows(x, keep, t0, t1, slot)
    xb = rows.reshape(*rows.shape[:-2], segments[1] - segments[0], -1, rows.shape[-1])
    return reduce_rows(np.sum, xb)[..., 0, :], rows


def _segment_sums(x, m, keep=None):
    lead = np.broadcast_shapes(x.shape[:-2], () if keep is None else keep.shape[:-1])
    blocks = _segment_blocks(x.shape[-2], m, 4 * math.prod(lead) * x.shape[-1])
    return map_rows(lambda g, out: _block_sums(x, keep, m, g)[0], blocks,
                    shape=(*lead, m, x.shape[-1]), dtype=x.dtype, blas=False)


def _means(sums, n, keep):
    """Means and counts ``(..., m)`` (``None`` without ``keep``) from masked sums."""
    m = sums.shape[-2]
    if keep is None:
        base, extra = divmod(n, m)
        lengths = np.array([base + 1] * extra + [base] * (m - extra), dtype=sums.dtype)
        return sums / lengths[:, None], None
    counts = _segment_sums(keep[..., None].astype(sums.dtype), m)
    return sums / np.where(counts > 0, counts, 1.0), counts[..., 0]


def segment_means(x, m, keep=None):
    """:func:`~arrayattn.reference.masked_segment_means`, in threads over segment blocks."""
    return _means(_segment_sums(x, m, keep), x.shape[-2], keep)


def unshifted_sums_ok(total, weight: float = 1.0) -> bool:
    """Whether the sums of unshifted ``exp(logits)`` say no shift was needed: all finite
    and at least ``sqrt(1 / max)`` of the dtype (``e^-44`` in float32: the terms flushed to
    subnormals are then below one rounding of the sum), and ``max(total) * weight``
    finite for values up to ``weight``.  NaN fails.  False: redo with the max shift."""
    info = np.finfo(total.dtype)
    top = info.max / max(1.0, weight) if weight == weight else -info.max
    return bool(total.min() >= info.max ** -0.5) and bool(total.max() <= top)


def _shifted_exp(s, allowed):
    """``exp(s - colmax)`` in place over the ``allowed`` entries, its column sums and max
    (axis -2); a column with no allowed entry is shifted by 0, so all zeros."""
    if allowed is not None:
        _fill_rows(s, ~allowed, -np.inf)
    c = reduce_rows(np.max, s)
    if allowed is not None:
        c = np.where(c == -np.inf, 0.0, c).astype(s.dtype, copy=False)
    s -= c
    np.exp(s, out=s)
    return s, reduce_rows(np.sum, s), c


def _merge(terms, shifts):
    """``sum_b e^{c_b - max c} term_b``: blocks merged as the online softmax merges them."""
    if len(terms) == 1:
        return terms[0]
    top = functools.reduce(np.maximum, shifts)
    top = np.where(top == -np.inf, 0.0, top)
    return functools.reduce(np.add, (np.exp(c - top) * t for t, c in zip(terms, shifts)))


def _landmark_values(qt, k, v, key_mask, qvalid, unshifted, finite_check=False):
    """``(softmax(q̃ kᵀ) v (..., m, dv), key segment sums (..., m, d))`` in one pass over
    blocks of whole key segments; rows of empty query landmarks are 0.  With
    ``finite_check``: ``None`` where a key segment sum is not finite (a key holds a NaN or
    inf), found before any stabilised pass runs on such keys."""
    m, s = qt.shape[-2], k.shape[-2]
    allowed = None if key_mask is None else key_mask[..., None]        # (..., s, 1)
    if qvalid is not None:
        cols = qvalid[..., None, :]                                    # (..., 1, m)
        allowed = cols if allowed is None else (allowed & cols)
    per_key = allowed is not None and allowed.shape[-2] != 1
    batch = np.broadcast_shapes(qt.shape[:-2], k.shape[:-2], v.shape[:-2])

    def key_block(segments, shifted):
        # Whole key segments: the key landmarks' sums come from the same block of k.
        ksum, kb = _block_sums(k, key_mask, m, segments)
        j0, j1 = _start(s, m, segments[0]), _start(s, m, segments[1])
        vb = _masked_values(v, key_mask, j0, j1)
        st = np.matmul(kb, qt.mT, out=scratch((*batch, j1 - j0, m), k.dtype, "scores"))
        if shifted:
            e, total, c = _shifted_exp(st, allowed[..., j0:j1, :] if per_key else allowed)
            # The true block max: -inf where the block has no allowed key for a landmark.
            return e.mT @ vb, total, np.where(total > 0, c, -np.inf), ksum
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            if key_mask is not None:
                _fill_rows(st, ~key_mask[..., j0:j1, None], -np.inf)
            e = np.exp(st, out=st)
            return e.mT @ vb, reduce_rows(np.sum, e), None, ksum

    blocks = _segment_blocks(s, m, 4 * math.prod(batch) * m)
    if unshifted:
        # An empty query landmark (a zero row of qt: finite logits) is computed with the
        # others and its row dropped afterwards.
        parts = parallel_map(lambda g: key_block(g, False), blocks)
        if finite_check and not all(_finite(part[3]) for part in parts):
            return None
        num = functools.reduce(np.add, [part[0] for part in parts])
        total = functools.reduce(np.add, [part[1] for part in parts])  # (..., 1, m)
        if qvalid is not None:
            total = np.where(qvalid[..., None, :], total, 1.0)
            num = np.where(qvalid[..., None], num, 0.0)
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            ok = unshifted_sums_ok(total) and bool(np.isfinite(num).all())
        if ok:
            return num / total.mT, np.concatenate([part[3] for part in parts], axis=-2)
    if finite_check and not unshifted:
        # Non-finite keys may reach the stabilised pass first (inf - inf): no warning.
        with np.errstate(invalid="ignore", over="ignore"):
            parts = parallel_map(lambda g: key_block(g, True), blocks)
        if not all(_finite(part[3]) for part in parts):
            return None
    else:
        parts = parallel_map(lambda g: key_block(g, True), blocks)
    shifts = [part[2] for part in parts]                               # (..., 1, m)
    num = _merge([part[0] for part in parts], [c.mT for c in shifts])
    total = _merge([part[1] for part in parts], shifts).mT
    return (num / np.where(total > 0, total, 1.0),
            np.concatenate([part[3] for part in parts], axis=-2))


def _attend_landmarks(q, kts, lv, kcols, unshifted):
    """``softmax(q k̃ᵀ scale) lv`` over the landmarks ``kcols (..., 1, m)`` allows, by
    blocks of query rows."""
    n, m, dv = q.shape[-2], kts.shape[-2], lv.shape[-1]
    batch = np.broadcast_shapes(q.shape[:-2], kts.shape[:-2], lv.shape[:-2])
    allowed = None if kcols is None else kcols.mT                      # (..., m, 1)

    def stabilised(rows, out):
        st = np.matmul(kts, q[..., rows[0]:rows[1], :].mT,
                       out=scratch((*batch, m, rows[1] - rows[0]), q.dtype, "scores"))
        e, total, _ = _shifted_exp(st, allowed)                        # (..., m, rows)
        total = np.where(total > 0, total, 1.0)
        if m <= dv:
            # Normalise the weights, not the output: as many divisions or fewer, and
            # along long rows (an (rows, dv) / (rows, 1) division runs a loop per row).
            e /= total
            return np.matmul(e.mT, lv, out=out)
        out = np.matmul(e.mT, lv, out=out)
        out /= total.mT
        return out

    blocks = split_rows(n, row_bytes=4 * math.prod(batch) * m)
    shape = (*batch, n, dv)
    if not unshifted:
        return map_rows(stabilised, blocks, shape=shape, dtype=q.dtype)
    # The sum over the allowed landmarks is a matmul with their indicator; the others
    # (zero rows of kts: finite logits) get zero rows of lv.
    if kcols is None:
        ones, lv0 = np.ones((m, 1), dtype=kts.dtype), lv
    else:
        ones, lv0 = allowed.astype(kts.dtype), np.where(allowed, lv, 0.0)
    lv_max = float(np.abs(lv0).max())  # |e @ lv| <= total max|lv|

    def attempt(rows, out):
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            st = np.matmul(q[..., rows[0]:rows[1], :], kts.mT,
                           out=scratch((*batch, rows[1] - rows[0], m), q.dtype, "scores"))
            e = np.exp(st, out=st)                                     # (..., rows, m)
            total = np.matmul(e, ones, out=scratch((*batch, rows[1] - rows[0], 1),
                                                   q.dtype, "total"))
            ok = unshifted_sums_ok(total, lv_max)
        if not ok:
            return stabilised(rows, out)
        out = np.matmul(e, lv0, out=out)
        out /= total
        return out

    return map_rows(attempt, blocks, shape=shape, dtype=q.dtype)


def _finite(x) -> bool:
    return bool(np.isfinite(x).all())


def _landmarks(q, k, v, m, scale, key_mask, query_mask, unshifted, finite_check=False):
    """``(q̃ scale, k̃, query and key landmarks' validity, B V)``; with ``finite_check``
    ``None`` where a landmark is not finite (see :func:`nystrom_attention`)."""
    qt, qcount = segment_means(q, m, query_mask)
    if finite_check and not _finite(qt):
        return None
    qt *= scale
    qvalid = None if qcount is None else qcount > 0
    values = _landmark_values(qt, k, v, key_mask, qvalid, unshifted, finite_check)
    if values is None:
        return None
    bv, ksums = values
    kt, kcount = _means(ksums, k.shape[-2], key_mask)
    kvalid = None if kcount is None else kcount > 0
    return qt, kt, qvalid, kvalid, bv


def nystrom_attention(q, k, v, *, num_landmarks, scale, pinv="iterative", pinv_iters=6,
                      pinv_init="per_matrix", pinv_rtol=None, key_mask=None,
                      query_mask=None, unshifted=True, finite_check=False):
    """:func:`arrayattn.reference.nystrom_attention` on NumPy; ``unshifted=False`` skips
    the unshifted attempts (the stabilised passes only).

    ``finite_check=True``: ``None`` (nothing computed past the landmarks) where a query
    or key landmark is not finite.  A segment sum is finite only where every value it
    adds is (a NaN propagates, an inf stays inf or meets ``-inf`` and makes NaN; a finite
    sum that overflows only answers "not known"), so finite landmarks prove every real
    query and key finite at the price of reading ``(m, d)`` values: the passes that make
    them read ``q`` and ``k`` anyway (issue #39).  Masked queries and ``v`` are not
    covered: the caller checks them."""
    marks = _landmarks(q, k, v, num_landmarks, scale, key_mask, query_mask, unshifted,
                       finite_check)
    if marks is None:
        return None
    qt, kt, qvalid, kvalid, bv = marks
    kcols = None if kvalid is None else kvalid[..., None, :]
    allowed = kcols
    if qvalid is not None:
        allowed = qvalid[..., None] if allowed is None else (qvalid[..., None] & allowed)
    with blas_single():  # (m, m) work: one BLAS thread (see blas_single)
        a = masked_softmax(qt @ kt.mT, allowed)
        if pinv == "svd":
            eps = float(np.finfo(a.dtype).eps)
            z = pinv_svd(a, num_landmarks * eps if pinv_rtol is None else pinv_rtol)
        else:
            z = pinv_razavi(a, pinv_iters, pinv_init)
        zbv = z @ bv
    return _attend_landmarks(q, kt * scale, zbv, kcols, unshifted)


def landmark_attention(q, k, v, *, num_landmarks, scale, key_mask=None, query_mask=None,
                       unshifted=True):
    """:func:`arrayattn.reference.landmark_attention` on NumPy."""
    _, kt, qvalid, kvalid, bv = _landmarks(q, k, v, num_landmarks, scale, key_mask,
                                           query_mask, unshifted)
    valid = kvalid if qvalid is None else (qvalid if kvalid is None else qvalid & kvalid)
    return _attend_landmarks(q, kt * scale, bv, None if valid is None else valid[..., None, :],
                             unshifted)
