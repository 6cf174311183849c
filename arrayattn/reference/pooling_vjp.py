r"""Backward of Poolingformer's two-level attention (Zhang et al. 2021).

The output is the sum of two separately normalised sparse attentions, so ``dO`` flows
into both unchanged: level 1 (the window over ``Q, K, V``) and level 2 (``Q_2`` over the
pooled keys and values ``\bar K, \bar V``) each have the backward of sparse attention
(:mod:`arrayattn.reference.sparse_vjp`), and the pooled rows pass their cotangents back
to the positions they pool:

.. math::

    \text{mean:}\quad dK_{2,j} = \sum_{t:\ j \in P_t} \frac{\mathbb{1}[j \text{ real}]}
        {|P_t|_{\text{real}}}\, d\bar K_t, \qquad
    \text{max:}\quad dK_{2,jc} = \sum_{t:\ j \in P_t}
        \frac{\mathbb{1}[K_{2,jc} = \bar K_{tc},\ j \text{ real}]}{\#\{j' \in P_t:
        K_{2,j'c} = \bar K_{tc}\}}\, d\bar K_{tc},

(the same for ``V``).  Max pooling sends each channel's cotangent to the positions that
attain the maximum, split evenly between ties -- the convention of ``torch.amax`` and of
``jax.numpy.max``, the reductions the reference form runs on those libraries.  A pooled
key with no real key is masked (``d\bar K_t`` is zero).  When ``q2``, ``k2``, ``v2`` are
not given they are ``q``, ``k``, ``v``, and the two levels' cotangents add.

:func:`pooling_attention_vjp` is the dense form (memory ``O(n s + m s c)``);
:func:`pool_windows_vjp` is the gathered pooling's adjoint, ``O(s κ c)``: each
position's cotangent is summed over the (at most ``⌈κ/ζ⌉``) windows that hold it, read
through a host-built index -- the adjoint of a gather, written as a gather.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .pooling import pool_intervals
from .sparse_vjp import sparse_attention_vjp

__all__ = ["pool_intervals_vjp", "pool_windows_vjp", "pooling_attention_vjp"]


def pool_intervals_vjp(x, keep, dbar, *, pool="mean"):
    """The cotangent of ``x (..., s, c)`` from that of ``pool_intervals(x, keep, pool=)``,
    ``dbar (..., m, c)`` (``keep (..., m, s)``: the real keys of each interval)."""
    xp = array_namespace(x, keep, dbar)
    count = xp.sum(xp.astype(keep, x.dtype), axis=-1)[..., None]          # (..., m, 1)
    if pool == "mean":
        return xp.matrix_transpose(xp.astype(keep, x.dtype)) @ (
            dbar / xp.where(count > 0, count, 1.0))
    top = pool_intervals(x, keep, pool="max")                              # (..., m, c)
    hit = keep[..., None] & (x[..., None, :, :] == top[..., :, None, :])    # (..., m, s, c)
    ties = xp.sum(xp.astype(hit, x.dtype), axis=-2, keepdims=True)
    share = xp.where(hit, dbar[..., :, None, :] / xp.where(ties > 0, ties, 1.0), 0.0)
    return xp.sum(share, axis=-3)


def pool_windows_vjp(windows, keep, dbar, spread, *, pool="mean"):
    """The gathered pooling's adjoint: ``windows (..., m, κ, c)`` the rows of each
    interval (as the forward gathers them), ``keep (..., m, κ, 1)`` which are real keys,
    ``dbar (..., m, c)`` the pooled rows' cotangent, ``spread (s, u)`` the flat window
    slots ``t κ + o`` holding each position (``m κ``: none).  Returns ``(..., s, c)``."""
    xp = array_namespace(windows, keep, dbar)
    m, kappa, c = windows.shape[-3:]
    count = xp.sum(xp.astype(keep, windows.dtype), axis=-2, keepdims=True)   # (..., m, 1, 1)
    if pool == "mean":
        share = xp.where(keep, dbar[..., None, :] / xp.where(count > 0, count, 1.0), 0.0)
    else:
        top = xp.max(xp.where(keep, windows, -xp.inf), axis=-2, keepdims=True)
        hit = keep & (windows == top)
        ties = xp.sum(xp.astype(hit, windows.dtype), axis=-2, keepdims=True)
        share = xp.where(hit, dbar[..., None, :] / xp.where(ties > 0, ties, 1.0), 0.0)
    flat = xp.reshape(share, (*share.shape[:-3], m * kappa, c))
    flat = xp.concat([flat, xp.zeros((*flat.shape[:-2], 1, c), dtype=flat.dtype,
                                     device=device(flat))], axis=-2)
    total = None
    for u in range(spread.shape[-1]):
        part = xp.take(flat, spread[:, u], axis=flat.ndim - 2)
        total = part if total is None else total + part
    return total


def pooling_attention_vjp(q, k, v, q2, k2, v2, allowed1, inside, allowed2, do, *, scale,
                          scale2, key_mask=None, pool="mean"):
    """``{"q", "k", "v", "q2", "k2", "v2"}`` of the dense form
    :func:`~arrayattn.reference.pooling.pooling_attention` (the level-2 entries are the
    cotangents of the level-2 arguments as passed, also when they are ``q, k, v``)."""
    xp = array_namespace(q, k, v, do)
    if key_mask is not None:
        allowed1, inside = allowed1 & key_mask[..., None, :], inside & key_mask[..., None, :]
    g1 = sparse_attention_vjp(q, k, v, do, allowed1, scale=scale)
    kbar, vbar = pool_intervals(k2, inside, pool=pool), pool_intervals(v2, inside, pool=pool)
    real = xp.any(inside, axis=-1)[..., None, :]                          # (..., 1, m)
    g2 = sparse_attention_vjp(q2, kbar, vbar, do, allowed2 & real, scale=scale2)
    return {**g1, "q2": g2["q"], "k2": pool_intervals_vjp(k2, inside, g2["k"], pool=pool),
            "v2": pool_intervals_vjp(v2, inside, g2["v"], pool=pool)}
