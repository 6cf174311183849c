"""The sampled judge of ``arrayattn check``: at large sizes the forward is judged on a sample
of query rows, exactly, in float64.

A softmax row depends on its own query and every key: slicing the problem to the rows
``R`` (q, out and lse rows), with the causal/window alignment of the full problem made
explicit as a boolean mask ``(|R|, s)`` (query ``i`` sits at position ``i + s - n`` among
its keys) and ALiBi as a bias of the same rows, gives a sub-problem whose reference rows are
the full problem's rows ``R``: each row's lse comes from its whole logit row, so the verdict
is exact for the rows judged, with the same referee, tolerance rules and report.  The rows:
every tile boundary (``64 m - 1, 64 m, 64 m + 1``), the first and last two rows, the rows a
window or causal mask starts or ends on (and their neighbours), and 32 random rows.

Cost: ``|R| / n`` of the full judge (``(1, 8, 16384, 128)``: 800 of 16384 rows).
Gradients: ``dq`` on the same rows, ``dk`` and ``dv`` on sampled key columns
(:mod:`~arrayattn.testing.check.sampled_grads`).  Problems the rows cannot be sliced from
(paged caches, packed sequences, ``mask_mod``/``score_mod``, dropout, FlashAttention's
causal ALiBi with its per-row lse shift, gradients of anything but q, k, v) are judged
whole."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import outputs as _outputs
from ..problem import prepare

__all__ = ["SAMPLE_ABOVE", "sample_rows", "sampled_rows", "row_problem", "judge_rows",
           "RANDOM_ROWS", "tile_options", "window_of", "take_rows", "at_indices",
           "sliceable_problem"]

#: Logits (``b h n s``) above which a forward case is judged on sampled rows.
SAMPLE_ABOVE = 2 ** 22
#: Random rows added to the structural ones.
RANDOM_ROWS = 32
#: The arrayattn options a row sub-problem carries (anything else: judged whole).
_SLICEABLE = {"scale", "softcap", "window", "causal", "mask", "bias", "alibi_slopes"}


def sample_rows(n: int, s: int, *, window=(None, None), seed: int = 0,
                tile: int = 64) -> np.ndarray:
    """The query rows judged: tile boundaries ``tile m - 1, tile m, tile m + 1``, the first
    and last two rows, the rows where an end-aligned window ``(left, right)`` starts
    (``i + s - n - left = 0``) or ends (``i + s - n + right = s - 1``), the first row
    with a visible key under a right bound (``i + s - n + right = 0``), each with its
    neighbours, and :data:`RANDOM_ROWS` random rows (from ``seed``); sorted, unique.

    Examples
    --------
    >>> rows = sample_rows(200, 200, seed=0)
    >>> {0, 1, 63, 64, 65, 127, 128, 129, 198, 199} <= set(rows.tolist()), len(rows) < 200
    (True, True)
    """
    marks = [0, 1, n - 2, n - 1]
    for m in range(tile, n + 1, tile):
        marks += [m - 1, m, m + 1]
    left, right = window
    off = s - n
    if left is not None:
        marks.append(left - off)
    if right is not None:
        marks += [s - 1 - right - off, -right - off]
    marks = [m + e for m in marks for e in (-1, 0, 1)] if len(marks) < 4 * n else marks
    rng = np.random.default_rng(seed + 1)
    marks += rng.integers(0, n, min(RANDOM_ROWS, n)).tolist()
    rows = np.unique(np.clip(np.asarray(marks, dtype=np.int64), 0, n - 1))
    return rows


def window_of(options) -> tuple:
    """``(left, right)``: the window of arrayattn's ``options``, ``causal`` as ``right =
    0`` (``None``: unbounded)."""
    left, right = options.get("window") or (None, None)
    if options.get("causal"):
        right = 0 if right is None else min(right, 0)
    return left, right


def sampled_rows(case, call, x) -> np.ndarray | None:
    """The rows to judge ``call`` on, or ``None`` (judge it whole): small problems and
    problems whose rows cannot be sliced."""
    if case.b * case.hq * case.n * case.s <= SAMPLE_ABOVE:
        return None
    prob = sliceable_problem(call, x)
    if prob is None:
        return None
    n, s = prob.q.shape[-2], prob.k.shape[-2]
    rows = sample_rows(n, s, window=window_of(prob.options), seed=case.seed)
    return rows if len(rows) < n else None


def sliceable_problem(call, x):
    """arrayattn's problem of ``call`` when its rows can be sliced, else None."""
    prob = prepare(None if call.profile else call.variant, x["q"], x["k"], x["v"],
                   layout=call.layout, profile=call.profile, params=call.params)
    if prob.name != "softmax" or prob.rows is not None or prob.convert is not None or \
            prob.lse_shift is not None or set(prob.options) - _SLICEABLE:
        return None
    return prob


