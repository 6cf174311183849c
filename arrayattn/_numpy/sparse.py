"""The NumPy engine of the block-sparse executor: the chunks of the full gather plan
(:attr:`~arrayattn.sparse.BlockLayout.plan`, not the scanned plan JAX needs) run in
threads, each by :func:`attend_tiles` -- the gathered softmax written plainly, in place.

The engine's guard against non-finite values is chosen once per call
(:func:`arrayattn.sparse.block_sparse_attention`): where the values are all finite
(:func:`finite`, one reduction over ``v``) a tile's masked softmax needs none of the
reference's guards (:func:`arrayattn.reference.masks.attend`): the weight of a key no
query sees is exactly 0 and its value is finite, so ``0 * v`` is 0.  Otherwise the bad
value rows are zeroed once (:func:`drop_bad_values`) and their keys' score columns set
to NaN before the mask (the tiles' ``poison``), as the reference does: exactly the rows
that see one are NaN, every other row is bit for bit the call with that value zeroed.
A NaN or infinite key reaches exactly the rows that see it through their scores, as in
the reference.

Measured (2-core machine, ``(1, 8, n, 64)`` float32, registry defaults, best of 3; the
A/B table is benchmarks/results/sparse.md): see that file.
"""
from __future__ import annotations

import numpy as np

from .finite import all_finite
from .parallel import held, own, parallel_map, scratch

__all__ = ["map_chunks", "finite", "drop_bad_values", "attend_tiles", "chunk_out",
           "take_blocks", "take_rows",
           "CHUNK_SCALE"]

#: An engine chunk holds this many times the executor's budget of elements
#: (:func:`arrayattn.core.devices.chunk_elements`: scores plus gathered keys and values,
#: over the batch): its kernel keeps one score-sized temporary where the reference form
#: makes several, and fewer, larger chunks merge fewer parts of long rows.
CHUNK_SCALE = 4


def map_chunks(fn, chunks) -> list:
    """``[fn(chunk) for chunk in chunks]``, in the engine's threads when there are several.

    Each chunk reads the call's shared blocks and returns its own output (query blocks
    of the forward, key blocks of the backward's key-major pass): nothing is written
    that another chunk reads.  A lone chunk runs on the calling thread (its scratch
    buffers in that thread's workspace)."""
    return parallel_map(fn, chunks)


def finite(x) -> bool:
    """Whether ``x`` holds no NaN and no infinity: one read, no temporary
    (:func:`~arrayattn._numpy.finite.all_finite`; a finite sum that overflows only sends
    the call to the guarded reference form).  (A float64 ``np.add.reduce`` took 4.3 ms
    for 8M float32 values: local causal at n = 16384 1.28x e6332e9, issue #39.)"""
    return all_finite(x)


def drop_bad_values(vb):
    """Blocked values ``vb (..., K, b, dv)`` with their non-finite rows zeroed, and those
    rows ``(..., K, b)`` (bool)."""
    bad = ~np.all(np.isfinite(vb), axis=-1)
    return np.where(bad[..., None], np.zeros((), dtype=vb.dtype), vb), bad


def _fit(s, other):
    """``s`` widened (copied) to the broadcast shape with ``other`` where that is larger
    (a bias or key mask with more batch entries than the queries)."""
    shape = np.broadcast_shapes(s.shape, other.shape)
    return s if shape == s.shape else np.broadcast_to(s, shape).copy()


