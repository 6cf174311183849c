r"""Backward of Luna's pack-and-unpack attention (the vector-Jacobian product).

The forward (:mod:`arrayattn.reference.luna`) is two exact softmax attentions, with
:math:`K_0, V_0` the keys and values whose masked rows are set to 0 and the key mask
:math:`M` in the pack step:

.. math::

    P' = \operatorname{softmax}(\text{scale}\; P K_0^\top + M)\, V_0, \quad
    K_u = P' W_K, \quad V_u = P' W_V, \quad
    O = \operatorname{softmax}(\text{scale}\; Q K_u^\top)\, V_u

(``W = I`` when a projection is not given).  Exact attention's backward
(:func:`~arrayattn.reference.attention_vjp`) is applied twice, right to left: the unpack
attention with the output cotangent :math:`dO` gives :math:`dQ, dK_u, dV_u`; then

.. math::

    dW_K = P'^\top dK_u, \quad dW_V = P'^\top dV_u, \quad
    dP' = dK_u W_K^\top + dV_u W_V^\top,

and the pack attention with the cotangent :math:`dP'` gives :math:`dP, dK, dV` (a masked
key is not visible: its ``dK``, ``dV`` are exactly 0, whatever it holds).

Array API only, no host reads, no in-place updates.
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .exact import attention
from .exact_vjp import attention_vjp
from .logits import Logits
from .masks import zero_masked_keys

__all__ = ["luna_attention_vjp"]


def luna_attention_vjp(q, k, v, p, do, *, scale: float, key_mask=None,
                       unpack_key_proj=None, unpack_value_proj=None):
    """``{"q": dQ, "k": dK, "v": dV, "p": dP[, "unpack_key_proj": dW_K]
    [, "unpack_value_proj": dW_V]}`` of :func:`~arrayattn.reference.luna_attention`'s
    output (broadcast batch shape), by the equations of the module docstring.  Memory
    ``O((n + s) l)`` per head."""
    xp = array_namespace(q, k, v, p, do)
    wk, wv = unpack_key_proj, unpack_value_proj
    k0, v0 = zero_masked_keys(key_mask, k, v)
    pack = Logits(scale=scale, key_mask=key_mask)
    packed, _ = attention(p, k0, v0, pack)                            # P' (recomputed)
    keys = packed if wk is None else packed @ wk                      # K_u = P' W_K
    values = packed if wv is None else packed @ wv                    # V_u = P' W_V
    g = attention_vjp(q, keys, values, do, Logits(scale=scale))       # unpack
    dpacked = ((g["k"] if wk is None else g["k"] @ xp.matrix_transpose(wk))
               + (g["v"] if wv is None else g["v"] @ xp.matrix_transpose(wv)))
    h = attention_vjp(p, k0, v0, dpacked, pack)                       # pack: dP, dK, dV
    dk, dv = zero_masked_keys(key_mask, h["k"], h["v"])
    grads = {"q": g["q"], "k": dk, "v": dv, "p": h["q"]}
    if wk is not None:
        grads["unpack_key_proj"] = xp.matrix_transpose(packed) @ g["k"]
    if wv is not None:
        grads["unpack_value_proj"] = xp.matrix_transpose(packed) @ g["v"]
    return grads
