r"""Reference forms: softmax attention restricted to a sparse pattern.

.. math:: O = \operatorname{softmax}\!\left(Q K^\top \cdot \mathrm{scale} + B + M\right) V,
          \qquad M_{ij} = 0 \text{ if } (i, j) \in \text{pattern}, -\infty \text{ else}

Child et al. 2019 (Sparse Transformers), Beltagy et al. 2020 (Longformer), Zaheer et al.
2020 (BigBird).  A pattern is host data (:class:`arrayattn.BlockLayout`, built with NumPy
like every random object of arrayattn); these forms take it as device arrays: the dense
``(n, s)`` mask, or, for the gathered form, which key blocks each query block reaches and
the mask on those tiles.  The gathered form computes ``O(n * keys gathered)`` scores,
never ``n * s``, and returns the log-sum-exps that merge partial softmaxes exactly.
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .indexing import take_in_bounds
from .masks import attend, log_total, merge_partials

__all__ = ["sparse_attention", "gathered_attention", "merge_attention"]


def sparse_attention(q, k, v, allowed, *, scale, bias=None):
    """The definition, dense: ``softmax(Q K^T scale + B)`` over the ``allowed (..., n, s)``
    pairs, times ``V``; a query with no allowed key returns zeros.  Memory ``O(n s)``."""
    xp = array_namespace(q, k, v)
    scores = (q * scale) @ xp.matrix_transpose(k)
    return attend(scores if bias is None else scores + bias, v, allowed)[0]


def gathered_attention(q, k, v, idx, allowed, bias=None):
    """Block-sparse: query blocks ``q (..., G, b, d)`` (already scaled) attend to the key
    blocks ``idx (G, R)`` of ``k (..., K, b, d)`` and ``v (..., K, b, dv)``, over the
    ``allowed (..., G, b, R b)`` slots of those tiles (``bias`` of the same shape is
    added).  Returns ``(O (..., G, b, dv), lse (..., G, b))``."""
    xp = array_namespace(q, k, v)
    g, r = idx.shape
    flat = xp.reshape(idx, (g * r,))
    kc = xp.reshape(take_in_bounds(k, flat, axis=k.ndim - 3),
                    (*k.shape[:-3], g, r * k.shape[-2], -1))
    vc = xp.reshape(take_in_bounds(v, flat, axis=v.ndim - 3),
                    (*v.shape[:-3], g, r * v.shape[-2], -1))
    scores = q @ xp.matrix_transpose(kc)
    return attend(scores if bias is None else scores + bias, vc, allowed)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """Two softmax attentions over disjoint key sets merged by their log-sum-exps:
    ``O = (e^{lse_a} O_a + e^{lse_b} O_b) / (e^{lse_a} + e^{lse_b})``
    (:func:`~arrayattn.reference.masks.merge_partials` of the parts ``(lse, 1, O)``); an
    empty part (``lse = -inf``) has weight 0 exactly.  Returns ``(O, lse)``."""
    xp = array_namespace(out_a, out_b)
    one = xp.ones_like(lse_a[..., None])
    m, total, acc = merge_partials((lse_a[..., None], one, out_a),
                                   (lse_b[..., None], one, out_b))
    return acc / xp.where(total > 0, total, 1.0), log_total(total, m)[..., 0]
