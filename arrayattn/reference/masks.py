"""The pieces every softmax-based reference form shares: masks and the masked softmax.

Array API only; no host reads (everything traces under ``jax.jit``); no in-place updates.
"""
from __future__ import annotations

from array_api_compat import array_namespace

from .finite import drop_nonfinite, nonfinite_rows, poisoned_logits

__all__ = ["causal_mask", "allowed_mask", "masked_softmax", "zero_masked_keys", "attend",
           "softmax_lse", "log_total", "visible_rows", "partial_softmax", "merge_partials",
           "max_shift"]


def causal_mask(xp, n: int, s: int, *, device, shift: int | None = None, row0: int = 0,
                col0: int = 0):
    """Boolean ``(n, s)``: query ``i`` sees key ``j <= i + (s - n)`` (end-aligned, as
    FlashAttention-2).  ``row0``/``col0`` place the tile inside a larger problem whose
    shift ``S - N`` is ``shift``."""
    shift = s - n if shift is None else shift
    rows = xp.arange(n, device=device)[:, None] + row0
    cols = xp.arange(s, device=device)[None, :] + col0
    return cols <= rows + shift


def allowed_mask(xp, n: int, s: int, *, device, causal: bool = False, key_mask=None,
                 mask=None):
    """The AND of the causal pattern, ``key_mask (..., s)`` and ``mask (..., n, s)``
    (``None`` when nothing is masked)."""
    allowed = causal_mask(xp, n, s, device=device) if causal else None
    for extra in (None if key_mask is None else key_mask[..., None, :], mask):
        if extra is not None:
            allowed = extra if allowed is None else (allowed & extra)
    return allowed


def max_shift(m):
    """The stabiliser subtracted before ``exp``: a row max ``m`` itself, and 0 for a row
    with no entry (``m = -inf``: ``e^{-inf - 0} = 0``, where ``-inf - -inf`` is NaN)."""
    xp = array_namespace(m)
    return xp.where(m == -xp.inf, 0.0, m)


def masked_softmax(scores, allowed=None, *, axis: int = -1):
    """``softmax(scores)`` along ``axis`` over the ``allowed`` entries, max-shifted.

    A disallowed entry gets weight 0; a row with no allowed entry is all zeros (its max
    is ``-inf``; it is shifted by 0 instead, which would otherwise give NaN).
    """
    xp = array_namespace(scores)
    if allowed is not None:
        scores = xp.where(allowed, scores, -xp.inf)
    m = xp.max(scores, axis=axis, keepdims=True)
    m = max_shift(m)
    p = xp.exp(scores - m)
    total = xp.sum(p, axis=axis, keepdims=True)
    return p / xp.where(total > 0, total, 1.0)


def zero_masked_keys(key_mask, *arrays):
    """Each ``x (..., s, c)`` of ``arrays`` with the rows of masked keys set to 0.

    A masked key is in neither numerator nor denominator, so its row must not matter --
    but ``0 * nan`` is NaN: padding from ``torch.empty`` can hold anything, so masked rows
    are replaced (``where``), not multiplied away.
    """
    if key_mask is None:
        return arrays if len(arrays) != 1 else arrays[0]
    xp = array_namespace(*arrays)
    out = tuple(xp.where(key_mask[..., None], x, 0.0) for x in arrays)
    return out if len(out) != 1 else out[0]


def softmax_lse(x, allowed=None):
    """``(softmax(x), logsumexp(x))`` along the last axis over the ``allowed`` entries,
    max-shifted; a row with no allowed entry has zero weights and ``L = -inf``."""
    xp = array_namespace(x)
    if allowed is not None:
        x = xp.where(allowed, x, -xp.inf)
    m = xp.max(x, axis=-1, keepdims=True)
    m = max_shift(m)
    e = xp.exp(x - m)
    total = xp.sum(e, axis=-1, keepdims=True)
    return e / xp.where(total > 0, total, 1.0), log_total(total, m)[..., 0]


def partial_softmax(x, allowed=None):
    """``(m, l, e)`` of a tile of logits: the row max ``m (..., 1)`` (``-inf`` for a row
    with no allowed entry), ``l = rowsum e^{x - m}`` and ``e = e^{x - m}`` (0 where not
    allowed; a row with no allowed entry is shifted by 0, so no ``-inf - -inf``)."""
    xp = array_namespace(x)
    if allowed is not None:
        x = xp.where(allowed, x, -xp.inf)
    m = xp.max(x, axis=-1, keepdims=True)
    e = xp.exp(x - max_shift(m))
    return m, xp.sum(e, axis=-1, keepdims=True), e


def merge_partials(a, b):
    r"""Two partial softmax sums over disjoint key sets merged exactly -- the online
    log-sum-exp (Milakov & Gimelshein 2018) of blockwise attention, of merged sparse
    parts and of LSH's hash rounds.  Each part is ``(m, l, acc)``: a row max ``m (..., 1)``,
    ``l = sum e^{x - m}`` ``(..., 1)`` and ``acc = sum e^{x - m} v`` ``(..., dv)``; the
    sum is taken relative to the larger max, ``c = e^{m_a - m'}``:
    ``(m', l_a c_a + l_b c_b, acc_a c_a + acc_b c_b)``.  An empty part (``m = -inf``,
    ``l = 0``) has weight 0 exactly, so it never changes the other bit for bit.  The
    softmax output is ``acc / l`` and its log-sum-exp ``log_total(l, m)``."""
    (ma, la, acc_a), (mb, lb, acc_b) = a, b
    xp = array_namespace(la, lb)
    m = xp.maximum(ma, mb)
    shift = max_shift(m)
    ca, cb = xp.exp(ma - shift), xp.exp(mb - shift)
    return m, la * ca + lb * cb, acc_a * ca + acc_b * cb


def log_total(total, m):
    """``log(total) + m``, the log-sum-exp of a row max-shifted by ``m``: ``-inf`` for an
    empty row (``total = 0``), NaN for a row that saw a NaN (never taken for empty)."""
    xp = array_namespace(total, m)
    return xp.where(total == 0, -xp.inf, xp.log(xp.where(total > 0, total, 1.0)) + m)


def visible_rows(v, allowed):
    """``v`` with the rows no query of the tile sees set to 0 (``0 * nan`` guard)."""
    if allowed is None:
        return v
    xp = array_namespace(v)
    return xp.where(xp.any(allowed, axis=-2)[..., None], v, 0.0)


def attend(scores, v, allowed=None):
    """``(softmax(scores) @ v, lse)`` over the ``allowed`` keys: the output and the
    log-sum-exp of the allowed scores ``(..., n)`` (``-inf`` for a row with no allowed
    key, whose output is 0).  The log-sum-exps let partial attentions over disjoint key
    sets be merged exactly (the online-softmax merge).  A value row that is not finite
    makes NaN exactly the rows that see it (:mod:`arrayattn.reference.finite`)."""
    bad = nonfinite_rows(v)
    p, lse = softmax_lse(poisoned_logits(scores, bad), allowed)
    return p @ visible_rows(drop_nonfinite(bad, v), allowed), lse
