"""The NumPy engine of Reformer's LSH attention: the reference form
:func:`arrayattn.reference.lsh_attention_chunked` (hash, per round a stable sort by
bucket, chunked attention within the sorted order, the rounds merged by their
log-sum-exp) with the same maths, laid out for NumPy on a CPU.

The reference form is written for ``jax.jit``: the ``(n, H nb/2)`` projections of the
hash in one piece, every round's windows gathered (each key row copied twice, into its
chunk's window and the next one's), the rounds and the blocks of chunks as scans.  Here:

* the hash runs in row blocks over the threads: a block's projections, their ``argmax``
  and ``argmin``, and the two extremes read back at those indices (the reference's
  ``max`` and ``min`` are two more passes over ``n H nb/2`` values, slow ones over a short
  last axis): 0.11 s against 0.44 s at ``(1, 8, 16384, 64)``, the same buckets bit for
  bit (shared rotations; per-head rotations take the reference's hash);
* a round's rows are sorted once into tables with ``C`` empty rows in front, so each
  chunk's window (the previous chunk, then its own) is a strided view of ``2C`` rows, not
  a gathered copy; the scores, mask and ``exp`` of a block of chunks are made in place in
  per-thread buffers;
* the batch rows (or, for fewer rows than threads, the rounds) run in threads; a row's
  rounds are merged as they come, in place (:func:`~arrayattn.reference.merge_partials`'s
  formula);
* the non-finite rule of the reference (a non-finite value's key made NaN, its value 0)
  costs one host read of ``v`` when every value is finite.

Measured (2 cores, ``(1, 8, n, 64)`` float32, the registry's ``lsh`` call: 4 rounds,
chunks of 64, ``nb = 2 n / 64``; ``benchmarks/regress.py`` against e6332e9, 3 interleaved
rounds, load ~2.4, best-of, plain / causal): 105 / 100 ms against 290 / 295 ms at
``n = 4096``, 473 / 464 ms against 1381 / 1361 ms at ``n = 16384`` (0.34x; the chunked
form alone ran 1.07-1.18x e6332e9's at 16384, issue #39).
"""
from __future__ import annotations

import functools

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .. import reference
from ..reference.finite import drop_nonfinite, nonfinite_rows
from ..reference.lsh import lsh_inputs
from ..reference.masks import log_total
from .finite import all_finite
from .parallel import num_threads, parallel_map, scratch, split_rows
from .rows import unit_rows

__all__ = ["lsh_attention_chunked", "lsh_hash", "lsh_rounds"]


def lsh_hash(qk, rot, nb: int):
    """:func:`arrayattn.reference.lsh_hash`'s buckets ``(..., H, n)``, in row blocks."""
    if nb == 1 or rot.ndim != 3:
        return reference.lsh_hash(qk, rot, nb)
    H, d, half = rot.shape
    flat_rot = np.ascontiguousarray(np.transpose(rot, (1, 0, 2)).reshape(d, H * half))
    rows = qk.reshape(-1, d)
    out = np.empty((rows.shape[0], H), dtype=np.intp)

    def block(span):
        i0, i1 = span
        proj = np.matmul(rows[i0:i1], flat_rot,
                         out=scratch((i1 - i0, H * half), rows.dtype, "proj"))
        proj = proj.reshape(i1 - i0, H, half)
        hi, lo = np.argmax(proj, axis=-1), np.argmin(proj, axis=-1)
        # argmax([p, -p]): the first half wins ties, as in the reference
        upper = (np.take_along_axis(proj, hi[..., None], axis=-1)
                 >= -np.take_along_axis(proj, lo[..., None], axis=-1))[..., 0]
        lo += half
        out[i0:i1] = np.where(upper, hi, lo)

    parallel_map(block, split_rows(rows.shape[0], row_bytes=H * half * rows.itemsize))
    return np.swapaxes(out.reshape(*qk.shape[:-1], H), -1, -2)


