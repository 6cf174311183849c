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
from ..core.engine import entry
from ..gated.checks import GatedCall, check_gla, check_retention, check_ssd
from ..gated.api import GLA_CALL_SPEC, SSD_CALL_SPEC
from ..reference.exact_vjp import sum_to_shape

__all__ = ["retention_vjp", "gla_attention_vjp", "ssd_attention_vjp", "gla_call_vjp",
           "ssd_call_vjp"]


def _gated_vjp(call: GatedCall, q, k, v, do):
    """Gradients of the family's output for the checked ``call``.  ``"g"`` in the result:
    the cotangent of the checked log gates ``call.g (..., n, 1 | dk)``, batch-shaped."""
    p, g, key_mask, scale = call.p, call.g, call.key_mask, call.scale
    xp, wd, s0 = p.xp, p.work_dtype, call.initial_state
    # the forward's preprocessing (_gated_run.prepared), differentiated below
    wq, wk, wv = (xp.astype(x, wd, copy=False) for x in (q, k, v))
    if scale is not None:
        wq = wq * scale
    keep = g <= 0.0                                         # g > 0 or NaN: replaced by NaN
    wg = xp.where(keep, g, xp.nan)
    if key_mask is not None:            # masked tokens: k, v zeroed, gate replaced by 1
        wk, wv = reference.zero_masked_keys(key_mask, wk, wv)
        wg = xp.where(key_mask[..., None], wg, 0.0)
        keep = keep & key_mask[..., None]
    # the forward's rule: a token with a non-finite key or value or a NaN gate is dropped
    # and the rows from it on are NaN (reference.finite): their gradients below too
    bad = reference.nonfinite_rows(wk, wv) | reference.nan_over(wg, (-1,))
    wk, wv = reference.drop_nonfinite(bad, wk, wv)
    wg = xp.where(bad[..., None], 0.0, wg)
    wdo = xp.astype(do, wd, copy=False)
    if p.n == 0:
        grads = {"q": wq, "k": wk, "v": wv, "g": wg, "initial_state": s0}
        return {name: xp.zeros_like(x) for name, x in grads.items()}
    with entry(xp):
        if call.method == "recurrent":
            grads = reference.gla_recurrent_vjp(wq, wk, wv, wg, s0, wdo)
        else:
            grads = reference.gla_chunked_vjp(wq, wk, wv, wg, s0, wdo, call.chunk_size)
    if scale is not None:                                   # wq = scale q
        grads["q"] = grads["q"] * scale
    if key_mask is not None:
        grads["k"], grads["v"] = reference.zero_masked_keys(key_mask, grads["k"],
                                                            grads["v"])
    grads["g"] = xp.where(keep, grads["g"], 0.0)
    return reference.poison_prefix_grads(grads, bad, p.n)


def _shaped(grads, args):
    """Each gradient summed to its argument's shape (broadcast batch axes)."""
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()
            if x is not None}


def retention_vjp(q, k, v, do, /, *, gamma=None, causal=True, key_mask=None,
                  method="chunked", chunk_size=32, scale=None, initial_state=None,
                  return_state=False):
    """``{"q", "k", "v"[, "initial_state"]}`` of :func:`~arrayattn.retention` (``gamma``
    gets no cotangent)."""
    call = check_retention(q, k, v, gamma=gamma, causal=causal, key_mask=key_mask,
                           method=method, chunk_size=chunk_size, scale=scale,
                           initial_state=initial_state, return_state=return_state)
    grads = _gated_vjp(call, q, k, v, do)
    return _shaped(grads, {"q": q, "k": k, "v": v, "initial_state": initial_state})


def gla_attention_vjp(q, k, v, do, /, *, g, causal=True, key_mask=None, method="chunked",
                      chunk_size=16, scale=None, initial_state=None, return_state=False):
    """``{"q", "k", "v", "g"[, "initial_state"]}`` of :func:`~arrayattn.gla_attention`
    (``g (..., n, dk)``, the log gates, passed as ``g=``)."""
    call = check_gla(q, k, v, g=g, causal=causal, key_mask=key_mask, method=method,
                     chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                     return_state=return_state)
    grads = _gated_vjp(call, q, k, v, do)
    return _shaped(grads, {"q": q, "k": k, "v": v, "g": g, "initial_state": initial_state})


def ssd_attention_vjp(q, k, v, do, /, *, a, causal=True, key_mask=None, method="chunked",
                      chunk_size=32, scale=None, initial_state=None, return_state=False):
    """``{"q", "k", "v", "a"[, "initial_state"]}`` of :func:`~arrayattn.ssd_attention`
    (``a (..., n)``, the log decays ``Delta_t A``, passed as ``a=``; their cotangent is
    that of what was passed: for ``a = dt * A`` the caller's chain rule gives
    ``d dt = A da`` and ``dA = sum(dt da)``)."""
    call = check_ssd(q, k, v, a=a, causal=causal, key_mask=key_mask, method=method,
                     chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                     return_state=return_state)
    grads = _gated_vjp(call, q, k, v, do)
    grads["a"] = grads.pop("g")[..., 0]
    return _shaped(grads, {"q": q, "k": k, "v": v, "a": a, "initial_state": initial_state})


def gla_call_vjp(q, k, v, do, /, *, seed=0, **options):
    """The registry's ``gla``: gates drawn from ``seed`` as the uniform call draws them
    (constants: no cotangent), or the gates ``g=`` the caller gave (the record's
    ``draws``: then theirs too); checked as the uniform call checks them, once."""
    call = GLA_CALL_SPEC.check(q, k, v, seed=seed, **options)
    grads = _gated_vjp(call, q, k, v, do)
    return _shaped(grads, {"q": q, "k": k, "v": v, "g": options.get("g"),
                           "initial_state": options.get("initial_state")})


def ssd_call_vjp(q, k, v, do, /, *, seed=0, **options):
    """The registry's ``ssd``: log decays drawn from ``seed`` as the uniform call draws
    them (constants: no cotangent), or the decays ``a=`` the caller gave (then theirs
    too); checked as the uniform call checks them, once."""
    call = SSD_CALL_SPEC.check(q, k, v, seed=seed, **options)
    grads = _gated_vjp(call, q, k, v, do)
    grads["a"] = grads.pop("g")[..., 0]
    return _shaped(grads, {"q": q, "k": k, "v": v, "a": options.get("a"),
                           "initial_state": options.get("initial_state")})
