"""Grouped-query heads (GQA, Ainslie et al. 2023; SDPA's ``enable_gqa``).

``q`` has ``Hq`` heads on axis -3 and ``k``, ``v`` have ``Hkv``, with ``Hq`` a multiple
``G`` of ``Hkv``: query head ``h`` attends with key/value head ``h // G`` (torch's
``repeat_interleave`` order).  Instead of repeating ``k`` and ``v`` ``G`` times, the query
heads are viewed as ``(Hkv, G)`` and the keys get a broadcast axis of size 1 -- a reshape
and an ``expand_dims``, no copy -- so every variant runs unchanged on the grouped batch.
"""
from __future__ import annotations

import functools

from .xp import xp_namespace

__all__ = ["grouped_query_heads", "group_heads"]

#: Array options with batch dimensions, and how many trailing axes are not batch axes
#: (``gamma``: retention's decays, one per head on its last axis).
_BATCHED_OPTIONS = {"key_mask": 1, "query_mask": 1, "mask": 2, "bias": 2, "gamma": 0,
                    "dropout_mask": 2, "alibi_slopes": 0, "conv_kernel": 1,
                    "e": 2, "f": 2, "p": 2, "unpack_key_proj": 2, "unpack_value_proj": 2,
                    "gate": 1}
#: Per-head options whose head axis is there without any batch axis before it
#: (Nyströmformer's ``conv_kernel (H, K)``, one kernel per head; Linformer's ``e``, ``f``
#: ``(H, m, s)``; Luna's ``p (H, l, d)`` and unpack projections ``(H, dv, d)``).
_PER_HEAD = {"conv_kernel", "e", "f", "p", "unpack_key_proj", "unpack_value_proj"}


def _heads(x, event: int):
    """The head count of ``x`` (axis ``-event - 1``), or None when it has no head axis."""
    return x.shape[-event - 1] if getattr(x, "ndim", 0) >= event + 1 else None


def group_heads(q, k, v, options: dict):
    """``(q, k, v, options, ungroup)`` with the query heads split into ``(Hkv, G)`` when
    ``q`` has ``G > 1`` times the heads of ``k`` and ``v``; ``None`` when the call is not
    grouped (heads equal, or broadcasting as they are)."""
    hq, hk, hv = _heads(q, 2), _heads(k, 2), _heads(v, 2)
    if (None in (hq, hk, hv) or q.ndim < 3 or hq == hk or hk == 1 or hk != hv
            or hq % hk):
        # Not grouped: shapes that do not broadcast get the usual error naming them.
        return None
    g = hq // hk
    xp = xp_namespace(q, k, v)

    def split(x, event: int, name: str):
        h = _heads(x, event)
        # no head axis (it broadcasts); a per-head option (event 0) has its heads last
        if h is None or (event and name not in _PER_HEAD
                         and x.ndim < event + 1 + (q.ndim - 3)):
            return x
        lead = tuple(x.shape[:-event - 1])
        tail = tuple(x.shape[x.ndim - event:])
        if h == hq:
            return xp.reshape(x, (*lead, hk, g, *tail))
        if h in (hk, 1):
            return xp.expand_dims(x, axis=x.ndim - event - 1 + 1)
        raise ValueError(
            f"{name} has {h} heads (shape {tuple(x.shape)}); with grouped-query heads it "
            f"must have {hq} (query heads), {hk} (key/value heads) or 1")

    new = dict(options)
    for name, event in _BATCHED_OPTIONS.items():
        if new.get(name) is not None:
            new[name] = split(new[name], event, name)
    lead = tuple(q.shape[:-3])
    qg = xp.reshape(q, (*lead, hk, g, *q.shape[-2:]))
    kg, vg = xp.expand_dims(k, axis=k.ndim - 2), xp.expand_dims(v, axis=v.ndim - 2)

    def ungroup(out):
        if isinstance(out, tuple):           # (out, lse): lse has no feature axis
            o, lse = out
            return ungroup(o), xp.reshape(lse, (*lse.shape[:-3], hq, lse.shape[-1]))
        return xp.reshape(out, (*out.shape[:-4], hq, *out.shape[-2:]))

    return qg, kg, vg, new, ungroup


def grouped_query_heads(fn):
    """Decorate ``fn(q, k, v, /, **options)`` so that it accepts grouped-query heads."""
    @functools.wraps(fn)
    def wrapper(q, k, v, /, **options):
        grouped = group_heads(q, k, v, options)
        if grouped is None:
            return fn(q, k, v, **options)
        qg, kg, vg, new, ungroup = grouped
        return ungroup(fn(qg, kg, vg, **new))
    return wrapper
