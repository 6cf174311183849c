"""Reference forms of exact softmax attention: dense, and blockwise (the online softmax).

Vaswani et al. 2017, "Attention Is All You Need"; the blockwise recurrence is that of
Dao et al. 2022 / Dao 2023 ("FlashAttention", "FlashAttention-2"), itself the online
softmax of Milakov & Gimelshein 2018.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .masks import allowed_mask, causal_mask, masked_softmax

__all__ = ["softmax_attention", "softmax_attention_blockwise"]


def softmax_attention(q, k, v, *, scale, causal=False, key_mask=None, mask=None, bias=None):
    r""":math:`O = \operatorname{softmax}(Q K^\top \cdot \mathrm{scale} + B + M)\, V`.

    ``q (..., n, d)``, ``k (..., s, d)``, ``v (..., s, dv)``; ``bias`` ``B (..., n, s)``
    is added to the logits (``-inf`` entries act as masked); ``M`` is ``-inf`` where the
    causal pattern, ``key_mask (..., s)`` or ``mask (..., n, s)`` forbid.  A query that
    may attend to no key returns zeros.  Memory ``O(n s)``.
    """
    xp = array_namespace(q, k, v)
    scores = (q * scale) @ xp.matrix_transpose(k)
    if bias is not None:
        scores = scores + bias
    allowed = allowed_mask(xp, q.shape[-2], k.shape[-2], device=device(q), causal=causal,
                           key_mask=key_mask, mask=mask)
    return masked_softmax(scores, allowed) @ v


def softmax_attention_blockwise(q, k, v, *, scale, block_size, causal=False, key_mask=None,
                                mask=None, bias=None):
    r"""The same attention by FlashAttention's online softmax over query and key blocks.

    For each query block the running row max ``m``, denominator ``l`` and unnormalised
    output ``acc`` are carried over the key blocks ``j``:
    ``m' = max(m, rowmax S_j)``, ``l' = l e^{m - m'} + rowsum e^{S_j - m'}``,
    ``acc' = acc e^{m - m'} + e^{S_j - m'} V_j``; the block's output is ``acc / l``.
    Memory ``O((n + s) d + block^2)`` per batch element; same result to rounding.
    """
    xp = array_namespace(q, k, v)
    n, s, shift = q.shape[-2], k.shape[-2], k.shape[-2] - q.shape[-2]
    q = q * scale
    outputs = []
    for i0 in range(0, n, block_size):
        i1 = min(i0 + block_size, n)
        m = l = acc = None
        # Causal: key blocks wholly after this query block's last key are skipped
        # (at least one block is visited, so a block that sees no key still has a shape).
        for j0 in range(0, max(1, min(s, i1 + shift)) if causal else s, block_size):
            j1 = min(j0 + block_size, s)
            sc = q[..., i0:i1, :] @ xp.matrix_transpose(k[..., j0:j1, :])
            if bias is not None:
                sc = sc + bias[..., i0:i1, j0:j1]
            allowed = allowed_mask(
                xp, i1 - i0, j1 - j0, device=device(q),
                key_mask=None if key_mask is None else key_mask[..., j0:j1],
                mask=None if mask is None else mask[..., i0:i1, j0:j1])
            if causal:
                tile = causal_mask(xp, i1 - i0, j1 - j0, device=device(q), shift=shift,
                                   row0=i0, col0=j0)
                allowed = tile if allowed is None else (allowed & tile)
            if allowed is not None:
                sc = xp.where(allowed, sc, -xp.inf)
            m_new = xp.max(sc, axis=-1, keepdims=True)
            m_new = m_new if m is None else xp.maximum(m, m_new)
            # A row with no allowed key yet keeps m = -inf but is shifted by 0 (no NaN).
            shift_by = xp.where(m_new == -xp.inf, 0.0, m_new)
            p = xp.exp(sc - shift_by)
            corr = 0.0 if m is None else xp.exp(m - shift_by)
            l = xp.sum(p, axis=-1, keepdims=True) + (0.0 if m is None else corr * l)
            acc = p @ v[..., j0:j1, :] + (0.0 if m is None else corr * acc)
            m = m_new
        outputs.append(acc / xp.where(l > 0, l, 1.0))
    return xp.concat(outputs, axis=-2)
