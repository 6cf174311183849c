"""The block-sparse executor: a layout's gather plan run chunk by chunk within a memory
budget (for sparse attention, Poolingformer and their backwards)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from .._engine import numpy_engine
from .._numpy.sparse import map_chunks
from .tiles import blocked, host_indices, tile_bias, tile_mask

__all__ = ["block_sparse_attention", "Gathered", "gathered", "cut_chunks", "spans",
           "in_block_order", "unblock"]

#: Elements of the score tile plus gathered keys/values processed at once (per chunk of
#: query blocks); bounds the working memory at a few hundred MB in float32.
_CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True, eq=False)
class Gathered:
    """One call's inputs cut into its layout's blocks (zero rows pad the last block):
    what every chunk of the plan reads.  ``q (..., nqb, b, d)``, ``k``, ``v``
    ``(..., nkb, b, c)``, ``key_mask (..., nkb, b, 1)`` (or ``None``), ``bias`` as
    given ``(..., n, s)``; ``work`` the bytes of the scores the plan computes (what
    :func:`~arrayattn._engine.numpy_engine` weighs)."""

    xp: Any
    device: Any
    layout: Any
    causal: bool
    q: Any
    k: Any
    v: Any
    key_mask: Any
    bias: Any
    work: int

    def take(self, x, blocks):
        """The host block indices ``blocks (G,)`` of a blocked ``x (..., K, b, c)``."""
        return self.xp.take(x, host_indices(self.xp, blocks, self.device), axis=x.ndim - 3)

    def span(self, rows, idx, valid):
        """One span of a query-major chunk: query blocks ``rows (G,)`` against key blocks
        ``idx (G, R)``: the key blocks' device indices, the allowed mask
        ``(..., G, b, R b)`` (pattern and key mask) and the bias on the tiles."""
        xp, dev, b = self.xp, self.device, self.layout.block_size
        idx_x = host_indices(xp, idx, dev)
        allowed = tile_mask(xp, self.layout, rows, idx, valid, causal=self.causal, device=dev)
        km = self.key_mask
        if km is not None:
            kmc = xp.take(km, xp.reshape(idx_x, (-1,)), axis=km.ndim - 3)
            allowed = allowed & xp.reshape(kmc, (*kmc.shape[:-3], idx.shape[0], 1,
                                                 idx.shape[1] * b))
        kpos = (idx[:, :, None] * b + np.arange(b)).reshape(idx.shape[0], -1)
        tb = None if self.bias is None else tile_bias(xp, self.bias, rows, kpos, self.layout,
                                                      dev)
        return idx_x, allowed, tb

    def attend(self, qc, tiles):
        """Softmax attention of the gathered queries ``qc (..., G, b, d)`` over the spans
        ``tiles`` (of :meth:`span`): ``(O, L)``, the partial results merged by
        log-sum-exp (:func:`arrayattn.reference.sparse.merge_attention`)."""
        out = lse = None
        for idx_x, allowed, tb in tiles:
            o, l = reference.gathered_attention(qc, self.k, self.v, idx_x, allowed, tb)
            out, lse = (o, l) if out is None else reference.merge_attention(out, lse, o, l)
        return out, lse

    def run(self, fn, chunks) -> list:
        """``[fn(chunk) for chunk in chunks]``: on the NumPy engine's threads when it is
        chosen for this call, in order otherwise."""
        if numpy_engine(self.xp, self.work):
            return map_chunks(fn, chunks)
        return [fn(chunk) for chunk in chunks]


def gathered(p, q, k, v, layout, *, causal: bool, key_mask, bias=None) -> Gathered:
    """The :class:`Gathered` inputs of a call checked as ``p`` (a causal layout stays
    causal whatever ``causal`` says)."""
    xp, dev, b = p.xp, p.device, layout.block_size
    nqb, nkb = layout.blocks.shape
    km = None if key_mask is None else blocked(xp, key_mask[..., None], nkb, b, device=dev)
    work = layout.count_computed() * math.prod(p.batch) * (xp.finfo(q.dtype).bits // 8)
    return Gathered(xp=xp, device=dev, layout=layout, causal=causal or layout.causal,
                    q=blocked(xp, q, nqb, b, device=dev), k=blocked(xp, k, nkb, b, device=dev),
                    v=blocked(xp, v, nkb, b, device=dev), key_mask=km, bias=bias, work=work)


def cut_chunks(plan, per_slot: int, per_row: int, budget: int) -> list:
    """The plan's groups cut into chunks ``(rows, idx, valid, span)`` of about ``budget``
    elements (``per_slot`` a gathered block's, ``per_row`` a row's own); a row whose
    slots alone exceed it is walked in spans of ``span`` slots."""
    chunks = []
    for rows, idx, valid in plan:
        r = idx.shape[1]
        step = max(1, budget // (r * per_slot + per_row))
        span = min(r, max(1, budget // per_slot))
        chunks += [(rows[c0:c0 + step], idx[c0:c0 + step], valid[c0:c0 + step], span)
                   for c0 in range(0, rows.size, step)]
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
    return xp.take(out, host_indices(xp, inv, device), axis=out.ndim + axis)


def unblock(xp, x, count: int):
    """Blocked rows ``(..., K, b, c)`` as ``(..., count, c)`` (the padding dropped)."""
    x = xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))
    return x[..., :count, :] if x.shape[-2] != count else x


def block_sparse_attention(p, q, k, v, layout, *, causal: bool, key_mask, bias=None):
    """The gather plan of ``layout`` run group by group on
    :func:`arrayattn.reference.sparse.gathered_attention`. ``q`` is already scaled; all in
    the working dtype. Rows too long for the memory budget (global rows reach every
    block) are split over their key blocks too, and the partial softmaxes merged by
    log-sum-exp (:func:`arrayattn.reference.sparse.merge_attention`)."""
    xp = p.xp
    if math.prod(p.batch) == 0:          # an empty batch (no heads): nothing to plan
        return xp.zeros((*p.batch, p.n, p.dv), dtype=q.dtype, device=p.device)
    g = gathered(p, q, k, v, layout, causal=causal, key_mask=key_mask, bias=bias)
    b, batch = layout.block_size, math.prod(p.batch)
    chunks = cut_chunks(layout.plan, batch * (b * b + b * (p.d + p.dv)),
                        batch * b * (p.d + p.dv), _CHUNK_ELEMENTS)

    def attend_chunk(chunk):
        rows, idx, valid, span = chunk
        tiles = (g.span(rows, i, m) for i, m in spans(idx, valid, span))
        return g.attend(g.take(g.q, rows), tiles)[0]                 # (..., G, b, dv)

    outs = g.run(attend_chunk, chunks)
    return unblock(xp, in_block_order(xp, outs, chunks, -3, p.device), p.n)