def row_problem(prob, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                  dict]:
    """``(q rows, k, v, options)``: the sub-problem of the query ``rows`` of ``prob``
    (arrayattn's softmax problem, ``(b, h, n, d)``), the alignment explicit
    (:func:`tile_options`; k, v repeated to the query heads)."""
    k, v = prob.k, prob.v
    hq, hkv = prob.q.shape[-3], k.shape[-3]
    if hq != hkv:
        idx = np.arange(hq) // (hq // hkv)
        k, v = k[..., idx, :, :], v[..., idx, :, :]
    return prob.q[..., rows, :], k, v, tile_options(prob, rows)


def tile_options(prob, rows: np.ndarray, cols: np.ndarray | None = None) -> dict:
    """The options of the tile ``rows x cols`` (every key by default) of ``prob``, its
    alignment explicit: a mask ``(|R|, |C|)`` for the window/causal (query ``i`` sits at
    position ``i + s - n`` among its keys), ALiBi ``-slope |i + s - n - j|`` as a bias of
    those rows (per query head), the options' mask and bias sliced."""
    o = dict(prob.options)
    n, s = prob.q.shape[-2], prob.k.shape[-2]
    cols = np.arange(s) if cols is None else cols
    pos = (rows + s - n)[:, None]
    j = cols[None, :]
    mask = np.ones((len(rows), len(cols)), dtype=bool)
    left, right = window_of(o)
    if left is not None:
        mask &= j >= pos - left
    if right is not None:
        mask &= j <= pos + right
    sub = {key: o[key] for key in ("scale", "softcap") if o.get(key) is not None}
    if o.get("mask") is not None:
        mask = np.logical_and(_tile(o["mask"], rows, cols, n, s), mask)
    sub["mask"] = mask
    bias = None if o.get("bias") is None else _tile(o["bias"], rows, cols, n, s)
    if o.get("alibi_slopes") is not None:
        slopes = np.asarray(o["alibi_slopes"], dtype=np.float64)
        alibi = slopes[..., None, None] * -np.abs(pos - j).astype(np.float64)
        bias = alibi if bias is None else bias + alibi
    if bias is not None:   # per query head in full: grouped heads split the head axis
        sub["bias"] = np.broadcast_to(bias, (*prob.q.shape[:-2], len(rows), len(cols)))
    return sub


def _tile(a, rows, cols, n: int, s: int) -> np.ndarray:
    a = np.asarray(a)
    a = np.broadcast_to(a, (*a.shape[:-2], n, s)) if a.ndim >= 2 else np.broadcast_to(
        a, (n, s))
    return a[..., rows, :][..., cols]


def judge_rows(call, conv, results: dict, x: dict, rows: np.ndarray) -> list:
    """The verdict's items on the sampled ``rows``: the output rows and the lse rows
    against the sub-problem's float64 reference (labels name how many rows were judged)."""
    prob = sliceable_problem(call, x)
    q, k, v, sub = row_problem(prob, rows)
    n = prob.q.shape[-2]
    label = f"{len(rows)} of {n} rows"
    out = take_rows(conv.to_judge("out", results["out"]), rows,
                     -3 if call.layout == "bnhd" else -2, call.layout == "bnhd")
    items = [(f"out ({label})", at_indices(_outputs.compare_to_reference(
        out, "softmax", q, k, v, layout="bhnd", **sub), rows))]
    if results.get("lse") is not None:
        lse = take_rows(results["lse"], rows, -1, False)
        items.append((f"lse ({label})", at_indices(_outputs.compare_lse(
            lse, "softmax", q, k, v, layout="bhnd", **sub), rows)))
    return items


def at_indices(c, index: np.ndarray):
    """``c`` with its worst positions' first index (a row of the sub-problem, or a key of
    the columns') mapped back to the full problem's (``index[i]``)."""
    return replace(c, worst=[(int(index[r]) if r < len(index) else r, col)
                             for r, col in c.worst])


def take_rows(x, rows: np.ndarray, axis: int, swap: bool):
    """The ``rows`` of ``x`` along ``axis`` in the kernel's own array and dtype (the dtype
    sets the tolerance), ``(..., n, h, d)`` swapped to ``(..., h, n, d)`` with ``swap``."""
    if hasattr(x, "index_select"):                       # torch
        import torch
        y = x.index_select(x.ndim + axis, torch.as_tensor(rows, device=x.device))
        return y.transpose(-3, -2) if swap else y
    if type(x).__module__.startswith("jax"):
        import jax.numpy as jnp
        y = jnp.take(x, jnp.asarray(rows), axis=axis)
        return jnp.swapaxes(y, -3, -2) if swap else y
    y = np.take(np.asarray(x), rows, axis=axis)
    return np.swapaxes(y, -3, -2) if swap else y
