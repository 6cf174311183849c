"""Reference forms of exact softmax attention: dense, and blockwise (the online softmax).

Vaswani et al. 2017, "Attention Is All You Need"; the blockwise recurrence is that of
Dao et al. 2022 / Dao 2023 ("FlashAttention", "FlashAttention-2"), itself the online
softmax of Milakov & Gimelshein 2018.  Both run every option through the logits
pipeline of :mod:`arrayattn.reference.logits` and return ``(O, L)``, ``L`` the
natural-log log-sum-exp of each row's visible logits (``-inf`` for a row that sees no
key).  A dropout keep-mask ``(keep, p)`` scales the probabilities after the softmax:
``O = (P * keep) V / (1 - p)``; ``L`` is that of the logits, before dropout.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .logits import Logits, pick, tile_logits, tile_logits_at
from .masks import log_total, merge_partials, partial_softmax, softmax_lse, visible_rows
from .scan import cond, scan

__all__ = ["softmax_attention", "softmax_attention_blockwise", "attention",
           "attention_blockwise", "dropped", "dropped_at", "key_blocks"]


def dropped(p, dropout, i0=0, i1=None, j0=0, j1=None):
    """``p * keep / (1 - p_drop)`` on the tile (``dropout`` ``None``: ``p``)."""
    return dropped_at(p, dropout, slice(i0, i1), slice(j0, j1))


def dropped_at(p, dropout, rows, cols):
    """:func:`dropped` on the tile at ``rows`` x ``cols`` (slices or index arrays)."""
    if dropout is None:
        return p
    xp = array_namespace(p)
    keep, rate = dropout
    return xp.where(pick(pick(keep, rows, -2), cols, -1), p / (1.0 - rate), 0.0)


def attention(q, k, v, lg: Logits, *, dropout=None):
    r""":math:`O = \operatorname{softmax}(\text{logits}) V` with every option of ``lg``:
    ``(O, L)``.  Memory ``O(n s)``."""
    x, allowed, _ = tile_logits(lg, q, k, 0, q.shape[-2], 0, k.shape[-2])
    p, lse = softmax_lse(x, allowed)
    return dropped(p, dropout) @ visible_rows(v, allowed), lse


def attention_blockwise(q, k, v, lg: Logits, *, block_size: int, dropout=None):
    r"""The same ``(O, L)`` by FlashAttention's online softmax over query and key blocks.

    For each query block the running row max ``m``, denominator ``l`` and unnormalised
    output ``acc`` are carried over the key blocks ``j`` (those of :func:`key_blocks`) and
    merged with each block's own (:func:`~arrayattn.reference.masks.merge_partials`):
    ``m' = max(m, rowmax S_j)``, ``l' = l e^{m - m'} + rowsum e^{S_j - m'}``,
    ``acc' = acc e^{m - m'} + e^{S_j - m'} V_j``; the block's output is ``acc / l`` and
    its ``L = m + log l``.  Memory ``O((n + s) d + block^2)`` per batch element.

    Both loops are :func:`~arrayattn.reference.scan.scan`\ s (traced once under
    ``jax.jit``), so every block has ``block_size`` rows: the last query block repeats
    row ``n - 1`` (dropped), the last key block repeats key ``s - 1`` (invisible).  A
    query block visits a fixed number of key blocks from its first one; those past its
    own count are skipped (:func:`~arrayattn.reference.scan.cond`).
    """
    xp = array_namespace(q, k, v)
    n, s, b = q.shape[-2], k.shape[-2], block_size
    if n == 0:
        return attention(q, k, v, lg, dropout=dropout)
    spans = [key_blocks(lg, s, b, i0, min(i0 + b, n)) for i0 in range(0, n, b)]
    first = [span[0][0] for span in spans]     # each query block's first key and its
    count = [len(span) for span in spans]      # number of key blocks (static tables)
    offsets = xp.arange(b, device=device(q))

    def query_block(_, i0, j_first, visits):
        rows = xp.minimum(i0 + offsets, n - 1)

        def key_block(state, t):
            def merge(state):
                at = j_first + t * b + offsets
                cols = xp.minimum(at, s - 1)
                x, allowed, _ = tile_logits_at(lg, q, k, rows, cols)
                if s % b:                                   # the repeated last key
                    real = (at < s)[None, :]
                    allowed = real if allowed is None else allowed & real
                m, l, e = partial_softmax(x, allowed)
                pv = dropped_at(e, dropout, rows, cols) @ visible_rows(pick(v, cols, -2),
                                                                       allowed)
                return merge_partials(state, (m, l, pv))

            return cond(t < visits, merge, state), None

        start = (xp.full((b, 1), -xp.inf, dtype=q.dtype, device=device(q)),
                 xp.zeros((b, 1), dtype=q.dtype, device=device(q)),
                 xp.zeros((b, v.shape[-1]), dtype=q.dtype, device=device(q)))
        (m, l, acc), _ = scan(key_block, start, (range(max(count)),), axis=0)
        lse = log_total(l, m)
        return None, (acc / xp.where(l > 0, l, 1.0), lse)

    _, (out, lse) = scan(query_block, None, (range(0, n, b), first, count), axis=-3,
                         like=q)
    out, lse = (xp.reshape(x, (*x.shape[:-3], x.shape[-3] * b, x.shape[-1]))[..., :n, :]
                for x in (out, lse))
    return out, lse[..., 0]


def key_blocks(lg: Logits, s: int, block_size: int, i0: int, i1: int):
    """The key blocks ``(j0, j1)`` that queries ``i0 .. i1 - 1`` may see: with a fixed
    alignment, blocks wholly outside the window are skipped (at least one is visited, so
    a block that sees no key still has a shape)."""
    lo, hi = 0, s
    if isinstance(lg.shift, int):
        if lg.right is not None:
            hi = max(1, min(s, i1 + lg.shift + lg.right))
        if lg.left is not None:
            lo = min(max(0, i0 + lg.shift - lg.left), hi - 1) // block_size * block_size
    return [(j0, min(j0 + block_size, s)) for j0 in range(lo, hi, block_size)]


def _plain(q, k, scale, causal, key_mask, mask, bias) -> Logits:
    return Logits(scale=scale, shift=k.shape[-2] - q.shape[-2], right=0 if causal else None,
                  key_mask=key_mask, mask=mask, bias=bias)


def softmax_attention(q, k, v, *, scale, causal=False, key_mask=None, mask=None, bias=None):
    r""":math:`O = \operatorname{softmax}(Q K^\top \cdot \mathrm{scale} + B + M)\, V`.

    ``q (..., n, d)``, ``k (..., s, d)``, ``v (..., s, dv)``; ``bias`` ``B (..., n, s)``
    is added to the logits (``-inf`` entries act as masked); ``M`` is ``-inf`` where the
    causal pattern, ``key_mask (..., s)`` or ``mask (..., n, s)`` forbid.  A query that
    may attend to no key returns zeros.  Memory ``O(n s)``.  (:func:`attention` with
    these options.)
    """
    return attention(q, k, v, _plain(q, k, scale, causal, key_mask, mask, bias))[0]


def softmax_attention_blockwise(q, k, v, *, scale, block_size, causal=False, key_mask=None,
                                mask=None, bias=None):
    r"""The same attention by FlashAttention's online softmax over query and key blocks
    (:func:`attention_blockwise` with these options)."""
    return attention_blockwise(q, k, v, _plain(q, k, scale, causal, key_mask, mask, bias),
                               block_size=block_size)[0]
