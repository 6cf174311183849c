"""The backward adapters of :func:`arrayattn.luna_attention` and of its uniform call
(``luna``).  The equations are in :mod:`arrayattn.reference.luna_vjp`.

Cotangents: ``q``, ``k``, ``v``, ``p`` (the packed sequence: pass it to
:func:`arrayattn.vjp` as ``p=``) and ``unpack_key_proj`` / ``unpack_value_proj`` when
given.  The uniform call draws ``p`` (and ``W_K`` when ``dv != d``) from ``seed``: those
are constants of the forward and get none.  The cotangent is that of the output only
(``return_packed`` is accepted and ignored).
"""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..lowrank.checks import LunaCall, checked_luna, checked_luna_uniform
from ..core.pipeline import working
from ..reference.exact_vjp import sum_to_shape

__all__ = ["luna_attention_vjp", "luna_call_vjp"]

_PROJECTIONS = ("unpack_key_proj", "unpack_value_proj")


def luna_attention_vjp(q, k, v, do, /, *, p=None, scale=None, causal=False, key_mask=None,
                       unpack_key_proj=None, unpack_value_proj=None, return_packed=False):
    """``{"q", "k", "v", "p"[, "unpack_key_proj"][, "unpack_value_proj"]}`` of
    :func:`~arrayattn.luna_attention`'s output."""
    if p is None:
        raise TypeError("the backward of luna_attention needs the packed sequence: pass "
                        "p= (the forward's fourth argument)")
    call = checked_luna(q, k, v, p, scale=scale, causal=causal, key_mask=key_mask,
                        unpack_key_proj=unpack_key_proj, unpack_value_proj=unpack_value_proj,
                        return_packed=return_packed)
    args = {"q": q, "k": k, "v": v, "p": p, "unpack_key_proj": unpack_key_proj,
            "unpack_value_proj": unpack_value_proj}
    return _grads(call, do, {name: x for name, x in args.items() if x is not None})


def luna_call_vjp(q, k, v, do, /, **options):
    """The uniform call's backward (options ``num_packed``, ``seed`` and those of
    :func:`~arrayattn.luna_attention` but ``p``): ``P`` (and ``W_K`` when ``dv != d`` and
    none is given) drawn as the forward draws them; no cotangent for what was drawn."""
    call = checked_luna_uniform(q, k, v, **options)
    given = {name: options[name] for name in _PROJECTIONS
             if options.get(name) is not None}
    return _grads(call, do, {"q": q, "k": k, "v": v, **given})


def _grads(call: LunaCall, do, args: dict) -> dict:
    """The cotangents of the arrays ``args`` (by name), summed to their shapes."""
    prob = call.p
    xp = prob.xp
    if prob.s == 0:                       # P' = 0 and O = 0 whatever the inputs
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=prob.device)
                for name, x in args.items()}
    w = working(prob, *call.qkv, None)     # cast only: the equations mask the keys
    wdo = xp.astype(do, prob.work_dtype, copy=False)
    with entry(xp):
        grads = reference.luna_attention_vjp(
            w.q, w.k, w.v, call.packed_queries, wdo, scale=call.scale,
            key_mask=call.key_mask, unpack_key_proj=call.unpack_key_proj,
            unpack_value_proj=call.unpack_value_proj)
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}


def _output(options):
    """The arrays besides ``q, k, v`` whose batch axes broadcast into the output, and the
    output's last axis (``W_V``'s when given)."""
    wv = options.get("unpack_value_proj")
    dv = wv.shape[-1] if getattr(wv, "ndim", 0) >= 2 else None
    return {name: options.get(name) for name in ("p", *_PROJECTIONS)}, dv


luna_attention_vjp.output = luna_call_vjp.output = _output
