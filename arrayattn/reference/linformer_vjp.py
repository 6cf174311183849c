r"""Backward of Linformer (the vector-Jacobian product).

The forward (:mod:`arrayattn.reference.linformer`) is exact softmax attention on the
compressed keys and values, with :math:`K_0, V_0` the keys and values whose masked rows
are set to 0:

.. math::

    \tilde K = E K_0, \quad \tilde V = F V_0, \quad
    O = \operatorname{softmax}(\text{scale}\; Q \tilde K^\top)\, \tilde V.

Exact attention's backward (:func:`~arrayattn.reference.attention_vjp`, FlashAttention-2's
equations on the ``n x m`` compressed problem) gives :math:`dQ, d\tilde K, d\tilde V`;
the chain rule through the projections then gives

.. math::

    dK = M \circ (E^\top d\tilde K), \quad dV = M \circ (F^\top d\tilde V), \quad
    dE = d\tilde K\, K_0^\top, \quad dF = d\tilde V\, V_0^\top,

with :math:`M` the key mask on the rows (a masked key gets exactly 0, whatever it
holds: it was replaced by 0 before the projection, with ``where``).  With ``F = E`` (the
shared key-value projection) the cotangent of ``E`` is :math:`dE + dF`.

Array API only, no host reads, no in-place updates.
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .exact_vjp import attention_vjp
from .logits import Logits
from .masks import zero_masked_keys

__all__ = ["linformer_attention_vjp"]


def linformer_attention_vjp(q, k, v, e, f, do, *, scale: float, key_mask=None,
                            projections: bool = True):
    """``{"q": dQ, "k": dK, "v": dV, "e": dE, "f": dF}`` of
    :func:`~arrayattn.reference.linformer_attention` (broadcast batch shape), by the
    equations of the module docstring; ``projections=False`` leaves out ``dE``, ``dF``
    (projections drawn from a seed are constants).  Memory ``O(n m + m s)`` per head."""
    xp = array_namespace(q, k, v, e, f, do)
    k0, v0 = zero_masked_keys(key_mask, k, v)
    compressed_k, compressed_v = e @ k0, f @ v0                     # K~ = E K0, V~ = F V0
    g = attention_vjp(q, compressed_k, compressed_v, do, Logits(scale=scale))
    dk, dv = zero_masked_keys(key_mask, xp.matrix_transpose(e) @ g["k"],
                              xp.matrix_transpose(f) @ g["v"])
    grads = {"q": g["q"], "k": dk, "v": dv}
    if projections:
        grads["e"] = g["k"] @ xp.matrix_transpose(k0)                 # dE = dK~ K0^T
        grads["f"] = g["v"] @ xp.matrix_transpose(v0)                 # dF = dV~ V0^T
    return grads
