"""The backward adapters of the sparse family: :func:`arrayattn.sparse_attention`,
:func:`arrayattn.local_attention` (``local``) and the registry's pattern records
(``longformer``, ``bigbird``, ``strided``, ``fixed``), and :func:`block_sparse_vjp`, the
host driver of the gathered backward (Poolingformer's backward runs it too).

The equations are in :mod:`arrayattn.reference.sparse_vjp`.  The gathered backward
walks the layout's plans on the host, like the forward
(:func:`arrayattn.sparse.block_sparse_attention`):

1. **query-major**, over the forward's plan: each chunk of query blocks recomputes its
   forward ``(O, L)`` on the gathered key blocks (long rows in spans merged by
   log-sum-exp), ``D = rowsum(dO O)``, then ``dQ`` (and the bias's cotangent on its
   tiles) from ``P = exp(S - L)``;
2. **key-major**, over the plan of the transposed block support (:func:`key_plan`):
   each chunk of key blocks gathers the query blocks that reach it, with their ``dO``,
   ``L`` and ``D``, and sums ``dK``, ``dV``.

Nothing is scattered: every gradient row is owned by the chunk that computes it.  Cost:
three score computations per tile (the forward, pass 1, pass 2) and seven products;
memory ``O(n * keys gathered per query)`` per chunk, never ``n x s`` (the bias's
cotangent, ``(..., n, s)`` like the bias, excepted).
"""
from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import numpy as np

from .. import reference
from ..core.engine import entry
from ..core.xp import xp_from_host
from ..core.pipeline import implementation, working
from ..reference.exact_vjp import sum_to_shape
from ..sparse import bigbird_layout, fixed_layout, longformer_layout, strided_layout
from ..sparse.api import SPEC, checked_local, checked_pattern, checked_sparse, dense_allowed
from ..sparse.executor import cut_chunks, gathered, in_block_order, spans, unblock
from ..sparse.layout import group_rows
from ..sparse.tiles import blocked, host_indices, tile_bias, tile_mask

__all__ = ["sparse_attention_vjp", "local_attention_vjp", "pattern_vjp", "block_sparse_vjp",
           "key_plan", "checked_vjp", "PATTERN_VJPS", "VJP_SPEC"]

# Elements of the tiles and gathered rows processed at once per chunk: the backward holds
# about four score-sized temporaries (S, P, dP, dS) where the forward holds two.
CHUNK_ELEMENTS = 1 << 22
# The cost of one more group of key blocks in the key-major plan, in score elements.
GROUP_OVERHEAD = 1 << 17


def key_plan(layout) -> tuple:
    """The key-major plan: groups ``(cols, idx, valid)`` of key blocks, ``idx (G, R)`` the
    query blocks that reach each (``layout.support`` transposed, grouped as the forward's
    plan is)."""
    return group_rows(np.ascontiguousarray(layout.support.T), layout.block_size,
                      GROUP_OVERHEAD)


