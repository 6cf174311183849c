r"""Backward of exact softmax attention (the vector-Jacobian product), dense and blockwise.

With :math:`S = Q K^\top \cdot \text{scale} + B` (masked entries :math:`-\infty`),
:math:`P = \operatorname{softmax}(S)`, :math:`O = P V` and the output cotangent
:math:`dO`, FlashAttention-2's backward (Dao 2023, Algorithm 2) is

.. math::

    dV = P^\top dO, \quad dP = dO\, V^\top, \quad D = \operatorname{rowsum}(dO \circ O),
    \quad dS = P \circ (dP - D),

    dQ = \text{scale}\; dS\, K, \quad dK = \text{scale}\; dS^\top Q, \quad dB = dS.

``D`` replaces ``rowsum(P * dP)`` (equal, since ``O = P V``), so the blockwise form needs
only ``O`` and the log-sum-exp ``L`` of each row from the forward: every tile recomputes
``P_ij = exp(S_ij - L_i)``.  A position that is not visible has ``P = 0`` and is selected
out with ``where`` before any product (``0 * nan`` is ``nan``), so whatever a masked key
or value holds never reaches a gradient of a visible one.  An empty row (no visible key)
has zero output and zero gradients.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .masks import allowed_mask, causal_mask

__all__ = ["softmax_attention_vjp", "softmax_attention_blockwise_vjp", "attention_lse",
           "sum_to_shape"]


def sum_to_shape(x, shape):
    """``x`` summed over the axes along which an argument of ``shape`` was broadcast to
    ``x.shape`` (the cotangent of a broadcast input: grouped heads, shared masks)."""
    xp = array_namespace(x)
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    if lead:
        x = xp.sum(x, axis=tuple(range(lead)))
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, x.shape)) if a == 1 and b != 1)
    return xp.sum(x, axis=axes, keepdims=True) if axes else x


def _probabilities(scores, allowed, lse):
    """``P = exp(S - L)`` on the visible entries, exactly 0 elsewhere (also on an empty
    row, whose ``L = -inf``)."""
    xp = array_namespace(scores)
    visible = xp.isfinite(lse)[..., None] if allowed is None else (
        allowed & xp.isfinite(lse)[..., None])
    safe = xp.where(visible, scores - xp.where(xp.isfinite(lse), lse, 0.0)[..., None], -xp.inf)
    return xp.exp(safe), visible


def attention_lse(scores, allowed=None):
    """The natural-log log-sum-exp of each row of ``scores (..., n, s)`` over its
    ``allowed`` entries, ``(..., n)``; ``-inf`` for a row that sees no key."""
    xp = array_namespace(scores)
    if allowed is not None:
        scores = xp.where(allowed, scores, -xp.inf)
    m = xp.max(scores, axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    total = xp.sum(xp.exp(scores - m), axis=-1)
    return xp.where(total > 0, xp.log(xp.where(total > 0, total, 1.0)) + m[..., 0], -xp.inf)


def _tile_grads(xp, q, k, v, do, delta, lse, scores, allowed, scale):
    """One tile's ``(dS, dQ, dK, dV)`` from its recomputed ``scores``."""
    p, visible = _probabilities(scores, allowed, lse)
    dp = do @ xp.matrix_transpose(v)
    ds = xp.where(visible, p * (dp - delta[..., None]), 0.0)
    return ds, scale * (ds @ k), scale * (xp.matrix_transpose(ds) @ q), xp.matrix_transpose(p) @ do


def softmax_attention_vjp(q, k, v, do, *, scale, causal=False, key_mask=None, mask=None,
                          bias=None):
    """``{"q": dQ, "k": dK, "v": dV[, "bias": dB]}`` of the dense form, by the equations
    above (memory ``O(n s)``); ``dB`` has the broadcast shape ``(..., n, s)``."""
    xp = array_namespace(q, k, v, do)
    scores = (q * scale) @ xp.matrix_transpose(k)
    if bias is not None:
        scores = scores + bias
    allowed = allowed_mask(xp, q.shape[-2], k.shape[-2], device=device(q), causal=causal,
                           key_mask=key_mask, mask=mask)
    lse = attention_lse(scores, allowed)
    p, visible = _probabilities(scores, allowed, lse)
    out = p @ _visible_rows(xp, v, visible)
    delta = xp.sum(do * out, axis=-1)
    ds, dq, dk, dv = _tile_grads(xp, q, k, v, do, delta, lse, scores, allowed, scale)
    grads = {"q": dq, "k": dk, "v": dv}
    if bias is not None:
        grads["bias"] = ds
    return grads


