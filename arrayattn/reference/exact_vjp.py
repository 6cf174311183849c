r"""Backward of exact softmax attention (the vector-Jacobian product), dense and blockwise.

With the final logits :math:`S` of the pipeline (:mod:`arrayattn.reference.logits`; masked
entries :math:`-\infty`), :math:`P = \operatorname{softmax}(S)`, the dropout keep-mask
:math:`Z = \text{keep} / (1 - p)` (1 without dropout), :math:`O = (P \circ Z) V` and the
output cotangent :math:`dO`, FlashAttention-2's backward (Dao 2023, Algorithm 2) is

.. math::

    dV = (P \circ Z)^\top dO, \quad dP = (dO\, V^\top) \circ Z, \quad
    D = \operatorname{rowsum}(dO \circ O), \quad dS = P \circ (dP - D),

    dQ = \text{scale}\; (dS \circ S')\, K, \quad dK = \text{scale}\; (dS \circ S')^\top Q,
    \quad dB = dS,

``S'`` the slope of the logits in the raw score ``scale q.k`` (softcap:
``1 - tanh^2(x / c)``; ``score_mod``: its derivative; else 1).  ``D`` replaces
``rowsum(P * dP)`` (equal, since ``O = (P Z) V``), so the blockwise form needs only the
log-sum-exp ``L`` of each row: every tile recomputes ``P_ij = exp(S_ij - L_i)``.  A
position that is not visible has ``P = 0`` and is selected out with ``where`` before any
product (``0 * nan`` is ``nan``); an empty row has zero output and zero gradients.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .exact import attention_blockwise, dropped, key_blocks
from .logits import Logits, tile_logits
from .masks import softmax_lse, visible_rows

__all__ = ["attention_vjp", "attention_blockwise_vjp", "sum_to_shape"]


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


def _tile_grads(lg: Logits, q, k, v, do, delta, lse, dropout, i0, i1, j0, j1):
    """One tile's ``(dS, dQ_i, dK_j, dV_j)``, ``P`` recomputed from ``L``."""
    xp = array_namespace(q, k, v, do)
    x, allowed, slope = tile_logits(lg, q, k, i0, i1, j0, j1, slope=True)
    visible = lse[..., i0:i1, None] != -xp.inf      # an empty row; a NaN row stays NaN
    visible = visible if allowed is None else (allowed & visible)
    shifted = xp.where(visible, x - xp.where(visible, lse[..., i0:i1, None], 0.0), -xp.inf)
    p = xp.exp(shifted)
    vj, kj = visible_rows(v[..., j0:j1, :], visible), visible_rows(k[..., j0:j1, :], visible)
    dob = do[..., i0:i1, :]
    dp = dropped(dob @ xp.matrix_transpose(vj), dropout, i0, i1, j0, j1)
    ds = xp.where(visible, p * (dp - delta[..., i0:i1, None]), 0.0)
    dsr = ds if slope is None else ds * slope
    qi = visible_rows(q[..., i0:i1, :], xp.matrix_transpose(visible))
    return (ds, lg.scale * (dsr @ kj), lg.scale * (xp.matrix_transpose(dsr) @ qi),
            xp.matrix_transpose(dropped(p, dropout, i0, i1, j0, j1)) @ dob)


def attention_vjp(q, k, v, do, lg: Logits, *, dropout=None):
    """``{"q": dQ, "k": dK, "v": dV, "bias": dB}`` of the dense form, by the equations
    above (memory ``O(n s)``); ``dB`` has the broadcast shape ``(..., n, s)``."""
    xp = array_namespace(q, k, v, do)
    n, s = q.shape[-2], k.shape[-2]
    x, allowed, _ = tile_logits(lg, q, k, 0, n, 0, s)
    p, lse = softmax_lse(x, allowed)
    delta = xp.sum(do * (dropped(p, dropout) @ visible_rows(v, allowed)), axis=-1)
    ds, dq, dk, dv = _tile_grads(lg, q, k, v, do, delta, lse, dropout, 0, n, 0, s)
    return {"q": dq, "k": dk, "v": dv, "bias": ds}


def attention_blockwise_vjp(q, k, v, do, lg: Logits, *, block_size: int, dropout=None):
    """The same gradients by FlashAttention-2's blockwise backward: the forward gives ``O``
    and ``L``, ``D = rowsum(dO O)``; then for every key block ``j`` and query block ``i``
    the tile ``P_ij = exp(S_ij - L_i)`` is recomputed and ``dK_j``, ``dV_j``, ``dQ_i``
    (and the ``dB`` tile, when ``lg`` has a bias) accumulated.  Memory ``O((n + s) d +
    block^2)`` per batch element (plus ``dB (..., n, s)``)."""
    xp = array_namespace(q, k, v, do)
    n, s, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    out, lse = attention_blockwise(q, k, v, lg, block_size=block_size, dropout=dropout)
    delta = xp.sum(do * out, axis=-1)
    batch = tuple(xp.broadcast_arrays(out[..., :1, :1], lse[..., None, :1],
                                      *([lg.bias[..., :1, :1]] if lg.bias is not None else []),
                                      k[..., :1, :1], v[..., :1, :1])[0].shape[:-2])

    def zeros(m, f):
        return xp.zeros((*batch, m, f), dtype=q.dtype, device=device(q))

    rows = [(i0, min(i0 + block_size, n)) for i0 in range(0, n, block_size)]
    cols = [(j0, min(j0 + block_size, s)) for j0 in range(0, s, block_size)]
    dq = [zeros(i1 - i0, d) for i0, i1 in rows]
    db = [[zeros(i1 - i0, j1 - j0) for j0, j1 in cols] for i0, i1 in rows]
    dk, dv_ = [], []
    for jb, (j0, j1) in enumerate(cols):
        dk_j, dv_j = zeros(j1 - j0, d), zeros(j1 - j0, dv)
        for ib, (i0, i1) in enumerate(rows):
            if (j0, j1) not in key_blocks(lg, s, block_size, i0, i1):
                continue
            ds, dq_i, dk_ij, dv_ij = _tile_grads(lg, q, k, v, do, delta, lse, dropout,
                                                 i0, i1, j0, j1)
            dq[ib], dk_j, dv_j, db[ib][jb] = dq[ib] + dq_i, dk_j + dk_ij, dv_j + dv_ij, ds
        dk.append(dk_j)
        dv_.append(dv_j)
    grads = {"q": xp.concat(dq, axis=-2), "k": xp.concat(dk, axis=-2),
             "v": xp.concat(dv_, axis=-2)}
    if lg.bias is not None:
        grads["bias"] = xp.concat([xp.concat(r, axis=-1) for r in db], axis=-2)
    return grads
