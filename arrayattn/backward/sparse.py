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

import numpy as np

from .. import reference
from .._engine import dense_reference, entry, numpy_engine
from .._numpy.parallel import parallel_map
from .._validate import check_flag, check_qkv
from .._xp import xp_from_host
from ..reference.exact_vjp import sum_to_shape
from ..sparse import (bigbird_layout, checked_sparse, fixed_layout, local_layout,
                      longformer_layout, strided_layout)
from ..sparse.layout import group_rows
from ..sparse.tiles import blocked, host_indices, tile_bias, tile_mask

__all__ = ["sparse_attention_vjp", "local_attention_vjp", "pattern_vjp", "block_sparse_vjp",
           "key_plan", "PATTERN_VJPS"]

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


def _chunks(plan, per_slot: int, per_row: int):
    """The plan's groups cut into chunks ``(rows, idx, valid, span)`` within the budget;
    a row whose slots alone exceed it is walked in spans of ``span`` slots."""
    chunks = []
    for rows, idx, valid in plan:
        r = idx.shape[1]
        step = max(1, CHUNK_ELEMENTS // (r * per_slot + per_row))
        span = min(r, max(1, CHUNK_ELEMENTS // per_slot))
        chunks += [(rows[c0:c0 + step], idx[c0:c0 + step], valid[c0:c0 + step], span)
                   for c0 in range(0, rows.size, step)]
    return chunks


def _in_block_order(xp, parts, chunks, axis: int, dev):
    """Per-chunk results, concatenated along the block ``axis``, put back in block order."""
    out = parts[0] if len(parts) == 1 else xp.concat(parts, axis=axis)
    perm = np.concatenate([c[0] for c in chunks])
    if np.array_equal(perm, np.arange(perm.size)):
        return out
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return xp.take(out, host_indices(xp, inv, dev), axis=out.ndim + axis)


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


def block_sparse_vjp(p, q, k, v, do, layout, *, causal: bool, key_mask, bias=None) -> dict:
    """``{"q", "k", "v"[, "bias"]}`` of :func:`arrayattn.sparse.block_sparse_attention`
    (``q`` pre-scaled: ``"q"`` is the cotangent of the scaled queries), by the two passes
    of this module's docstring.  All in the working dtype; shapes at the broadcast batch."""
    xp, dev = p.xp, p.device
    b, n, s = layout.block_size, p.n, p.s
    nqb, nkb = layout.blocks.shape
    causal = causal or layout.causal
    qb, dob = blocked(xp, q, nqb, b, device=dev), blocked(xp, do, nqb, b, device=dev)
    kb, vb = blocked(xp, k, nkb, b, device=dev), blocked(xp, v, nkb, b, device=dev)
    km = None if key_mask is None else blocked(xp, key_mask[..., None], nkb, b, device=dev)
    batch = math.prod(p.batch)
    per_slot = batch * (2 * b * b + b * (p.d + p.dv))    # one block pair's tiles and rows
    ar = np.arange(b)

    def query_span(rows, idx, valid):
        """One span of a query-major chunk: its key blocks, mask and bias tiles."""
        idx_x = host_indices(xp, idx, dev)
        allowed = tile_mask(xp, layout, rows, idx, valid, causal=causal, device=dev)
        if km is not None:
            allowed = allowed & xp.matrix_transpose(reference.take_blocks(km, idx_x))
        kpos = (idx[:, :, None] * b + ar).reshape(idx.shape[0], -1)
        return idx_x, allowed, (None if bias is None else
                                tile_bias(xp, bias, rows, kpos, layout, dev))

    def query_chunk(chunk):
        rows, idx_rows, valid_rows, span = chunk
        rows_x = host_indices(xp, rows, dev)
        qc, doc = xp.take(qb, rows_x, axis=qb.ndim - 3), xp.take(dob, rows_x, axis=dob.ndim - 3)
        spans = [query_span(rows, idx_rows[:, r0:r0 + span], valid_rows[:, r0:r0 + span])
                 for r0 in range(0, idx_rows.shape[1], span)]
        out = lse = None
        for idx_x, allowed, tb in spans:                # the forward's (O, L)
            o, l = reference.gathered_attention(qc, kb, vb, idx_x, allowed, tb)
            out, lse = (o, l) if out is None else reference.merge_attention(out, lse, o, l)
        delta = xp.sum(doc * out, axis=-1)              # D = rowsum(dO O)
        dq, ds = 0.0, []
        for idx_x, allowed, tb in spans:
            dq_s, ds_s = reference.gathered_attention_dq(qc, kb, vb, doc, lse, delta, idx_x,
                                                         allowed, tb)
            dq, ds = dq + dq_s, ds + [ds_s]
        db = None if bias is None else _bias_rows(
            xp, ds[0] if len(ds) == 1 else xp.concat(ds, axis=-1), idx_rows, valid_rows,
            nkb, b, s, dev)
        return dq, lse, delta, db

    def key_chunk(chunk):
        cols, idx_cols, valid_cols, span = chunk
        cols_x = host_indices(xp, cols, dev)
        kc, vc = xp.take(kb, cols_x, axis=kb.ndim - 3), xp.take(vb, cols_x, axis=vb.ndim - 3)
        kmc = None if km is None else xp.matrix_transpose(xp.take(km, cols_x,
                                                                  axis=km.ndim - 3))
        dk = dv = 0.0
        for r0 in range(0, idx_cols.shape[1], span):
            idx, valid = idx_cols[:, r0:r0 + span], valid_cols[:, r0:r0 + span]
            g, r = idx.shape
            # The tiles in (query, key) orientation: query block idx[g, t] against key
            # block cols[g], as the forward sees the pair; padded query rows are out.
            qrows, kcols = idx.reshape(-1), np.repeat(cols, r)[:, None]
            allowed = tile_mask(xp, layout, qrows, kcols, valid.reshape(-1, 1),
                                causal=causal, device=dev)
            allowed = xp.reshape(xp.broadcast_to(allowed, (g * r, b, b)), (g, r * b, b))
            real = (idx[:, :, None] * b + ar < n).reshape(g, r * b, 1)
            allowed = allowed & xp_from_host(xp, real, dtype=xp.bool, device=dev)
            if kmc is not None:
                allowed = allowed & kmc
            tb = None
            if bias is not None:
                tb = tile_bias(xp, bias, qrows, kcols * b + ar, layout, dev)
                tb = xp.reshape(tb, (*tb.shape[:-3], g, r * b, b))
            dk_s, dv_s = reference.gathered_attention_dkv(kc, vc, qb, dob, lse_b, delta_b,
                                                          host_indices(xp, idx, dev),
                                                          allowed, tb)
            dk, dv = dk + dk_s, dv + dv_s
        return dk, dv

    work = layout.count_computed() * batch * (xp.finfo(q.dtype).bits // 8)
    threads = numpy_engine(xp, work)

    def run(fn, chunks):
        return parallel_map(fn, chunks) if threads and len(chunks) > 1 else list(map(fn, chunks))

    qchunks = _chunks(layout.plan, per_slot, batch * b * (p.d + p.dv))
    qparts = run(query_chunk, qchunks)
    dq = _in_block_order(xp, [x[0] for x in qparts], qchunks, -3, dev)
    lse_b = _in_block_order(xp, [x[1] for x in qparts], qchunks, -2, dev)
    delta_b = _in_block_order(xp, [x[2] for x in qparts], qchunks, -2, dev)
    kchunks = _chunks(key_plan(layout), per_slot, batch * b * (p.d + p.dv))
    kparts = run(key_chunk, kchunks)
    dk = _in_block_order(xp, [x[0] for x in kparts], kchunks, -3, dev)
    dv = _in_block_order(xp, [x[1] for x in kparts], kchunks, -3, dev)

    def unblock(x, count):
        x = xp.reshape(x, (*x.shape[:-3], x.shape[-3] * b, x.shape[-1]))
        return x[..., :count, :]

    grads = {"q": unblock(dq, n), "k": unblock(dk, s), "v": unblock(dv, s)}
    if bias is not None:
        grads["bias"] = unblock(_in_block_order(xp, [x[3] for x in qparts], qchunks, -3, dev),
                                n)
    return grads


def _shaped(grads: dict, args: dict) -> dict:
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()
            if x is not None}


def sparse_attention_vjp(q, k, v, do, /, *, layout, scale=None, causal=False, key_mask=None,
                         bias=None):
    """``{"q", "k", "v"[, "bias"]}`` of :func:`~arrayattn.sparse_attention`: the gathered
    backward (:func:`block_sparse_vjp`), or, where the forward runs its dense definition
    (``use_engine("reference")``, small problems), the dense backward
    (:func:`arrayattn.reference.sparse_vjp.sparse_attention_vjp`).  A masked key's
    cotangents are exactly zero, whatever its row holds."""
    p, (wq, wk, wv), scale, causal, wbias = checked_sparse(
        q, k, v, layout=layout, scale=scale, causal=causal, key_mask=key_mask, bias=bias)
    xp = p.xp
    wdo = xp.astype(do, p.work_dtype, copy=False)
    with entry(xp):
        if dense_reference(math.prod(p.batch) * p.n * p.s):
            allowed = reference.allowed_mask(
                xp, p.n, p.s, device=p.device, causal=causal, key_mask=key_mask,
                mask=layout.dense_mask(xp, device=p.device))
            grads = reference.sparse_attention_vjp(wq, wk, wv, wdo, allowed, scale=scale,
                                                   bias=wbias)
        else:
            grads = block_sparse_vjp(p, wq * scale, wk, wv, wdo, layout, causal=causal,
                                     key_mask=key_mask, bias=wbias)
            grads["q"] = grads["q"] * scale
    return _shaped(grads, {"q": q, "k": k, "v": v, "bias": bias})


def local_attention_vjp(q, k, v, do, /, *, window, causal=False, block_size=64, scale=None,
                        key_mask=None, bias=None):
    """``{"q", "k", "v"[, "bias"]}`` of :func:`~arrayattn.local_attention` (``local``)."""
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    if p.s == 0:
        return {name: p.xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in (("q", q), ("k", k), ("v", v), ("bias", bias))
                if x is not None}
    layout = local_layout(p.n, s=p.s, window=window, block_size=block_size, causal=causal)
    return sparse_attention_vjp(q, k, v, do, layout=layout, scale=scale, causal=causal,
                                key_mask=key_mask, bias=bias)


def pattern_vjp(builder, **fixed):
    """The backward of a registry record whose uniform call builds its layout from the
    inputs' ``n`` with ``builder`` (:func:`arrayattn.sparse` ``_pattern_call``)."""
    def adapter(q, k, v, do, /, *, scale=None, causal=False, key_mask=None, bias=None,
                **options):
        check_qkv(q, k, v)
        causal = check_flag("causal", causal)
        layout = builder(q.shape[-2], s=k.shape[-2], **{**fixed, **options})
        return sparse_attention_vjp(q, k, v, do, layout=layout, scale=scale, causal=causal,
                                    key_mask=key_mask, bias=bias)
    adapter.__name__ = f"{builder.__name__}_attention_vjp"
    return adapter


#: Registry name -> backward adapter of the pattern records (built as the registry's
#: uniform calls build them in :mod:`arrayattn.sparse`).
PATTERN_VJPS = {
    "longformer": pattern_vjp(longformer_layout),
    "bigbird": pattern_vjp(bigbird_layout),
    "strided": pattern_vjp(strided_layout, causal=False),
    "fixed": pattern_vjp(fixed_layout, causal=False),
}
