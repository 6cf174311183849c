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

Cost: ``|R| / n`` of the full judge (``(1, 8, 16384, 128)``: 800 of 16384 rows).  Gradients
are judged in full: dq of a row needs only that row, but dk and dv of a key need the whole
column of ``P`` and ``dO`` (every query), so a sampled dk/dv costs the full forward anyway;
a backward case is judged whole (the cost model keeps backward cases small).  Problems the
rows cannot be sliced from (paged caches, packed sequences, ``mask_mod``/``score_mod``,
dropout, FlashAttention's causal ALiBi with its per-row lse shift) are judged whole too."""
from __future__ import annotations

import numpy as np

from .. import outputs as _outputs
from ..problem import prepare

__all__ = ["SAMPLE_ABOVE", "sample_rows", "sampled_rows", "row_problem", "judge_rows",
           "RANDOM_ROWS", "judge_case", "repro_rows"]

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


def _window(options) -> tuple:
    left, right = options.get("window") or (None, None)
    if options.get("causal"):
        right = 0 if right is None else min(right, 0)
    return left, right


def sampled_rows(case, call, x) -> np.ndarray | None:
    """The rows to judge ``call`` on, or ``None`` (judge it whole): small problems,
    backward cases and problems whose rows cannot be sliced."""
    if case.b * case.hq * case.n * case.s <= SAMPLE_ABOVE or case.opts.get("backward"):
        return None
    prob = _problem(call, x)
    if prob is None:
        return None
    n, s = prob.q.shape[-2], prob.k.shape[-2]
    rows = sample_rows(n, s, window=_window(prob.options), seed=case.seed)
    return rows if len(rows) < n else None


def _problem(call, x):
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
    (arrayattn's softmax problem, ``(b, h, n, d)``), the alignment explicit: a mask
    ``(|R|, s)`` for the window/causal, ALiBi ``-slope |i + s - n - j|`` as a bias of those
    rows (k, v repeated to the query heads: the bias is per query head)."""
    o = dict(prob.options)
    n, s = prob.q.shape[-2], prob.k.shape[-2]
    pos = (rows + s - n)[:, None]
    j = np.arange(s)[None, :]
    visible = np.ones((len(rows), s), dtype=bool)
    left, right = _window(o)
    if left is not None:
        visible &= j >= pos - left
    if right is not None:
        visible &= j <= pos + right
    sub = {key: o[key] for key in ("scale", "softcap") if o.get(key) is not None}
    mask = visible
    if o.get("mask") is not None:
        mask = np.logical_and(np.asarray(o["mask"])[..., rows, :], visible)
    sub["mask"] = mask
    bias = None if o.get("bias") is None else np.asarray(o["bias"])[..., rows, :]
    if o.get("alibi_slopes") is not None:
        slopes = np.asarray(o["alibi_slopes"], dtype=np.float64)
        dist = -np.abs(pos - j).astype(np.float64)
        alibi = slopes[..., None, None] * dist
        bias = alibi if bias is None else bias + alibi
    if bias is not None:
        sub["bias"] = bias
    k, v = prob.k, prob.v
    hq, hkv = prob.q.shape[-3], k.shape[-3]
    if hq != hkv:
        idx = np.arange(hq) // (hq // hkv)
        k, v = k[..., idx, :, :], v[..., idx, :, :]
    return prob.q[..., rows, :], k, v, sub


def judge_rows(call, conv, results: dict, x: dict, rows: np.ndarray) -> list:
    """The verdict's items on the sampled ``rows``: the output rows and the lse rows
    against the sub-problem's float64 reference (labels name how many rows were judged)."""
    prob = _problem(call, x)
    q, k, v, sub = row_problem(prob, rows)
    n = prob.q.shape[-2]
    label = f"{len(rows)} of {n} rows"
    out = _take_rows(conv.to_judge("out", results["out"]), rows,
                     -3 if call.layout == "bnhd" else -2, call.layout == "bnhd")
    items = [(f"out ({label})", _outputs.compare_to_reference(
        out, "softmax", q, k, v, layout="bhnd", **sub))]
    if results.get("lse") is not None:
        lse = _take_rows(results["lse"], rows, -1, False)
        items.append((f"lse ({label})", _outputs.compare_lse(
            lse, "softmax", q, k, v, layout="bhnd", **sub)))
    return items


def judge_case(case, call, conv, results: dict, grads: dict):
    """The verdict on one call: on sampled rows past :data:`SAMPLE_ABOVE` logits (where
    the rows can be sliced), else whole (:func:`~arrayattn.testing.check.judge.judge`)."""
    from .judge import Verdict, judge, judge_inputs

    x = judge_inputs(call)
    rows = None if grads else sampled_rows(case, call, x)
    if rows is None:
        return judge(call, conv, results, grads)
    return Verdict(judge_rows(call, conv, results, x, rows))


def _take_rows(x, rows: np.ndarray, axis: int, swap: bool):
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


def repro_rows(conv, call, case, results: dict, grads: dict):
    """The repro of a case judged on sampled rows: ``(arrays, validate's flags, rows)`` of
    the row sub-problem (q, out and lse rows, k, v, the explicit mask and bias; ``validate
    --variant softmax`` judges exactly the rows the check judged), or ``None`` for a case
    judged whole."""
    from .judge import judge_inputs

    x = judge_inputs(call)
    rows = None if grads else sampled_rows(case, call, x)
    if rows is None:
        return None
    prob = _problem(call, x)
    q, k, v, sub = row_problem(prob, rows)
    dt = _np_dtype(call.tensors["q"])
    arrays = {"q": q.astype(dt), "k": k.astype(dt), "v": v.astype(dt)}
    out = _take_rows(conv.to_judge("out", results["out"]), rows,
                     -3 if call.layout == "bnhd" else -2, call.layout == "bnhd")
    arrays["out"] = _host(out).astype(_np_dtype(out))
    if results.get("lse") is not None:
        lse = _take_rows(results["lse"], rows, -1, False)
        arrays["lse"] = _host(lse).astype(_np_dtype(lse))
    arrays["mask"] = np.asarray(sub["mask"])
    if "bias" in sub:
        arrays["bias"] = np.asarray(sub["bias"])
    flags = {"variant": "softmax"}
    options = [f"{key}={sub[key]}" for key in ("scale", "softcap") if key in sub]
    if options:
        flags["option"] = options
    return arrays, flags, rows


def _np_dtype(x):
    name = str(x.dtype).split(".")[-1]
    return np.float32 if name == "bfloat16" else np.dtype(name)


def _host(x):
    from .conventions.base import host
    return host(x)
