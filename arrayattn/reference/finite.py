r"""Non-finite keys and values reach only the rows that see them.

A key or value that holds a NaN or an infinity (an unwritten KV-cache slot, a bad gate)
must change exactly the outputs of the queries that may see it, and nothing else.  Inside
a product it cannot be kept apart: ``0 * nan`` is NaN, so a future value multiplied by a
zero weight still poisons an earlier row.  The rule every form follows is therefore

.. math::

    \text{bad}_j = \lnot\operatorname{isfinite}(k_j, v_j, \ldots), \qquad
    k_j, v_j \leftarrow 0 \text{ where bad}_j, \qquad
    o_i \leftarrow \text{NaN where } \exists j \text{ visible to } i:\ \text{bad}_j,

i.e. the bad rows are taken out *before* any arithmetic and the rows that see one are
marked NaN *after* it: a row that sees a non-finite key or value is NaN in full (as a
NaN key already makes it), every other row is exactly what it would be without that token.
Softmax forms mark the logits column instead (:func:`poisoned_logits`), so the backward
sees the same NaN rows.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

__all__ = ["nonfinite_rows", "nonfinite_over", "nan_over", "drop_nonfinite", "seen_by_prefix",
           "poison_rows", "poisoned_logits", "poison_prefix_grads"]


def nonfinite_rows(*arrays):
    """``(..., s)`` bool: token ``j`` holds a NaN or an infinity in any of ``arrays``
    (each ``(..., s, c)``; the results broadcast)."""
    bad = None
    for x in arrays:
        row = nonfinite_over(x, (-1,))
        bad = row if bad is None else (bad | row)
    return bad


def nonfinite_over(x, axis: tuple):
    """bool: ``x`` holds a NaN or an infinity along the axes ``axis`` (``False`` where
    they are empty)."""
    # ~all(isfinite(x)) as one float reduction: the largest |x| is infinite, or NaN (max
    # propagates NaN), exactly when a non-finite is there.  A boolean reduction, or a
    # sum of NaNs selected by isfinite, is a costly XLA CPU kernel to compile.
    xp = array_namespace(x)
    return _flag_of_max(xp, xp.abs(x), axis, lambda m: ~xp.isfinite(m))


def nan_over(x, axis: tuple):
    """bool: ``x`` holds a NaN along the axes ``axis`` (infinities allowed; ``False``
    where the axes are empty): ``any(isnan(x))`` as one float reduction."""
    xp = array_namespace(x)
    return _flag_of_max(xp, x, axis, xp.isnan)


def _flag_of_max(xp, x, axis: tuple, flag):
    axes = {a % x.ndim for a in axis}
    if any(x.shape[a] == 0 for a in axes):
        return xp.zeros(tuple(m for a, m in enumerate(x.shape) if a not in axes),
                        dtype=xp.bool, device=device(x))
    return flag(xp.max(x, axis=tuple(axes)))


def drop_nonfinite(bad, *arrays):
    """Each ``x (..., s, c)`` with the rows where ``bad (..., s)`` set to 0 (``where``,
    not a product)."""
    xp = array_namespace(bad, *arrays)
    out = tuple(xp.where(bad[..., None], 0.0, x) for x in arrays)
    return out if len(out) != 1 else out[0]


#: Integers up to this are exact in float32.
_FLOAT32_EXACT = 2 ** 24


def seen_by_prefix(bad, n: int):
    """``(..., n)`` bool: query ``i`` sees a bad key under end-aligned causal masking
    (``j <= i + s - n``, ``s = bad.shape[-1]``): the first bad key is one it sees."""
    xp = array_namespace(bad)
    s = bad.shape[-1]
    if s == 0:
        return xp.zeros((*bad.shape[:-1], n), dtype=xp.bool, device=device(bad))
    # positions as float32 (exact to 2^24): XLA's CPU backend sends a float reduction to
    # a library and lowers an integer one to a tree of kernels that deepens with s
    dtype = xp.float32 if max(s, n) <= _FLOAT32_EXACT else None
    first = xp.min(xp.where(bad, xp.arange(s, dtype=dtype, device=device(bad)), s),
                   axis=-1, keepdims=True)            # s where none (one reduction)
    return first <= xp.arange(n, dtype=dtype, device=device(bad)) + (s - n)


def poison_rows(out, seen):
    """``out (..., n, c)`` with NaN in the rows where ``seen (..., n)``."""
    xp = array_namespace(out, seen)
    return xp.where(seen[..., None], xp.nan, out)


def poisoned_logits(x, bad):
    """Logits ``x (..., n, s)`` with NaN in the columns of bad keys: applied before the
    visibility mask, so exactly the rows that see a bad key become NaN (forward and
    backward), and the bad key itself has been zeroed."""
    xp = array_namespace(x, bad)
    return xp.where(bad[..., None, :], xp.nan, x)


def poison_prefix_grads(grads: dict, bad, n: int, *, queries=("q",),
                        per_token=("beta", "gate")) -> dict:
    """The gradients of a causal call whose tokens ``bad (..., s)`` were dropped, as
    autodiff of the NaN rows gives them: a query-side gradient ``(..., n, c)`` NaN in the
    rows that see a bad token; every other gradient NaN in full for a batch element that
    has one (the last row sees every key, and it is NaN).  Earlier rows keep theirs.
    Gradients are ``(*batch, ., .)`` but those named in ``per_token``, ``(*batch, n)``;
    a batch broadcast in the argument (shared over heads, say) is NaN where any of the
    elements it serves has a bad token."""
    xp = array_namespace(bad)
    seen, anywhere = seen_by_prefix(bad, n), xp.any(bad, axis=-1)
    out = {}
    for name, g in grads.items():
        if name in queries:
            out[name] = poison_rows(g, seen)
            continue
        event = 1 if name in per_token else 2
        flag = _flag_for(anywhere, tuple(g.shape[:g.ndim - event]))
        out[name] = xp.where(xp.reshape(flag, (*flag.shape, *(1,) * event)), xp.nan, g)
    return out


def _flag_for(anywhere, batch: tuple):
    """``anywhere (*B)`` reduced (any) onto a gradient's batch shape ``batch``: leading
    axes it lacks and axes where it has size 1."""
    xp = array_namespace(anywhere)
    lead = anywhere.ndim - len(batch)
    if lead > 0:
        anywhere = xp.any(anywhere, axis=tuple(range(lead)))
    elif lead < 0:
        anywhere = xp.reshape(anywhere, (*(1,) * -lead, *anywhere.shape))
    axes = tuple(i for i, (a, b) in enumerate(zip(anywhere.shape, batch)) if b == 1 != a)
    return xp.any(anywhere, axis=axes, keepdims=True) if axes else anywhere
