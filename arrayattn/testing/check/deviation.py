"""The record of a named deviation (:mod:`arrayattn.testing.check.explain`) and the
helpers its transformations share on a reference problem: its options changed, whether it
is exact softmax attention, its scale and window, its probabilities and empty rows."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..problem import Problem

__all__ = ["Ctx", "Deviation", "and_mask", "empty_rows", "ij", "is_plain", "is_softmax",
           "probabilities", "scale_of", "tanh", "where", "window_of", "with_changes"]


# -- the record ------------------------------------------------------------------------
@dataclass(frozen=True)
class Deviation:
    """A named mistake: ``name``, the ``sentence`` printed, and its transformation of the
    reference problem (each hook returns ``None`` where the deviation does not apply).

    ``port(params, x, ctx)`` -> ``(params, x)``: the port's options and inputs;
    ``native(problem, ctx)`` -> problem: arrayattn's problem after the profile's mapping;
    ``result(label, ref, problem, ctx)`` -> array: the reference result ``label``
    (``"out"``, ``"lse"``, ``"dk"`` ...) under the deviation;
    ``grads(rec, args, options, how, ctx)`` -> dict: the reference gradients.
    ``items``: the results it changes (``None``: all, gradients included); the others must
    have matched already.  ``conventions``: the conventions it can occur in (empty: all)."""

    name: str
    sentence: str
    port: Callable | None = None
    native: Callable | None = None
    result: Callable | None = None
    grads: Callable | None = None
    items: tuple | None = None
    conventions: tuple = ()


@dataclass
class Ctx:
    """What a transformation may read: the case, the convention and its call."""

    case: object
    conv: object
    call: object

    @property
    def opts(self) -> dict:
        return self.case.active()

    def explicit_scale(self) -> bool:
        o = self.opts
        return bool(o.get("scale") or o.get("softmax_scale"))


# -- helpers on a problem ----------------------------------------------------------------
def with_changes(p: Problem, **changes) -> Problem:
    """``p`` with options changed (``None`` removes one)."""
    o = dict(p.options)
    for key, val in changes.items():
        if val is None:
            o.pop(key, None)
        else:
            o[key] = val
    return replace(p, options=o)


def is_softmax(p: Problem) -> bool:
    return p.name == "softmax" and p.options.get("score_mod") is None


def is_plain(p: Problem) -> bool:
    """Exact softmax of unpacked, unpaged sequences."""
    return is_softmax(p) and p.options.get("cu_seqlens_q") is None


def scale_of(p: Problem) -> float:
    s = p.options.get("scale")
    return float(s) if s is not None else p.q.shape[-1] ** -0.5


def tanh(x):
    return x.tanh() if hasattr(x, "tanh") else np.tanh(x)


def where(cond, a, b):
    if hasattr(a, "detach"):
        import torch
        return torch.where(torch.as_tensor(cond), a, torch.as_tensor(b, dtype=a.dtype))
    return np.where(cond, a, b)


def window_of(p: Problem) -> tuple:
    """The effective ``(left, right)`` bounds (``None``: unbounded), causal folded in."""
    left, right = p.options.get("window") or (None, None)
    left = None if left is None or left < 0 else int(left)
    right = None if right is None or right < 0 else int(right)
    if p.options.get("causal"):
        right = 0 if right is None else min(right, 0)
    return left, right


def ij(p: Problem):
    n, s = p.q.shape[-2], p.k.shape[-2]
    return np.arange(n)[:, None], np.arange(s)[None, :]


def and_mask(p: Problem, mask: np.ndarray) -> Problem:
    old = p.options.get("mask")
    return with_changes(p, mask=mask if old is None else np.logical_and(old, mask))


def probabilities(p: Problem, zero_logits: bool = False) -> np.ndarray | None:
    """The attention matrix ``P (b, h, n, s)`` of the problem (its output with ``v`` the
    identity); with ``zero_logits``, of ``q = k = 0`` without softcap (positive exactly
    where a key is visible)."""
    if p.name != "softmax" or p.v.ndim < 2:
        return None
    s = p.k.shape[-2]
    eye = np.broadcast_to(np.eye(s), p.v.shape[:-2] + (s, s))
    q, k = (np.zeros_like(p.q), np.zeros_like(p.k)) if zero_logits else (p.q, p.k)
    alt = replace(p, q=q, k=k, v=np.ascontiguousarray(eye), lse_shift=None)
    if zero_logits:
        alt = with_changes(alt, softcap=None, score_mod=None)
    return alt.evaluate()


def empty_rows(p: Problem) -> np.ndarray | None:
    """Rows with no visible key (the reference lse infinite), ``(..., n)``; None if none."""
    if not is_softmax(p):
        return None
    empty = ~np.isfinite(p.evaluate(lse=True))
    return empty if empty.any() else None
