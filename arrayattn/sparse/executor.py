"""The block-sparse executor: a layout's gather plan run chunk by chunk within a memory
budget (for sparse attention, Poolingformer and their backwards).

Two forms of the same sums, chosen by the caller (``threads``):

* the NumPy engine's: the full plan (:attr:`BlockLayout.plan`) cut into chunks run in
  threads (:func:`arrayattn._numpy.sparse.map_chunks`);
* the scanned form, everywhere else: the plan in a few groups
  (:attr:`BlockLayout.scan_plan`), per group a :func:`~arrayattn.reference.scan.scan`
  over equal chunks of query blocks and, inside, over equal parts of their key blocks,
  merged by log-sum-exp.  Under ``jax.jit`` each loop body is traced once, so the
  compiled program does not grow with ``n`` (#26).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from ..core.devices import chunk_elements
from .._numpy.parallel import num_threads, own, per_thread
from .._numpy.sparse import (CHUNK_SCALE, attend_tiles, chunk_out, drop_bad_values, finite,
                             map_chunks, take_blocks)
from ..reference.indexing import take_in_bounds
from ..reference.scan import scan
from .tiles import (PER_BLOCK, PER_KEY, blocked, host_indices, mask_from, mask_tables,
                    tile_bias_at, tile_mask)

__all__ = ["block_sparse_attention", "scanned_group", "plan_work", "Gathered", "gathered",
           "cut_chunks", "spans", "in_block_order", "unblock", "engine_tile"]

#: Key blocks of a short row -- a window's -- that a chunk attends at once.  A longer row
#: (strided, fixed, a global token's: rows that reach more blocks as ``n`` grows) is
#: walked in parts merged by log-sum-exp, at least two, so that its compiled program is
#: the same whether or not the whole row fits the chunk budget: it would otherwise gain
#: the merge loop as ``n`` passes that budget (strided, ``(1, 8, n, 64)``: 163 operations
#: at ``n = 1024``, 241 from 4096 on; compile 0.6 -> 1.1 s).
SHORT_ROW = 8


@dataclass(frozen=True, eq=False)
class Gathered:
    """One call's inputs cut into its layout's blocks (zero rows pad the last block):
    what every chunk of the plan reads.  ``q (..., nqb, b, d)``, ``k``, ``v``
    ``(..., nkb, b, c)``, ``key_mask (..., nkb, b, 1)`` (or ``None``), ``bias`` as
    given ``(..., n, s)``."""

    xp: Any
    device: Any
    layout: Any
    causal: bool
    q: Any
    k: Any
    v: Any
    key_mask: Any
    bias: Any

    def take(self, x, blocks):
        """The host block indices ``blocks (G,)`` of a blocked ``x (..., K, b, c)``."""
        return take_in_bounds(x, host_indices(self.xp, blocks, self.device), axis=x.ndim - 3)

    def span(self, rows, idx, valid):
        """One span of a query-major chunk: query blocks ``rows (G,)`` against key blocks
        ``idx (G, R)``: the key blocks' device indices, the allowed mask
        ``(..., G, b, R b)`` (pattern and key mask) and the bias on the tiles."""
        xp, dev = self.xp, self.device
        idx_x = host_indices(xp, idx, dev)
        allowed = tile_mask(xp, self.layout, rows, idx, valid, causal=self.causal, device=dev)
        return (idx_x, self.key_masked(idx_x, allowed),
                self.bias_on(host_indices(xp, rows, dev), idx_x))

    def key_masked(self, idx, allowed):
        """The pattern's mask ``allowed (G, b, R b)`` on the key blocks ``idx (G, R)``
        (device integers) and the key mask: ``(..., G, b, R b)``."""
        km = self.key_mask
        if km is None:
            return allowed
        kmc = take_in_bounds(km, self.xp.reshape(idx, (-1,)), axis=km.ndim - 3)
        return allowed & self.xp.reshape(kmc, (*kmc.shape[:-3], idx.shape[0], 1,
                                               idx.shape[1] * kmc.shape[-2]))

    def bias_on(self, rows, idx):
        """The bias on the tiles of query blocks ``rows (G,)`` and key blocks ``idx (G, R)``
        (device integers), or ``None``."""
        if self.bias is None:
            return None
        xp, b = self.xp, self.layout.block_size
        kpos = idx[:, :, None] * b + xp.arange(b, dtype=idx.dtype, device=self.device)
        return tile_bias_at(xp, self.bias, rows, xp.reshape(kpos, (idx.shape[0], -1)),
                            self.layout)

    def attend(self, qc, tiles):
        """Softmax attention of the gathered queries ``qc (..., G, b, d)`` over the spans
        ``tiles`` (of :meth:`span`): ``(O, L)``, the partial results merged by
        log-sum-exp (:func:`arrayattn.reference.sparse.merge_attention`)."""
        out = lse = None
        for idx_x, allowed, tb in tiles:
            o, l = reference.gathered_attention(qc, self.k, self.v, idx_x, allowed, tb)
            out, lse = (o, l) if out is None else reference.merge_attention(out, lse, o, l)
        return out, lse

    def run(self, fn, chunks, *, threads: bool) -> list:
        """``[fn(chunk) for chunk in chunks]``: on the NumPy engine's threads with
        ``threads`` (the caller's choice, made by :func:`arrayattn.core.pipeline.implementation`;
        NumPy inputs only), in order otherwise."""
        if threads:
            return map_chunks(fn, chunks)
        return [fn(chunk) for chunk in chunks]


def gathered(p, q, k, v, layout, *, causal: bool, key_mask, bias=None) -> Gathered:
    """The :class:`Gathered` inputs of a call checked as ``p`` (a causal layout stays
    causal whatever ``causal`` says)."""
    xp, dev, b = p.xp, p.device, layout.block_size
    nqb, nkb = layout.blocks.shape
    km = None if key_mask is None else blocked(xp, key_mask[..., None], nkb, b, device=dev)
    return Gathered(xp=xp, device=dev, layout=layout, causal=causal or layout.causal,
                    q=blocked(xp, q, nqb, b, device=dev), k=blocked(xp, k, nkb, b, device=dev),
                    v=blocked(xp, v, nkb, b, device=dev), key_mask=km, bias=bias)


def plan_work(p, layout) -> int:
    """Bytes of the scores the gather plan of ``layout`` computes for a call checked as
    ``p`` (in its working dtype): the work estimate of the sparse specs, which the
    pipeline weighs to choose the threaded chunks (``threads``)."""
    return (layout.count_computed() * math.prod(p.batch)
            * (p.xp.finfo(p.work_dtype).bits // 8))


def cut_chunks(plan, per_slot: int, per_row: int, budget: int, threads: int = 1) -> list:
    """The plan's groups cut into chunks ``(rows, idx, valid, span)`` of about ``budget``
    elements (``per_slot`` a gathered block's, ``per_row`` a row's own); a row whose
    slots alone exceed it is walked in spans of ``span`` slots.

    With ``threads``, where the plan makes more than one chunk: their total count is
    rounded up to a multiple of ``threads`` and the work (rows x elements per row) shared
    out over it, each group cut into equal chunks of about that share (the threads take
    chunks as they free up: 4 chunks of 156, 156, 156 and 44 gathered blocks on 2 threads
    take 312 blocks' time, 4 of 128 take 256).  The count is rounded over all groups, not
    per group: Longformer's one global row beside its windowed rows, each group rounded
    up on its own, ran 1.07x the time of the unbalanced cut at n = 4096."""
    cost = [idx.shape[1] * per_slot + per_row for _, idx, _ in plan]   # per row
    steps = [max(1, budget // c) for c in cost]
    bounds = [list(range(0, rows.size, step)) + [rows.size]
              for (rows, _, _), step in zip(plan, steps)]
    if threads > 1 and sum(len(b) - 1 for b in bounds) > 1:
        work = [rows.size * c for (rows, _, _), c in zip(plan, cost)]
        target = per_thread(sum(len(b) - 1 for b in bounds), threads,
                            sum(rows.size for rows, _, _ in plan))
        counts = [min(rows.size, max(1, -(-w * target // sum(work))))
                  for (rows, _, _), w in zip(plan, work)]
        bounds = [[rows.size * i // count for i in range(count + 1)]
                  for (rows, _, _), count in zip(plan, counts)]
    chunks = []
    for (rows, idx, valid), b in zip(plan, bounds):
        span = min(idx.shape[1], max(1, budget // per_slot))
        chunks += [(rows[c0:c1], idx[c0:c1], valid[c0:c1], span)
                   for c0, c1 in zip(b[:-1], b[1:])]
    return chunks


def spans(idx, valid, span: int):
    """The slots ``idx, valid (G, R)`` of a chunk in pieces of ``span`` slots."""
    return ((idx[:, r0:r0 + span], valid[:, r0:r0 + span])
            for r0 in range(0, idx.shape[1], span))


def in_block_order(xp, parts, chunks, axis: int, device):
    """Per-chunk results, concatenated along the block ``axis``, put back in block order."""
    out = parts[0] if len(parts) == 1 else xp.concat(parts, axis=axis)
    perm = np.concatenate([c[0] for c in chunks])
    if np.array_equal(perm, np.arange(perm.size)):
        return out
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return take_in_bounds(out, host_indices(xp, inv, device), axis=out.ndim + axis)


def unblock(xp, x, count: int):
    """Blocked rows ``(..., K, b, c)`` as ``(..., count, c)`` (the padding dropped)."""
    x = xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
    return x[..., :count, :] if x.shape[-2] != count else x


def block_sparse_attention(p, q, k, v, layout, *, causal: bool, key_mask, bias=None,
                           threads: bool = False, scale=None, into: str | None = None):
    """The gather plan of ``layout`` run on
    :func:`arrayattn.reference.sparse.gathered_attention`. ``q`` is already scaled; all in
    the working dtype. Rows too long for the memory budget (global rows reach every
    block) are split over their key blocks too, and the partial softmaxes merged by
    log-sum-exp (:func:`arrayattn.reference.sparse.merge_attention`).  ``scale``: the
    queries' factor (``None``: ``q`` is scaled already); the engine scales each chunk's
    gathered queries in its scratch buffer, the same products without a scaled copy of
    ``q``.  ``into`` (the engine, internal): the chunks' outputs are concatenated into
    the calling thread's workspace buffer of that name
    (:func:`~arrayattn._numpy.parallel.own`), for an intermediate the caller consumes
    before it returns -- never a result.
    ``threads``: the
    NumPy engine's threaded chunks of the full plan (the caller's choice, NumPy inputs
    only), each run by :func:`arrayattn._numpy.sparse.attend_tiles` where the values are
    all finite (chosen once here; else with the bad values zeroed and their keys' scores
    NaN, as the reference form's guards do); else
    the scanned form (:func:`scanned_group`), whose program JAX compiles the same at
    every ``n``."""
    xp = p.xp
    if math.prod(p.batch) == 0:          # an empty batch (no heads): nothing to plan
        return xp.zeros((*p.batch, p.n, p.dv), dtype=q.dtype, device=p.device)
    if scale is not None and not threads:
        q = q * scale
    g = gathered(p, q, k, v, layout, causal=causal, key_mask=key_mask, bias=bias)
    b, batch = layout.block_size, math.prod(p.batch)
    per_slot, per_row = batch * (b * b + b * (p.d + p.dv)), batch * b * (p.d + p.dv)
    budget = chunk_elements(q)       # the score tiles and gathered rows of one chunk
    if not threads:
        groups = layout.scan_plan
        outs = [scanned_group(g, group, per_slot, per_row, budget) for group in groups]
        return unblock(xp, in_block_order(xp, outs, groups, -3, p.device), p.n)
    vb, bad = (g.v, None) if finite(g.v) else drop_bad_values(g.v)   # chosen once
    chunks = cut_chunks(layout.plan, per_slot, per_row, CHUNK_SCALE * budget,
                        threads=num_threads())

    def attend_chunk(chunk):
        rows, idx, valid, span = chunk
        tiles = (engine_tile(g, rows, i, m, bad) for i, m in spans(idx, valid, span))
        qc = take_blocks(g.q, rows)
        if scale is not None:
            qc *= scale
        return attend_tiles(qc, g.k, vb, tiles,                         # (..., G, b, dv)
                            chunk_out if len(chunks) > 1 else None)   # concatenated below

    outs = map_chunks(attend_chunk, chunks)
    if into is not None and len(outs) > 1:
        shape = (*outs[0].shape[:-3], sum(o.shape[-3] for o in outs), *outs[0].shape[-2:])
        outs = [np.concatenate(outs, axis=-3, out=own(shape, outs[0].dtype, into))]
    return unblock(xp, in_block_order(xp, outs, chunks, -3, p.device), p.n)


def engine_tile(g: Gathered, rows, idx, valid, bad=None):
    """One span of a chunk for the NumPy engine (:func:`arrayattn._numpy.sparse.attend_tiles`):
    ``(idx, allowed, bias, poison)``, ``allowed`` ``None`` where every slot is allowed (a
    block-level pattern's full rows: no mask to apply), ``poison`` the gathered keys whose
    values ``bad (..., K, b)`` were not finite (``None`` where there are none)."""
    idx_x = host_indices(g.xp, idx, g.device)
    allowed = g.key_masked(idx_x, tile_mask(g.xp, g.layout, rows, idx, valid,
                                            causal=g.causal, device=g.device))
    if allowed.all():
        allowed = None
    poison = None
    if bad is not None:
        flat = np.take(bad, idx.reshape(-1), axis=-2)                      # (..., G R, b)
        poison = np.reshape(flat, (*flat.shape[:-2], idx.shape[0], 1,
                                   idx.shape[1] * flat.shape[-1]))
        if not poison.any():
            poison = None
    return idx, allowed, g.bias_on(host_indices(g.xp, rows, g.device), idx_x), poison


def scanned_group(g: Gathered, group, per_slot: int, per_row: int, budget: int):
    """One group ``(rows, idx, valid)`` of the scanned plan: ``(..., G, b, dv)``.

    A :func:`~arrayattn.reference.scan.scan` over chunks of ``step`` query blocks (the
    last block repeated to fill the last chunk, the repeats dropped after) and, in each
    chunk, over parts of ``span`` key blocks (masked slots fill the last part; two parts
    at least for rows of more than :data:`SHORT_ROW` blocks) whose partial softmaxes are
    merged by log-sum-exp.  The pattern's tables are built once
    on the host (:func:`~arrayattn.sparse.tiles.mask_tables`) and scanned with the
    chunks; the mask of a part is made from its slice.  ``budget`` bounds a chunk's
    elements as in :func:`cut_chunks`; the chunks (parts) are of equal size."""
    xp, dev, b = g.xp, g.device, g.layout.block_size
    rows, idx, valid = group
    count, r = rows.size, idx.shape[1]
    # as many chunks (parts) as the budget asks for, all of one size: the fill is less
    # than one block per chunk (slot per part)
    chunks = -(-count // max(1, budget // (r * per_slot + per_row)))
    parts = -(-r // max(1, budget // per_slot))
    if r > SHORT_ROW:           # a row that grows with n: its merge loop at every n
        parts = max(2, parts)
    step, span = -(-count // chunks), -(-r // parts)
    rows, idx, valid = (np.concatenate([x, np.repeat(x[-1:], chunks * step - count, axis=0)])
                        for x in (rows, idx, valid))
    idx, valid = (np.pad(x, ((0, 0), (0, parts * span - r))) for x in (idx, valid))
    t = mask_tables(xp, g.layout, rows, idx, valid, causal=g.causal, device=dev)
    # (chunks, step, parts, span [* b]) and (chunks, step, b): scanned along axis 0, then
    # a chunk's parts along axis -2
    t = {name: xp.reshape(a, (chunks, step, parts, span * b) if name in PER_KEY
                          else (chunks, step, parts, span) if name in PER_BLOCK
                          else (chunks, step, b)) for name, a in t.items()}
    if "idx" not in t:                            # (the mask tables may hold them)
        t["idx"] = xp.reshape(host_indices(xp, idx, dev), (chunks, step, parts, span))
    t["rows"] = xp.reshape(host_indices(xp, rows, dev), (chunks, step))
    names = list(t)
    per_part = [name for name in names if name in PER_KEY + PER_BLOCK]

    def chunk(_, *tables):
        c = dict(zip(names, tables))
        qc = take_in_bounds(g.q, c["rows"], axis=g.q.ndim - 3)

        def attend(*tiles):
            tile = {**c, **dict(zip(per_part, tiles))}
            allowed = mask_from(xp, g.layout, tile, causal=g.causal)
            return reference.gathered_attention(qc, g.k, g.v, tile["idx"],
                                                g.key_masked(tile["idx"], allowed),
                                                g.bias_on(c["rows"], tile["idx"]))

        if parts == 1:                            # whole rows at once: nothing to merge
            return None, attend(*(c[name][..., 0, :] for name in per_part))[0]
        empty = (xp.zeros((step, b, g.v.shape[-1]), dtype=g.q.dtype, device=dev),
                 xp.full((step, b), -xp.inf, dtype=g.q.dtype, device=dev))
        (out, _), _ = scan(lambda merged, *tiles: (
            reference.merge_attention(*merged, *attend(*tiles)), None),
            empty, [c[name] for name in per_part], axis=-2)
        return None, out

    _, out = scan(chunk, None, [t[name] for name in names], axis=0)   # (C, ..., step, b, dv)
    out = xp.permute_dims(out, (*range(1, out.ndim - 3), 0, *range(out.ndim - 3, out.ndim)))
    out = xp.reshape(out, (*out.shape[:-4], chunks * step, *out.shape[-2:]))
    return out[..., :count, :, :]                                     # the repeats dropped
