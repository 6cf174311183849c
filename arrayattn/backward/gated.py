"""The backward adapters of the decay-gated family: :func:`arrayattn.retention`,
:func:`arrayattn.gla_attention`, :func:`arrayattn.ssd_attention` and the registry's
uniform calls of ``gla`` and ``ssd`` (gates drawn from ``seed``).  The equations are in
:mod:`arrayattn.reference.gated_vjp`.

Cotangents: ``q``, ``k``, ``v``; the log gates the caller passed (``g`` of GLA, ``a`` of
SSD); ``initial_state`` when passed.  Retention's ``gamma`` is a fixed hyperparameter of
the model (RetNet does not train it) and gets none, even when given as an array; gates
drawn from ``seed`` are constants of the forward and get none.  ``return_state`` is
accepted and ignored: the vjp is that of the output (the final state's cotangent is
:func:`~arrayattn.reference.gla_chunked_vjp`'s ``ds_n``).
"""
from __future__ import annotations

from .. import reference
from .._engine import entry
from .._validate import check_flag, check_qkv
from ..gated import (check_gate, checked_gated, drawn_gla_gates, drawn_ssd_decays,
                     retention_log_gates)
from ..reference.exact_vjp import sum_to_shape

__all__ = ["retention_vjp", "gla_attention_vjp", "ssd_attention_vjp", "gla_call_vjp",
           "ssd_call_vjp"]


def _gated_vjp(q, k, v, do, g, *, causal, key_mask, method, chunk_size, scale,
               initial_state, return_state):
    """Gradients of the family's output from the checked log gates ``g (..., n, 1 | dk)``
    (``"g"`` in the result, working dtype, the batch's shape)."""
    p, (wq, wk, wv), wg, _, s0, method, chunk_size = checked_gated(
        q, k, v, g, None, causal=causal, key_mask=key_mask, method=method,
        chunk_size=chunk_size, scale=scale, initial_state=initial_state)
    check_flag("return_state", return_state)
    xp = p.xp
    wdo = xp.astype(do, p.work_dtype, copy=False)
    if p.n == 0:
        grads = {"q": wq, "k": wk, "v": wv, "g": wg, "initial_state": xp.zeros_like(s0)}
        return {name: xp.zeros_like(x) for name, x in grads.items()}
    with entry(xp):
        if method == "recurrent":
            grads = reference.gla_recurrent_vjp(wq, wk, wv, wg, s0, wdo)
        else:
            grads = reference.gla_chunked_vjp(wq, wk, wv, wg, s0, wdo, chunk_size)
    if scale is not None:                                   # wq = scale q
        grads["q"] = grads["q"] * float(scale)
    keep = g <= 0.0                                         # g > 0 or NaN: replaced by NaN
    if key_mask is not None:            # masked tokens: k, v zeroed, gate replaced by 1
        grads["k"], grads["v"] = reference.zero_masked_keys(key_mask, grads["k"],
                                                            grads["v"])
        keep = keep & key_mask[..., None]
    grads["g"] = xp.where(keep, grads["g"], 0.0)
    return grads


def _shaped(grads, args):
    """Each gradient summed to its argument's shape (broadcast batch axes)."""
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()
            if x is not None}


def retention_vjp(q, k, v, do, /, *, gamma=None, causal=True, key_mask=None,
                  method="chunked", chunk_size=32, scale=None, initial_state=None,
                  return_state=False):
    """``{"q", "k", "v"[, "initial_state"]}`` of :func:`~arrayattn.retention` (``gamma``
    gets no cotangent)."""
    g = retention_log_gates(q, k, v, gamma)
    grads = _gated_vjp(q, k, v, do, g, causal=causal, key_mask=key_mask, method=method,
                       chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                       return_state=return_state)
    return _shaped(grads, {"q": q, "k": k, "v": v, "initial_state": initial_state})


def gla_attention_vjp(q, k, v, do, /, *, g, causal=True, key_mask=None, method="chunked",
                      chunk_size=16, scale=None, initial_state=None, return_state=False):
    """``{"q", "k", "v", "g"[, "initial_state"]}`` of :func:`~arrayattn.gla_attention`
    (``g (..., n, dk)``, the log gates, passed as ``g=``)."""
    wg = check_gate(check_qkv(q, k, v), "g", g, q, per_dim=True)
    grads = _gated_vjp(q, k, v, do, wg, causal=causal, key_mask=key_mask, method=method,
                       chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                       return_state=return_state)
    return _shaped(grads, {"q": q, "k": k, "v": v, "g": g, "initial_state": initial_state})


def ssd_attention_vjp(q, k, v, do, /, *, a, causal=True, key_mask=None, method="chunked",
                      chunk_size=32, scale=None, initial_state=None, return_state=False):
    """``{"q", "k", "v", "a"[, "initial_state"]}`` of :func:`~arrayattn.ssd_attention`
    (``a (..., n)``, the log decays ``Delta_t A``, passed as ``a=``; their cotangent is
    that of what was passed: for ``a = dt * A`` the caller's chain rule gives
    ``d dt = A da`` and ``dA = sum(dt da)``)."""
    wa = check_gate(check_qkv(q, k, v), "a", a, q, per_dim=False)
    grads = _gated_vjp(q, k, v, do, wa, causal=causal, key_mask=key_mask, method=method,
                       chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                       return_state=return_state)
    grads["a"] = grads.pop("g")[..., 0]
    return _shaped(grads, {"q": q, "k": k, "v": v, "a": a, "initial_state": initial_state})


def gla_call_vjp(q, k, v, do, /, *, seed=0, **options):
    """The registry's ``gla``: gates drawn from ``seed`` as the uniform call draws them
    (constants: no cotangent)."""
    check_qkv(q, k, v)
    grads = gla_attention_vjp(q, k, v, do, g=drawn_gla_gates(q, seed), **options)
    del grads["g"]
    return grads


def ssd_call_vjp(q, k, v, do, /, *, seed=0, **options):
    """The registry's ``ssd``: log decays drawn from ``seed`` as the uniform call draws
    them (constants: no cotangent)."""
    check_qkv(q, k, v)
    grads = ssd_attention_vjp(q, k, v, do, a=drawn_ssd_decays(q, seed), **options)
    del grads["a"]
    return grads
