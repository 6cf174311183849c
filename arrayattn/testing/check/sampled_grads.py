r"""The sampled judge's gradients: ``dq`` on sampled query rows, ``dk`` and ``dv`` on
sampled key columns, each exact in float64 for the entries judged.

``dq_i = scale sum_j P_ij (dP_ij - D_i) k_j`` needs only row ``i`` (its query, every key,
its ``do_i``): the row sub-problem of the forward's sampled judge
(:func:`~arrayattn.testing.check.sampling.row_problem`) with the ``do`` rows has exactly
the full problem's ``dq`` rows.

``dk_j`` and ``dv_j`` need the whole column ``j`` of ``P`` and every row's
``D_i = do_i . o_i``: every row's log-sum-exp and output.  The column sub-problem keeps
every query and the sampled keys ``C``, plus one *sink* key that stands for the rest of
each row: its key is 0, its logit is the rest's log-sum-exp through a bias
(``log sum_{j not in C} exp x_ij``, so each row's softmax over ``C`` and the sink is the
full row's: same ``P_ij`` on ``C``, same lse), and its value is a new unit value
dimension ``e`` whose cotangent is ``c_i = do_i . o^rest_i`` (the rest's normalised
output), so that ``D'_i = do'_i . o'_i = do_i . o_i``.  Then

.. math::

    dv'_j = \sum_i P_{ij}\, do'_i, \qquad
    dk'_j = \mathrm{scale} \sum_i P_{ij}\,(do_i\cdot v_j - D_i)\, q_i

are the full problem's ``dv_j`` (its first ``dv`` entries) and ``dk_j`` for ``j in C``.
The referee judges only those entries (``compare_grads(select=...)``); its plain
evaluations run on the sub-problem, whose rows hold ``|C| + 1`` keys: the rounding of a
kernel's sum over the rest of a row enters only through the sink's logit, rounded once.

Cost: one float64 forward over every row and the keys not in ``C`` (in row blocks of at
most 2**24 logits: ``b h n s`` multiply-adds twice, no ``n x s`` array held), then the
referee on ``n x (|C| + 1)`` logits; the rows' ``dq`` on ``|R| x s``."""
from __future__ import annotations

import numpy as np

from .. import grads as _grads
from ..problem import to_bhnd
from .sampling import (at_indices, row_problem, sample_rows, take_rows, tile_options,
                       window_of)

__all__ = ["sample_columns", "column_problem", "judge_grads", "BLOCK_LOGITS"]

#: Logits per block of the rest's float64 forward.
BLOCK_LOGITS = 2 ** 24


def sample_columns(n: int, s: int, *, window=(None, None), seed: int = 0) -> np.ndarray:
    """The key columns judged: those :func:`~arrayattn.testing.check.sampling.sample_rows`
    takes along the keys (tile boundaries -- of 128 past 8192 keys --, the first and last,
    random columns), and the keys where the first and last query's window starts and
    ends; sorted, unique.

    Examples
    --------
    >>> cols = sample_columns(4, 1000, seed=0)
    >>> {0, 63, 64, 65, 511, 512, 999} <= set(cols.tolist()), len(cols) < 1000
    (True, True)
    """
    cols = sample_rows(s, s, seed=seed + 7, tile=64 if s <= 8192 else 128)
    left, right = window
    ends = [p for i in (0, n - 1) for p in (
        None if left is None else i + s - n - left,
        None if right is None else i + s - n + right) if p is not None]
    extra = [p + e for p in ends for e in (-1, 0, 1) if 0 <= p + e < s]
    return np.unique(np.concatenate([cols, np.asarray(extra, dtype=np.int64)]))


