r"""Reference form: Poolingformer's two-level attention (Zhang et al. 2021).

.. math::

    O = \underbrace{\operatorname{softmax}(Q K^\top s_1 + M_1) V}_{\text{level 1: window}}
      + \underbrace{\operatorname{softmax}(Q_2 \bar K^\top s_2 + M_2) \bar V}_{\text{level 2:
        pooled}},
    \qquad \bar K_t = \operatorname{Pool}_{j \in P_t} K_{2, j}

Each pooled key ``t`` stands for an interval ``P_t`` of positions (``inside (m, s)``); it
is the mean (or the element-wise max) of the real keys in it, and a pooled key with no
real key is masked.  ``allowed1 (..., n, s)`` and ``allowed2 (..., n, m)`` are the two
windows (built on the host by :func:`arrayattn.local_layout` and a pooled
:class:`arrayattn.BlockLayout`).
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .finite import drop_nonfinite, nonfinite_rows, poison_rows
from .sparse import sparse_attention

__all__ = ["pool_intervals", "pooling_attention"]


def pool_intervals(x, keep, *, pool="mean"):
    """``x (..., s, c)`` pooled over the intervals ``keep (..., m, s)`` (boolean: the real
    keys of each interval): ``(..., m, c)``; an empty interval pools to 0, an interval
    holding a non-finite row to NaN (and no other interval: see
    :mod:`arrayattn.reference.finite`)."""
    xp = array_namespace(x, keep)
    count = xp.sum(xp.astype(keep, x.dtype), axis=-1)[..., None]          # (..., m, 1)
    if pool == "mean":
        bad = nonfinite_rows(x)
        total = xp.astype(keep, x.dtype) @ drop_nonfinite(bad, x)
        return poison_rows(total / xp.where(count > 0, count, 1.0),
                           xp.any(keep & bad[..., None, :], axis=-1))
    top = xp.max(xp.where(keep[..., None], x[..., None, :, :], -xp.inf), axis=-2)
    return xp.where(count > 0, top, 0.0)


def pooling_attention(q, k, v, q2, k2, v2, allowed1, inside, allowed2, *, scale, scale2,
                      key_mask=None, pool="mean"):
    """``y + z``: window attention plus attention to the pooled keys and values."""
    if key_mask is not None:
        allowed1, inside = allowed1 & key_mask[..., None, :], inside & key_mask[..., None, :]
    y = sparse_attention(q, k, v, allowed1, scale=scale)
    kbar, vbar = pool_intervals(k2, inside, pool=pool), pool_intervals(v2, inside, pool=pool)
    real = array_namespace(inside).any(inside, axis=-1)[..., None, :]         # (..., 1, m)
    return y + sparse_attention(q2, kbar, vbar, allowed2 & real, scale=scale2)
