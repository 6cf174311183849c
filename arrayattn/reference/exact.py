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

from .logits import Logits, tile_logits
from .masks import log_total, softmax_lse, visible_rows

__all__ = ["softmax_attention", "softmax_attention_blockwise", "attention",
           "attention_blockwise", "dropped", "key_blocks"]


def dropped(p, dropout, i0=0, i1=None, j0=0, j1=None):
    """``p * keep / (1 - p_drop)`` on the tile (``dropout`` ``None``: ``p``)."""
    if dropout is None:
        return p
    xp = array_namespace(p)
    keep, rate = dropout
    return xp.where(keep[..., i0:i1, j0:j1], p / (1.0 - rate), 0.0)


def attention(q, k, v, lg: Logits, *, dropout=None):
    r""":math:`O = \operatorname{softmax}(\text{logits}) V` with every option of ``lg``:
    ``(O, L)``.  Memory ``O(n s)``."""
    x, allowed, _ = tile_logits(lg, q, k, 0, q.shape[-2], 0, k.shape[-2])
    p, lse = softmax_lse(x, allowed)
    return dropped(p, dropout) @ visible_rows(v, allowed), lse


def attention_blockwise(q, k, v, lg: Logits, *, block_size: int, dropout=None):
    r"""The same ``(O, L)`` by FlashAttention's online softmax over query and key blocks.

    For each query block the running row max ``m``, denominator ``l`` and unnormalised
    output ``acc`` are carried over the key blocks ``j``:
    ``m' = max(m, rowmax S_j)``, ``l' = l e^{m - m'} + rowsum e^{S_j - m'}``,
    ``acc' = acc e^{m - m'} + e^{S_j - m'} V_j``; the block's output is ``acc / l`` and
    its ``L = m + log l``.  Memory ``O((n + s) d + block^2)`` per batch element.
    """
    xp = array_namespace(q, k, v)
    n, s = q.shape[-2], k.shape[-2]
    outputs, lses = [], []
    for i0 in range(0, n, block_size):
        i1 = min(i0 + block_size, n)
        m = l = acc = None
        for j0, j1 in key_blocks(lg, s, block_size, i0, i1):
            x, allowed, _ = tile_logits(lg, q, k, i0, i1, j0, j1)
            if allowed is not None:
                x = xp.where(allowed, x, -xp.inf)
            m_new = xp.max(x, axis=-1, keepdims=True)
            m_new = m_new if m is None else xp.maximum(m, m_new)
            # A row with no allowed key yet keeps m = -inf but is shifted by 0 (no NaN).
            shift_by = xp.where(m_new == -xp.inf, 0.0, m_new)
            e = xp.exp(x - shift_by)
            corr = 0.0 if m is None else xp.exp(m - shift_by)
            l = xp.sum(e, axis=-1, keepdims=True) + (0.0 if m is None else corr * l)
            pv = dropped(e, dropout, i0, i1, j0, j1) @ visible_rows(v[..., j0:j1, :], allowed)
            acc = pv + (0.0 if m is None else corr * acc)
            m = m_new
        outputs.append(acc / xp.where(l > 0, l, 1.0))
        lses.append(log_total(l, m)[..., 0])
    return xp.concat(outputs, axis=-2), xp.concat(lses, axis=-1)


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