def attend_tiles(qc, kb, vb, tiles, alloc=None):
    """Softmax attention of the query blocks ``qc (..., G, b, d)`` (scaled) over the
    key blocks of ``tiles``, each ``(idx (G, R) host integers, allowed (..., G, b, R b)
    bool or None for all, bias (..., G, b, R b) or None, poison (..., G, 1, R b) bool or
    None)`` -- disjoint key sets whose partial softmaxes are merged online.
    ``kb (..., K, b, d)``; ``vb (..., K, b, dv)`` holds finite values (the keys of its
    zeroed bad rows are marked by ``poison``: NaN scores where they are allowed).
    Returns ``(..., G, b, dv)``, written into ``alloc(shape, dtype)`` when given (a
    held workspace buffer of :func:`chunk_out`; the gathered keys and values and the
    scores are this thread's scratch buffers)."""
    acc = total = top = None
    for idx, allowed, bias, poison in tiles:
        kc, vc = _gather(kb, idx, "kc"), _gather(vb, idx, "vc")
        s = np.matmul(qc, np.swapaxes(kc, -1, -2),                 # (..., G, b, R b)
                      out=scratch(_product(qc, np.swapaxes(kc, -1, -2)), qc.dtype, "s"))
        if bias is not None:
            s = _fit(s, bias)
            s += bias
        if poison is not None:
            s = _fit(s, poison)
            np.copyto(s, np.nan, where=poison)
        if allowed is not None:
            s = _fit(s, allowed)
            np.copyto(s, -np.inf, where=~allowed)
        m = np.max(s, axis=-1, keepdims=True)
        shift = np.where(m == -np.inf, 0.0, m).astype(s.dtype, copy=False)
        s -= shift
        np.exp(s, out=s)
        part = np.sum(s, axis=-1, keepdims=True)
        shape = _product(s, vc)
        if acc is None:
            acc = np.matmul(s, vc, out=None if alloc is None else alloc(shape, s.dtype))
            total, top = part, m
            continue
        o = np.matmul(s, vc, out=scratch(shape, s.dtype, "o"))
        new = np.maximum(top, m)
        base = np.where(new == -np.inf, 0.0, new).astype(s.dtype, copy=False)
        ca, cb = np.exp(top - base), np.exp(m - base)
        if np.broadcast_shapes(acc.shape, o.shape, ca.shape) == acc.shape:
            acc *= ca             # acc * ca + o * cb, in place (the same roundings)
            o *= cb
            acc += o
        else:
            acc = acc * ca + o * cb
        total = total * ca + part * cb
        top = new
    acc /= np.where(total > 0, total, 1.0).astype(acc.dtype, copy=False)
    return acc


def _gather(x, idx, slot):
    """``x (..., K, b, c)`` at the key blocks ``idx (G, R)``: ``(..., G, R b, c)``, into
    this thread's scratch buffer ``slot`` (the indices are in bounds: ``clip`` takes them
    as they are, without the buffered copy ``raise`` makes of an ``out``)."""
    g, r = idx.shape
    out = scratch((*x.shape[:-3], g * r, *x.shape[-2:]), x.dtype, slot)
    np.take(x, idx.reshape(-1), axis=-3, out=out, mode="clip")
    return out.reshape(*x.shape[:-3], g, r * x.shape[-2], x.shape[-1])


def take_blocks(x, rows):
    """The blocks ``rows (G,)`` (host integers, in bounds) of ``x (..., K, b, c)``:
    ``(..., G, b, c)`` in this thread's scratch buffer ``"qc"`` (a chunk's queries)."""
    out = scratch((*x.shape[:-3], rows.size, *x.shape[-2:]), x.dtype, "qc")
    return np.take(x, rows, axis=-3, out=out, mode="clip")


def take_rows(x, rows):
    """``x (..., s, c)`` at the rows ``rows`` (in bounds): ``(..., len(rows), c)``, in the
    calling thread's workspace buffer ``"rows"`` (:func:`~.parallel.own`: consumed
    before the call returns, e.g. Poolingformer's pooled intervals)."""
    out = own((*x.shape[:-2], rows.size, x.shape[-1]), x.dtype, "rows")
    return np.take(x, rows, axis=-2, out=out, mode="clip")


def _product(a, b):
    """The shape of ``a @ b``."""
    return (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])


def chunk_out(shape, dtype):
    """The calling thread's held buffer for the current chunk's output
    (:func:`~.parallel.held`: the executor concatenates the chunks' outputs into a fresh
    result; pass it as ``alloc`` only where there are several chunks, so that a lone
    chunk's output, which is the result, is never a workspace buffer)."""
    return held(shape, dtype, "sparse_out")