def _windows(table, C: int, count: int, start: int = 0):
    """The ``count`` windows of ``2C`` rows of ``table`` from chunk ``start`` on: row
    ``c C .. c C + 2C`` of ``table`` (which has ``C`` empty rows in front) for chunk
    ``c``, as a strided view ``(count, 2C, ...)``."""
    at = table[start * C:]
    return as_strided(at, shape=(count, 2 * C, *table.shape[1:]),
                      strides=(C * table.strides[0], *table.strides), writeable=False)


def _sorted_table(x, order, C: int, L: int, fill, slot: str):
    """``x[order]`` with ``C`` rows of ``fill`` in front and ``L - n`` after (a window's
    look-back before the first chunk, the pad slots), in a per-thread buffer."""
    n = order.shape[0]
    table = scratch((C + L, *x.shape[1:]), x.dtype, slot)
    table[:C] = fill
    np.take(x, order, axis=0, out=table[C:C + n])
    table[C + n:] = fill
    return table


def _one_round(qs, ks, v, bucket, every, logs, *, C: int, nb: int, causal: bool):
    """One round of one batch row, as :func:`arrayattn.reference.lsh._lsh_round`: the
    partial softmax sums ``(m (n, 1), l (n, 1), acc (n, dv))`` in position order."""
    n, d = qs.shape
    nc = -(-n // C)
    L = nc * C
    order = np.argsort(bucket, kind="stable")
    Q = _sorted_table(qs, order, C, L, 0.0, "q")[C:]
    K = _sorted_table(ks, order, C, L, 0.0, "k")
    V = _sorted_table(v, order, C, L, 0.0, "v")
    # Labels: position, bucket, every round's bucket (the duplicate count); -1 outside.
    pos = _sorted_table(np.arange(n), order, C, L, -1, "pos")
    own = _sorted_table(bucket, order, C, L, -1, "bucket")
    # A key is real when its bucket is a real one (pad slots -1, masked tokens nb).
    real = (own >= 0) & (own < nb)
    labels = [] if every is None else [
        _sorted_table(every[r], order, C, L, -1, f"round{r}") for r in range(len(every))]
    part = scratch((L, 2 + v.shape[1]), qs.dtype, "part")
    g = max(1, (1 << 20) // (C * 2 * C))   # chunks a block: ~1M scores
    if causal:
        j = np.arange(2 * C)
        far = j < j[:C, None]               # more than C sorted slots back
    for c0 in range(0, nc, g):
        gg = min(g, nc - c0)
        s = np.matmul(Q[c0 * C:(c0 + gg) * C].reshape(gg, C, d),
                      np.swapaxes(_windows(K, C, gg, c0), -1, -2),
                      out=scratch((gg, C, 2 * C), qs.dtype, "s"))
        q_at = slice((c0 + 1) * C, (c0 + gg + 1) * C)
        pq, pk = pos[q_at].reshape(gg, C, 1), _windows(pos, C, gg, c0)[:, None, :]
        bq, bk = own[q_at].reshape(gg, C, 1), _windows(own, C, gg, c0)[:, None, :]
        # not allowed: another bucket, not a real key, itself (causal: a later one, or
        # more than C slots back) -- the reference's mask, negated
        hide = np.not_equal(bq, bk, out=scratch((gg, C, 2 * C), bool, "hide"))
        hide |= ~_windows(real, C, gg, c0)[:, None, :]
        hide |= (pk >= pq) if causal else (pk == pq)
        if causal:
            hide |= far
        if labels:
            count = scratch((gg, C, 2 * C), np.int8, "count")
            count[...] = 0
            for lab in labels:
                count += lab[q_at].reshape(gg, C, 1) == _windows(lab, C, gg, c0)[:, None, :]
            s -= np.take(logs, count)     # log N_ij: a pair met in N_ij rounds counts once
        np.copyto(s, -np.inf, where=hide)
        m = np.max(s, axis=-1, keepdims=True)
        s -= np.where(m == -np.inf, 0.0, m)
        np.exp(s, out=s)
        out = part[c0 * C:(c0 + gg) * C].reshape(gg, C, -1)
        out[..., :1] = m
        np.sum(s, axis=-1, keepdims=True, out=out[..., 1:2])
        np.matmul(s, _windows(V, C, gg, c0), out=out[..., 2:])
    undo = np.empty(n, dtype=order.dtype)
    undo[order] = np.arange(n, dtype=order.dtype)
    back = np.take(part, undo, axis=0)
    return back[:, :1], back[:, 1:2], back[:, 2:]


def _merge(state, part):
    """:func:`arrayattn.reference.merge_partials`'s formula written into ``state`` (the
    reference's allocates three ``(n, dv)`` arrays a round: 1.04-1.05x at ``n = 16384``)."""
    if state is None:
        return tuple(np.array(x) for x in part)
    (ma, la, acc_a), (mb, lb, acc_b) = state, part
    m = np.maximum(ma, mb)
    shift = np.where(m == -np.inf, 0.0, m)
    ca, cb = np.exp(ma - shift), np.exp(mb - shift)
    la *= ca
    la += lb * cb
    acc_a *= ca
    acc_a += acc_b * cb
    ma[...] = m
    return ma, la, acc_a


def lsh_rounds(qk, v, buckets, *, num_buckets: int, chunk_size: int, scale: float,
               causal: bool = False, dedup: bool = True):
    """:func:`arrayattn.reference.lsh_rounds` on NumPy: ``(O (B, n, dv), z (B, n))``."""
    B, H = buckets.shape[:2]
    if not all_finite(v):       # the reference's rule: a non-finite value's key is NaN
        bad = nonfinite_rows(v)
        v = drop_nonfinite(bad, v)
    else:
        bad = None
    every = dedup and H > 1
    logs = np.log(np.maximum(np.arange(H + 1), 1).astype(qk.dtype))
    # one item a batch row, or a (row, round) where there are fewer rows than threads
    split = B < num_threads() and H > 1
    items = [(b, (r,)) for b in range(B) for r in range(H)] if split else [
        (b, tuple(range(H))) for b in range(B)]

    def item(job):
        b, rounds = job
        qs = qk[b] * scale
        ks = unit_rows(qk[b])
        if bad is not None:
            ks[bad[b]] = np.nan
        return functools.reduce(_merge, (
            _one_round(qs, ks, v[b], buckets[b, r], buckets[b] if every else None, logs,
                       C=chunk_size, nb=num_buckets, causal=causal) for r in rounds), None)

    parts = parallel_map(item, items)
    rows = [functools.reduce(_merge, [part for (b, _), part in zip(items, parts)
                                      if b == row], None) for row in range(B)]
    out = np.empty((B, buckets.shape[-1], v.shape[-1]), dtype=qk.dtype)
    z = np.empty((B, buckets.shape[-1]), dtype=qk.dtype)
    for b, (top, total, acc) in enumerate(rows):
        np.divide(acc, np.where(total > 0, total, 1.0), out=out[b])
        z[b] = log_total(total, top)[:, 0]
    return out, z


def lsh_attention_chunked(qk, v, rotations, *, num_buckets: int, chunk_size: int,
                          scale: float, causal: bool = False, key_mask=None,
                          dedup: bool = True):
    """:func:`arrayattn.reference.lsh_attention_chunked` on NumPy."""
    batch, qk3, v3, buckets = lsh_inputs(qk, v, rotations, num_buckets=num_buckets,
                                         key_mask=key_mask, hash_fn=lsh_hash)
    out, z = lsh_rounds(qk3, v3, buckets, num_buckets=num_buckets, chunk_size=chunk_size,
                        scale=scale, causal=causal, dedup=dedup)
    return reference.lsh_own_value(out, z, v3, batch)