def softmax_attention_blockwise_vjp(q, k, v, do, *, scale, block_size, causal=False,
                                   key_mask=None, mask=None, bias=None):
    """The same gradients by FlashAttention-2's blockwise backward: one pass over the key
    blocks of each query block gives its log-sum-exp ``L_i`` and ``D_i = rowsum(dO_i
    O_i)``; then for every key block ``j`` and query block ``i`` the tile
    ``P_ij = exp(S_ij - L_i)`` is recomputed and ``dK_j``, ``dV_j``, ``dQ_i`` (and the
    ``dB`` tile) accumulated.  Memory ``O((n + s) d + block^2)`` per batch element (plus
    ``dB (..., n, s)`` when ``bias`` is given).  Causal: tiles wholly above the diagonal
    are skipped."""
    xp = array_namespace(q, k, v, do)
    n, s, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    batch = _batch_shape(*(x.shape[:-2] for x in (q, k, v, do, bias, mask) if x is not None),
                         *(() if key_mask is None else (key_mask.shape[:-1],)))
    rows = [(i0, min(i0 + block_size, n)) for i0 in range(0, n, block_size)]
    cols = [(j0, min(j0 + block_size, s)) for j0 in range(0, s, block_size)]

    def zeros(m, f):
        return xp.zeros((*batch, m, f), dtype=q.dtype, device=device(q))

    def tile(i0, i1, j0, j1):
        sc = (q[..., i0:i1, :] * scale) @ xp.matrix_transpose(k[..., j0:j1, :])
        if bias is not None:
            sc = sc + bias[..., i0:i1, j0:j1]
        allowed = allowed_mask(xp, i1 - i0, j1 - j0, device=device(q),
                               key_mask=None if key_mask is None else key_mask[..., j0:j1],
                               mask=None if mask is None else mask[..., i0:i1, j0:j1])
        if causal:
            t = causal_mask(xp, i1 - i0, j1 - j0, device=device(q), shift=s - n, row0=i0,
                            col0=j0)
            allowed = t if allowed is None else allowed & t
        return sc, allowed

    def visits(i1, j0):   # causal: does any query of the block see a key of the block?
        return not causal or j0 <= i1 - 1 + s - n

    lse, delta = [], []
    for i0, i1 in rows:
        seen = [(j0, j1) for j0, j1 in cols if visits(i1, j0)]
        tiles = [tile(i0, i1, j0, j1) for j0, j1 in seen]
        row_lse = _logaddexp([attention_lse(sc, al) for sc, al in tiles], zeros(i1 - i0, 1))
        out = zeros(i1 - i0, dv)
        for (sc, al), (j0, j1) in zip(tiles, seen):
            p, visible = _probabilities(sc, al, row_lse)
            out = out + p @ _visible_rows(xp, v[..., j0:j1, :], visible)
        lse.append(row_lse)
        delta.append(xp.sum(do[..., i0:i1, :] * out, axis=-1))

    dq = [zeros(i1 - i0, d) for i0, i1 in rows]
    dk, dv_, db = [], [], [[zeros(i1 - i0, j1 - j0) for j0, j1 in cols] for i0, i1 in rows]
    for jb, (j0, j1) in enumerate(cols):
        dk_j, dv_j = zeros(j1 - j0, d), zeros(j1 - j0, dv)
        for ib, (i0, i1) in enumerate(rows):
            if not visits(i1, j0):
                continue
            sc, al = tile(i0, i1, j0, j1)
            ds, dq_i, dk_ij, dv_ij = _tile_grads(
                xp, q[..., i0:i1, :], k[..., j0:j1, :], v[..., j0:j1, :], do[..., i0:i1, :],
                delta[ib], lse[ib], sc, al, scale)
            dq[ib], dk_j, dv_j, db[ib][jb] = dq[ib] + dq_i, dk_j + dk_ij, dv_j + dv_ij, ds
        dk.append(dk_j)
        dv_.append(dv_j)
    grads = {"q": xp.concat(dq, axis=-2), "k": xp.concat(dk, axis=-2),
             "v": xp.concat(dv_, axis=-2)}
    if bias is not None:
        grads["bias"] = xp.concat([xp.concat(r, axis=-1) for r in db], axis=-2)
    return grads


def _batch_shape(*batches):
    """The broadcast of the leading (batch) shapes ``batches``."""
    width = max(len(b) for b in batches)
    padded = [(1,) * (width - len(b)) + tuple(b) for b in batches]
    return tuple(max(sizes) for sizes in zip(*padded))


def _logaddexp(lses, like):
    """``log(sum_t exp(L_t))`` of per-tile log-sum-exps (``-inf`` safe)."""
    xp = array_namespace(like)
    if not lses:
        return xp.full(like.shape[:-1], -xp.inf, dtype=like.dtype, device=device(like))
    return attention_lse(xp.stack([l + like[..., 0] for l in lses], axis=-1))


def _visible_rows(xp, v, visible):
    """``v`` with the rows no query of the tile sees set to 0 (``0 * nan`` guard)."""
    return xp.where(xp.any(visible, axis=-2)[..., None], v, 0.0)
