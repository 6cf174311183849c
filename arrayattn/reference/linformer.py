r"""Reference form: Linformer (Wang et al. 2020, "Linformer: Self-Attention with Linear
Complexity", eq. 7).

.. math:: O = \operatorname{softmax}\big(Q (E K)^\top \cdot \mathrm{scale}\big)\,(F V),
          \qquad E, F \in \mathbb{R}^{m \times s}
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .masks import masked_softmax, zero_masked_keys

__all__ = ["linformer_attention"]


def linformer_attention(q, k, v, e, f, *, scale: float, key_mask=None):
    r"""``softmax(scale Q (E K)ᵀ) (F V)``: keys and values compressed along the sequence
    to ``m`` rows by ``E, F (..., m, s)``; ``O(n m d + m s d)``, never ``n x s``.

    Padded keys (``key_mask`` False) have their key and value rows set to 0 before the
    projection: after compression a position is no longer an entry of the softmax, so
    this is all the masking there can be.
    """
    xp = array_namespace(q, k, v, e, f)
    k, v = zero_masked_keys(key_mask, k, v)
    compressed_k = e @ k                                        # (..., m, d)
    compressed_v = f @ v                                        # (..., m, dv)
    return masked_softmax((q @ xp.matrix_transpose(compressed_k)) * scale) @ compressed_v
