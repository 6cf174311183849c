"""The sampled judge's entry points: the verdict on one call (sampled rows and key columns
past :data:`~arrayattn.testing.check.sampling.SAMPLE_ABOVE` logits, else the whole
problem) and the repro files of a sampled case.

A sampled case's repro is the row sub-problem (``FILE``: q, out, lse and -- backward --
``do`` and ``dq`` rows, k, v, the explicit mask and bias; the full problem's row numbers
in ``FILE.rows.txt``) and, when ``dk`` or ``dv`` were judged, the column sub-problem
(``FILE.cols.npz``: every query, the sampled keys then the sink, ``do'``, the kernel's
``dk`` and ``dv`` columns, ``__meta__`` ``"key_columns"``; the key numbers in
``FILE.cols.txt``).  ``arrayattn validate`` judges each exactly as the check did."""
from __future__ import annotations

import json

import numpy as np

from ..problem import to_bhnd
from ..validate_io import META
from .conventions.base import host
from .sampled_grads import column_problem, judge_grads, sample_columns
from .sampling import (judge_rows, row_problem, sampled_rows, sliceable_problem, take_rows,
                       window_of)

__all__ = ["judge_case", "repro_rows", "write_columns"]


def _sampled(case, call, conv, grads: dict):
    """``(rows, q k v do as judged, the kernel's gradients by argument)``; rows ``None``
    when the case is judged whole (small, not sliceable, or gradients of anything but
    q, k, v)."""
    from .judge import judge_inputs

    x = judge_inputs(call)
    rows = sampled_rows(case, call, x)
    if rows is None or {call.rename.get(k, k) for k in grads} - {"q", "k", "v"}:
        return None, x, {}
    return rows, x, {call.rename.get(k, k): conv.to_judge(k, g) for k, g in grads.items()}


def judge_case(case, call, conv, results: dict, grads: dict):
    """The verdict on one call: on sampled rows (out, lse, dq) and key columns (dk, dv)
    past :data:`~arrayattn.testing.check.sampling.SAMPLE_ABOVE` logits, where the rows
    can be sliced, else whole (:func:`~arrayattn.testing.check.judge.judge`)."""
    from .judge import Verdict, judge

    rows, x, theirs = _sampled(case, call, conv, grads)
    if rows is None:
        return judge(call, conv, results, grads)
    items = judge_rows(call, conv, results, x, rows)
    if theirs:
        items += judge_grads(call, theirs, x, sliceable_problem(call, x), rows, case.seed)
    return Verdict(items)


def _np_dtype(x):
    name = str(x.dtype).split(".")[-1]
    return np.float32 if name == "bfloat16" else np.dtype(name)


def _do(call, x) -> np.ndarray:
    return to_bhnd({"do": np.asarray(x["do"], dtype=np.float64)}, call.layout, ("do",))["do"]


def repro_rows(conv, call, case, results: dict, grads: dict):
    """The repro of a case judged on sampled rows: ``(arrays, validate's flags, rows)`` of
    the row sub-problem (q, out and lse rows, k, v, the explicit mask and bias, the ``do``
    and ``dq`` rows of a backward case; ``validate --variant softmax`` judges exactly the
    rows the check judged), or ``None`` for a case judged whole."""
    rows, x, theirs = _sampled(case, call, conv, grads)
    if rows is None:
        return None
    prob = sliceable_problem(call, x)
    q, k, v, sub = row_problem(prob, rows)
    dt = _np_dtype(call.tensors["q"])
    arrays = {"q": q.astype(dt), "k": k.astype(dt), "v": v.astype(dt)}
    axis, swap = (-3, True) if call.layout == "bnhd" else (-2, False)
    out = take_rows(conv.to_judge("out", results["out"]), rows, axis, swap)
    arrays["out"] = host(out).astype(_np_dtype(out))
    if results.get("lse") is not None:
        lse = take_rows(results["lse"], rows, -1, False)
        arrays["lse"] = host(lse).astype(_np_dtype(lse))
    if "q" in theirs:
        arrays["do"] = _do(call, x)[..., rows, :].astype(dt)
        dq = take_rows(theirs["q"], rows, axis, swap)
        arrays["dq"] = host(dq).astype(_np_dtype(dq))
    arrays["mask"] = np.asarray(sub["mask"])
    if "bias" in sub:
        arrays["bias"] = np.asarray(sub["bias"])
    return arrays, _flags(sub), rows


def _flags(sub: dict) -> dict:
    flags = {"variant": "softmax"}
    options = [f"{key}={sub[key]}" for key in ("scale", "softcap") if key in sub]
    if options:
        flags["option"] = options
    return flags


def write_columns(path: str, conv, call, case, grads: dict, meta: dict) -> dict | None:
    """Write ``path + ".cols.npz"`` (and ``.cols.txt``, the key numbers) for a case whose
    ``dk`` / ``dv`` were judged on key columns; validate's flags for it, or ``None``."""
    rows, x, theirs = _sampled(case, call, conv, grads)
    keys = [name for name in ("k", "v") if name in theirs]
    if rows is None or not keys:
        return None
    prob = sliceable_problem(call, x)
    n, s = prob.q.shape[-2], prob.k.shape[-2]
    cols = sample_columns(n, s, window=window_of(prob.options), seed=case.seed)
    q, k, v, do1, sub = column_problem(prob, _do(call, x), cols)
    dt = _np_dtype(call.tensors["q"])
    arrays = {"q": q.astype(dt), "k": k.astype(dt), "v": v.astype(dt),
              "do": do1.astype(dt), "mask": np.asarray(sub["mask"]),
              "bias": np.asarray(sub["bias"])}
    axis, swap = (-3, True) if call.layout == "bnhd" else (-2, False)
    for name in keys:
        g = take_rows(theirs[name], cols, axis, swap)
        arrays["d" + name] = host(g).astype(_np_dtype(g))
    flags = _flags(sub)
    arrays[META] = np.asarray(json.dumps(dict(meta, variant="softmax", options=list(
        flags.get("option", ())), layout=None, key_columns=len(cols))))
    np.savez(path + ".cols.npz", **arrays)
    np.savetxt(path + ".cols.txt", cols, fmt="%d", header=f"the key columns of "
               f"{case.describe()} judged (of s = {s}); the last key of the file is the "
               "sink (arrayattn.testing.check.sampled_grads)")
    return flags
