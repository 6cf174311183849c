r"""Reference form: Luna, linear unified nested attention (Ma et al. 2021, NeurIPS,
section 3.1): pack, then unpack.

.. math::

    P' = \operatorname{softmax}(P K^\top \cdot \mathrm{scale} + M)\, V, \qquad
    O = \operatorname{softmax}\big(Q (P' W_K)^\top \cdot \mathrm{scale}\big)\, P' W_V
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .masks import masked_softmax, zero_masked_keys

__all__ = ["luna_attention"]


def luna_attention(q, k, v, p, *, scale: float, key_mask=None, unpack_key_proj=None,
                   unpack_value_proj=None):
    r"""Luna's pack-and-unpack attention; returns ``(O, P')``.

    Pack: the ``l`` tokens of ``p (..., l, d)`` attend to the real keys, ``P' (..., l,
    dv)``.  Unpack: the queries attend to the ``l`` packed tokens, keys ``P' W_K`` and
    values ``P' W_V`` (``W = None``: the identity).  Both exact softmax attention,
    ``O((n + s) l d)``.
    """
    xp = array_namespace(q, k, v, p)
    k, v = zero_masked_keys(key_mask, k, v)
    keep = None if key_mask is None else key_mask[..., None, :]
    packed = masked_softmax((p @ xp.matrix_transpose(k)) * scale, keep) @ v
    keys = packed if unpack_key_proj is None else packed @ unpack_key_proj
    values = packed if unpack_value_proj is None else packed @ unpack_value_proj
    return masked_softmax((q @ xp.matrix_transpose(keys)) * scale) @ values, packed
