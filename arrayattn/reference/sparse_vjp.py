r"""Backward of sparse attention: the dense definition, and the gathered tiles.

Sparse attention is exact attention with the pattern as a mask, so its backward is
FlashAttention-2's (:mod:`arrayattn.reference.exact_vjp`) restricted to the pattern.
With :math:`S = Q K^\top \mathrm{scale} + B` on the allowed pairs,
:math:`L = \operatorname{logsumexp}_j S_{ij}`, :math:`P = e^{S - L}` and :math:`O = P V`:

.. math::

    D_i = \textstyle\sum_c dO_{ic} O_{ic}, \qquad
    dS_{ij} = P_{ij}\,(dO_i \cdot V_j - D_i), \qquad dB = dS,

    dQ_i = \mathrm{scale} \sum_{j \in \mathcal{P}(i)} dS_{ij} K_j, \qquad
    dK_j = \mathrm{scale} \sum_{i:\, j \in \mathcal{P}(i)} dS_{ij} Q_i, \qquad
    dV_j = \sum_{i:\, j \in \mathcal{P}(i)} P_{ij}\, dO_i,

zero off the pattern ``P(i)``.  The dense form (:func:`sparse_attention_vjp`) is
:func:`~arrayattn.reference.exact_vjp.attention_vjp` with the ``(n, s)`` mask.  The
gathered form computes the same sums over the forward's gathered tiles, in two passes
(as the Triton fused-attention backward does), so that no result is ever scattered:

* **query-major** (:func:`gathered_attention_dq`): each group of query blocks gathers
  its key blocks (the forward's plan) and sums ``dQ_i`` over them -- a row of ``dQ``
  belongs to one query block;
* **key-major** (:func:`gathered_attention_dkv`): each group of key blocks gathers the
  query blocks that reach it (the plan of the transposed block support) with their
  ``dO``, ``L`` and ``D``, and sums ``dK_j``, ``dV_j`` over them.

Both recompute ``P = exp(S - L)`` tile by tile from the saved log-sum-exp
(:func:`~arrayattn.reference.exact_vjp.tile_backward`): memory ``O(n * keys gathered)``
like the forward, never ``n x s``.  Queries arrive pre-scaled (``Q' = scale Q``, as the
forward's gathered form takes them): the tiles give ``dQ'`` (the caller multiplies by
``scale``) and ``dK = dS^T Q'``.
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .exact_vjp import attention_vjp, tile_backward
from .indexing import take_in_bounds
from .logits import Logits

__all__ = ["sparse_attention_vjp", "gathered_attention_dq", "gathered_attention_dkv",
           "take_blocks"]


def sparse_attention_vjp(q, k, v, do, allowed, *, scale, bias=None):
    """``{"q", "k", "v"[, "bias"]}`` of the dense definition
    :func:`~arrayattn.reference.sparse.sparse_attention` over the ``allowed (..., n, s)``
    pairs (memory ``O(n s)``); ``dB`` has the broadcast shape ``(..., n, s)``."""
    grads = attention_vjp(q, k, v, do, Logits(scale=scale, mask=allowed, bias=bias))
    if bias is None:
        del grads["bias"]
    return grads


def take_blocks(x, idx):
    """The blocks ``idx (G, R)`` of ``x (..., K, b, c)``, side by side:
    ``(..., G, R b, c)`` (the gather of the forward's
    :func:`~arrayattn.reference.sparse.gathered_attention`)."""
    xp = array_namespace(x, idx)
    g, r = idx.shape
    flat = xp.reshape(idx, (g * r,))
    return xp.reshape(take_in_bounds(x, flat, axis=x.ndim - 3),
                      (*x.shape[:-3], g, r * x.shape[-2], x.shape[-1]))


def gathered_attention_dq(q, k, v, do, lse, delta, idx, allowed, bias=None):
    """Query-major pass: query blocks ``q (..., G, b, d)`` (pre-scaled) with their ``do
    (..., G, b, dv)``, ``lse``, ``delta (..., G, b)`` and the key blocks ``idx (G, R)`` of
    ``k (..., K, b, d)``, ``v (..., K, b, dv)``, over the ``allowed (..., G, b, R b)``
    slots (``bias`` of that shape added): ``(dQ' (..., G, b, d), dS (..., G, b, R b))``,
    ``dQ' = dS K_g`` (``dS`` is the bias's cotangent on the tiles)."""
    xp = array_namespace(q, k, v, do)
    kc, vc = take_blocks(k, idx), take_blocks(v, idx)
    tile = (q.shape[-2], kc.shape[-2])             # the mask may come as (G, 1, R b)
    allowed = xp.broadcast_to(allowed, (*allowed.shape[:-2], *tile))
    lg = Logits(scale=1.0, mask=allowed, bias=bias)
    _, ds, dsr, kj, _ = tile_backward(lg, q, kc, vc, do, delta, lse, None, 0, tile[0],
                                      0, tile[1])
    return dsr @ kj, ds


def gathered_attention_dkv(k, v, q, do, lse, delta, idx, allowed, bias=None):
    """Key-major pass: key blocks ``k (..., G, b, d)``, ``v (..., G, b, dv)`` and the
    query blocks ``idx (G, R)`` that reach them, of ``q (..., Q, b, d)`` (pre-scaled),
    ``do (..., Q, b, dv)``, ``lse``, ``delta (..., Q, b)``, over the ``allowed (..., G,
    R b, b)`` slots (rows: the gathered queries; ``bias`` of that shape added):
    ``(dK (..., G, b, d), dV (..., G, b, dv))``, ``dK = dS^T Q'_g``, ``dV = P^T dO_g``."""
    xp = array_namespace(k, v, q, do)
    qc, doc = take_blocks(q, idx), take_blocks(do, idx)
    lc = take_blocks(lse[..., None], idx)[..., 0]
    dc = take_blocks(delta[..., None], idx)[..., 0]
    lg = Logits(scale=1.0, mask=allowed, bias=bias)
    p, _, dsr, _, qi = tile_backward(lg, qc, k, v, doc, dc, lc, None,
                                     0, qc.shape[-2], 0, k.shape[-2])
    return xp.matrix_transpose(dsr) @ qi, xp.matrix_transpose(p) @ doc