def _rest(prob, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every row's log-sum-exp and normalised output over the keys not in ``cols``, in
    float64, by row blocks (``-inf`` and 0 for a row that sees none of them)."""
    from ...exact.softmax import softmax_attention

    n, s = prob.q.shape[-2], prob.k.shape[-2]
    rest = np.setdiff1d(np.arange(s), cols)
    lead = prob.q.shape[:-2]
    lse = np.full((*lead, n), -np.inf)
    out = np.zeros((*lead, n, prob.v.shape[-1]))
    if len(rest) == 0:
        return lse, out
    step = max(1, BLOCK_LOGITS // max(int(np.prod(lead)) * len(rest), 1))
    k, v = prob.k[..., rest, :], prob.v[..., rest, :]
    for start in range(0, n, step):
        rows = np.arange(start, min(start + step, n))
        o, l = softmax_attention(prob.q[..., rows, :], k, v, return_lse=True,
                                 **tile_options(prob, rows, rest))
        lse[..., rows], out[..., rows, :] = l, np.nan_to_num(o)
    return lse, out


def column_problem(prob, do: np.ndarray, cols: np.ndarray) -> tuple:
    """``(q, k', v', do', options)``: the column sub-problem of the key ``cols`` of
    ``prob`` (arrayattn's softmax problem, ``(b, h, n, d)``; ``do`` ``(b, h, n, dv)``):
    the keys ``cols`` then the sink (module docstring), the values one dimension wider."""
    lse, rest = _rest(prob, cols)
    seen = np.isfinite(lse)
    k, v, q = prob.k[..., cols, :], prob.v[..., cols, :], prob.q
    zeros = np.zeros((*k.shape[:-2], 1, k.shape[-1]))
    k1 = np.concatenate([k, zeros], axis=-2)
    v1 = np.concatenate([np.concatenate([v, np.zeros((*v.shape[:-1], 1))], axis=-1),
                         np.zeros((*v.shape[:-2], 1, v.shape[-1] + 1))], axis=-2)
    v1[..., -1, -1] = 1.0
    c = np.where(seen, np.sum(do * rest, axis=-1), 0.0)
    do1 = np.concatenate([do, c[..., None]], axis=-1)
    sub = tile_options(prob, np.arange(q.shape[-2]), cols)
    full = (*lse.shape, len(cols))
    sub["mask"] = np.concatenate([np.broadcast_to(sub["mask"], full), seen[..., None]],
                                 axis=-1)
    bias = np.broadcast_to(sub.get("bias", 0.0), full)
    sub["bias"] = np.concatenate([bias, np.where(seen, lse, 0.0)[..., None]], axis=-1)
    return q, k1, v1, do1, sub


def judge_grads(call, grads: dict, x: dict, prob, rows: np.ndarray, seed: int) -> list:
    """The verdict's gradient items of a sampled case: ``dq`` on the ``rows``, ``dk`` and
    ``dv`` on :func:`sample_columns` (``grads``: the kernel's, named q, k, v, its own
    arrays in ``call.layout``)."""
    n, s = prob.q.shape[-2], prob.k.shape[-2]
    do = to_bhnd({"do": np.asarray(x["do"], dtype=np.float64)}, call.layout, ("do",))["do"]
    axis, swap = (-3, True) if call.layout == "bnhd" else (-2, False)
    items = []
    if "q" in grads:
        q, k, v, sub = row_problem(prob, rows)
        c = _grads.compare_grads({"q": take_rows(grads["q"], rows, axis, swap)}, "softmax",
                                 q, k, v, do[..., rows, :], layout="bhnd", **sub)
        items.append((f"dq ({len(rows)} of {n} rows)", at_indices(c.items["q"], rows)))
    keys = [name for name in ("k", "v") if name in grads]
    if keys:
        cols = sample_columns(n, s, window=window_of(prob.options), seed=seed)
        q, k, v, do1, sub = column_problem(prob, do, cols)
        select = {"k": (Ellipsis, slice(0, len(cols)), slice(None)),
                  "v": (Ellipsis, slice(0, len(cols)), slice(0, prob.v.shape[-1]))}
        theirs = {name: take_rows(grads[name], cols, axis, swap) for name in keys}
        c = _grads.compare_grads(theirs, "softmax", q, k, v, do1, layout="bhnd",
                                 select={name: select[name] for name in keys}, **sub)
        items += [(f"d{name} ({len(cols)} of {s} key columns)",
                   at_indices(c.items[name], cols)) for name in keys]
    return items