def _bias_rows(xp, ds, idx, valid, nkb: int, b: int, s: int, dev):
    """The gathered ``dS (..., G, b, R b)`` of query blocks with key blocks ``idx (G, R)``
    placed at their key positions, zero elsewhere: ``(..., G, b, s)``.  Each key block
    is gathered at most once per row, so this is a gather by the inverse map (a slot
    of zeros for the blocks a row does not reach), not a scatter."""
    g, r = idx.shape
    slot = np.full((g, nkb), r, dtype=np.int64)
    rows = np.broadcast_to(np.arange(g)[:, None], idx.shape)
    slot[rows[valid], idx[valid]] = np.broadcast_to(np.arange(r), idx.shape)[valid]
    cols = np.arange(s)
    src = np.where(slot[:, cols // b] < r, slot[:, cols // b] * b + cols % b, r * b)  # (G, s)
    padded = xp.concat([ds, xp.zeros((*ds.shape[:-1], 1), dtype=ds.dtype, device=dev)],
                       axis=-1)
    index = xp.__array_namespace_info__().default_dtypes(device=dev)["indexing"]
    src_x = xp_from_host(xp, src[:, None, :], dtype=index, device=dev)
    return xp.take_along_axis(padded, xp.broadcast_to(src_x, (*ds.shape[:-1], s)), axis=-1)


def _query_chunk(g, dob, chunk):
    """Pass 1 on one chunk of query blocks: the forward's ``(O, L)`` recomputed over its
    spans, ``D = rowsum(dO O)``, ``dQ`` and the bias's cotangent on the chunk's rows."""
    xp, lay = g.xp, g.layout
    rows, idx_rows, valid_rows, span = chunk
    qc, doc = g.take(g.q, rows), g.take(dob, rows)
    tiles = [g.span(rows, idx, valid) for idx, valid in spans(idx_rows, valid_rows, span)]
    out, lse = g.attend(qc, tiles)                  # the forward's (O, L)
    delta = xp.sum(doc * out, axis=-1)              # D = rowsum(dO O)
    dq, ds = 0.0, []
    for idx_x, allowed, tb in tiles:
        dq_s, ds_s = reference.gathered_attention_dq(qc, g.k, g.v, doc, lse, delta, idx_x,
                                                     allowed, tb)
        dq, ds = dq + dq_s, ds + [ds_s]
    db = None if g.bias is None else _bias_rows(
        xp, ds[0] if len(ds) == 1 else xp.concat(ds, axis=-1), idx_rows, valid_rows,
        lay.blocks.shape[1], lay.block_size, lay.s, g.device)
    return dq, lse, delta, db


def _key_tiles(g, cols, idx, valid):
    """The mask and bias of key blocks ``cols (G,)`` against the query blocks
    ``idx (G, R)`` that reach them, in (query, key) orientation as the forward sees each
    pair: ``(..., G, R b, b)``; padded query rows are out."""
    xp, dev, lay = g.xp, g.device, g.layout
    b, ar = lay.block_size, np.arange(lay.block_size)
    n_g, r = idx.shape
    qrows, kcols = idx.reshape(-1), np.repeat(cols, r)[:, None]
    allowed = tile_mask(xp, lay, qrows, kcols, valid.reshape(-1, 1), causal=g.causal,
                        device=dev)
    allowed = xp.reshape(xp.broadcast_to(allowed, (n_g * r, b, b)), (n_g, r * b, b))
    real = (idx[:, :, None] * b + ar < lay.n).reshape(n_g, r * b, 1)
    allowed = allowed & xp_from_host(xp, real, dtype=xp.bool, device=dev)
    tb = None
    if g.bias is not None:
        tb = tile_bias(xp, g.bias, qrows, kcols * b + ar, lay, dev)
        tb = xp.reshape(tb, (*tb.shape[:-3], n_g, r * b, b))
    return allowed, tb


def _key_chunk(g, dob, lse_b, delta_b, chunk):
    """Pass 2 on one chunk of key blocks: ``dK``, ``dV`` summed over the query blocks
    that reach them (in spans)."""
    xp = g.xp
    cols, idx_cols, valid_cols, span = chunk
    kc, vc = g.take(g.k, cols), g.take(g.v, cols)
    kmc = None if g.key_mask is None else xp.matrix_transpose(g.take(g.key_mask, cols))
    dk = dv = 0.0
    for idx, valid in spans(idx_cols, valid_cols, span):
        allowed, tb = _key_tiles(g, cols, idx, valid)
        if kmc is not None:
            allowed = allowed & kmc
        dk_s, dv_s = reference.gathered_attention_dkv(kc, vc, g.q, dob, lse_b, delta_b,
                                                      host_indices(xp, idx, g.device),
                                                      allowed, tb)
        dk, dv = dk + dk_s, dv + dv_s
    return dk, dv


def block_sparse_vjp(p, q, k, v, do, layout, *, causal: bool, key_mask, bias=None,
                     threads: bool = False) -> dict:
    """``{"q", "k", "v"[, "bias"]}`` of :func:`arrayattn.sparse.block_sparse_attention`
    (``q`` pre-scaled: ``"q"`` is the cotangent of the scaled queries), by the two passes
    of this module's docstring.  All in the working dtype; shapes at the broadcast batch.
    ``threads``: the chunks on the NumPy engine's threads (the caller's choice, NumPy
    inputs only), else in order."""
    xp, dev, b = p.xp, p.device, layout.block_size
    g = gathered(p, q, k, v, layout, causal=causal, key_mask=key_mask, bias=bias)
    dob = blocked(xp, do, layout.blocks.shape[0], b, device=dev)
    batch = math.prod(p.batch)
    per_slot = batch * (2 * b * b + b * (p.d + p.dv))    # one block pair's tiles and rows
    per_row = batch * b * (p.d + p.dv)

    def in_order(parts, chunks, i, axis):
        return in_block_order(xp, [x[i] for x in parts], chunks, axis, dev)

    qchunks = cut_chunks(layout.plan, per_slot, per_row, CHUNK_ELEMENTS)
    qparts = g.run(partial(_query_chunk, g, dob), qchunks, threads=threads)
    lse_b, delta_b = in_order(qparts, qchunks, 1, -2), in_order(qparts, qchunks, 2, -2)
    kchunks = cut_chunks(key_plan(layout), per_slot, per_row, CHUNK_ELEMENTS)
    kparts = g.run(partial(_key_chunk, g, dob, lse_b, delta_b), kchunks,
                   threads=threads)
    grads = {"q": unblock(xp, in_order(qparts, qchunks, 0, -3), p.n),
             "k": unblock(xp, in_order(kparts, kchunks, 0, -3), p.s),
             "v": unblock(xp, in_order(kparts, kchunks, 1, -3), p.s)}
    if bias is not None:
        grads["bias"] = unblock(xp, in_order(qparts, qchunks, 3, -3), p.n)
    return grads


def _shaped(grads: dict, args: dict) -> dict:
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()
            if x is not None}


def checked_vjp(call, q, k, v, do, bias) -> dict:
    """``{"q", "k", "v"[, "bias"]}`` of a checked sparse call (:class:`SparseCall` of
    :mod:`arrayattn.sparse.api`): zeros where its problem has no layout (no token), the
    gathered backward, or the dense one where the forward runs its dense definition."""
    p = call.p
    xp = p.xp
    if call.layout is None:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in (("q", q), ("k", k), ("v", v), ("bias", bias))
                if x is not None}
    w = working(p, q, k, v, call.key_mask)
    wdo = xp.astype(do, p.work_dtype, copy=False)
    with entry(xp):
        grads = implementation(VJP_SPEC, call, w)(call, w, wdo)
    return _shaped(grads, {"q": q, "k": k, "v": v, "bias": bias})


def _dense_vjp(call, w, do) -> dict:
    return reference.sparse_attention_vjp(w.q, w.k, w.v, do, dense_allowed(call),
                                          scale=call.scale, bias=call.bias)


def _gathered_vjp(call, w, do, *, threads: bool) -> dict:
    grads = block_sparse_vjp(call.p, w.q * call.scale, w.k, w.v, do, call.layout,
                             causal=call.causal, key_mask=call.key_mask, bias=call.bias,
                             threads=threads)
    grads["q"] = grads["q"] * call.scale
    return grads


#: The backward of the sparse family, as the pipeline chooses it
#: (:func:`arrayattn.core.pipeline.implementation`): the forward's spec -- its work and score
#: estimates -- with the backward's forms, which take the cotangent ``do`` too: the
#: dense backward where the forward runs its dense definition, the gathered backward's
#: chunks on the NumPy engine's threads where they pay, else in order.
VJP_SPEC = replace(SPEC, name="sparse_attention_vjp",
                   reference=partial(_gathered_vjp, threads=False),
                   engine=partial(_gathered_vjp, threads=True), dense=_dense_vjp)


def sparse_attention_vjp(q, k, v, do, /, *, layout, scale=None, causal=False, key_mask=None,
                         bias=None):
    """``{"q", "k", "v"[, "bias"]}`` of :func:`~arrayattn.sparse_attention`: the gathered
    backward (:func:`block_sparse_vjp`), or, where the forward runs its dense definition
    (``use_engine("reference")``, small problems), the dense backward
    (:func:`arrayattn.reference.sparse_vjp.sparse_attention_vjp`).  A masked key's
    cotangents are exactly zero, whatever its row holds."""
    call = checked_sparse(q, k, v, layout=layout, scale=scale, causal=causal,
                          key_mask=key_mask, bias=bias)
    return checked_vjp(call, q, k, v, do, bias)


def local_attention_vjp(q, k, v, do, /, *, window, causal=False, block_size=64, scale=None,
                        key_mask=None, bias=None):
    """``{"q", "k", "v"[, "bias"]}`` of :func:`~arrayattn.local_attention` (``local``)."""
    call = checked_local(q, k, v, window=window, causal=causal, block_size=block_size,
                         scale=scale, key_mask=key_mask, bias=bias)
    return checked_vjp(call, q, k, v, do, bias)


def pattern_vjp(builder, **fixed):
    """The backward of a registry record whose uniform call builds its layout from the
    inputs' ``n`` with ``builder`` (``pattern_call`` of :mod:`arrayattn.sparse.api`)."""
    def adapter(q, k, v, do, /, *, scale=None, causal=False, key_mask=None, bias=None,
                **options):
        call = checked_pattern(builder, fixed, q, k, v, scale=scale, causal=causal,
                               key_mask=key_mask, bias=bias, **options)
        return checked_vjp(call, q, k, v, do, bias)
    adapter.__name__ = f"{builder.__name__}_attention_vjp"
    return adapter


#: Registry name -> backward adapter of the pattern records (built as the registry's
#: uniform calls build them in :mod:`arrayattn.sparse.api`).
PATTERN_VJPS = {
    "longformer": pattern_vjp(longformer_layout),
    "bigbird": pattern_vjp(bigbird_layout),
    "strided": pattern_vjp(strided_layout, causal=False),
    "fixed": pattern_vjp(fixed_layout, causal=False),
}
