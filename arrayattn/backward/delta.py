r"""The backward adapters of :func:`arrayattn.delta_attention` (``deltanet``) and
:func:`arrayattn.gated_delta_attention` (``gated_deltanet``).  The equations are in
:mod:`arrayattn.reference.delta_vjp`.

The forward's preprocessing is differentiated here: masked tokens (``key_mask``) have
their key, value, ``beta`` and gate selected out (exact zero gradients, whatever they
hold), ``scale`` multiplies ``dq``, and ``normalize_qk``'s unit rows are differentiated
by :func:`~arrayattn.reference.unit_rows_vjp`.  ``method="chunked"`` (default) runs the
chunked backward, ``"recurrent"`` the token recurrence with states checkpointed every
``chunk_size`` tokens; both cost ``O(n d + n/c d dv)`` memory per head.  In the uniform
call (``deltanet``, ``gated_deltanet``) ``beta`` and ``g`` are drawn from ``seed``: they
are constants and get no cotangent.
"""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..gated.checks import GatedCall, check_delta, check_gated_delta
from ..gated.api import DELTA_CALL_SPEC, GATED_DELTA_CALL_SPEC
from ..reference.exact_vjp import sum_to_shape

__all__ = ["delta_attention_vjp", "gated_delta_attention_vjp", "deltanet_vjp",
           "gated_deltanet_vjp"]


def _delta_vjp(call: GatedCall, q, k, v, do, args: dict):
    """Gradients of the forward (:func:`arrayattn.gated.run.gated_reference` with
    ``beta``) for the checked ``call``, for the arguments ``args`` the caller passed
    (``{"q", "k", "v"[, "beta"][, "g"][, "initial_state"]}``), each summed to its shape."""
    p, key_mask, scale, s0 = call.p, call.key_mask, call.scale, call.initial_state
    xp, wd = p.xp, p.work_dtype
    full = (*p.batch, p.n)
    wq, wk = (xp.broadcast_to(xp.astype(x, wd, copy=False), (*full, p.d)) for x in (q, k))
    wv = xp.broadcast_to(xp.astype(v, wd, copy=False), (*full, p.dv))
    wdo = xp.astype(do, wd, copy=False)
    beta = xp.broadcast_to(call.beta, full)
    g = xp.broadcast_to(call.g, (*full, 1))
    valid = g <= 0.0                                    # a gate outside (0, 1]: NaN
    g = xp.where(valid, g, xp.nan)
    if key_mask is not None:       # select masked tokens out before any arithmetic
        km = xp.broadcast_to(key_mask, full)
        wk, wv = reference.zero_masked_keys(km, wk, wv)
        g = xp.where(km[..., None], g, 0.0)
        beta = xp.where(km, beta, 0.0)
    # the forward's rule (_gated_run.prepared): a bad token is dropped, the rows from it on
    # are NaN
    bad = reference.nonfinite_rows(wk, wv) | reference.nan_over(g, (-1,)) | ~xp.isfinite(beta)
    wk, wv = reference.drop_nonfinite(bad, wk, wv)
    g, beta = xp.where(bad[..., None], 0.0, g), xp.where(bad, 0.0, beta)
    rq, rk = wq, wk                                     # before normalisation
    if call.normalize_qk:
        wq, wk = (reference.unit_rows(x)[0] for x in (wq, wk))
    if scale is not None:
        wq = wq * scale
    if p.n == 0:
        zero = xp.zeros((*full, 1), dtype=wd, device=p.device)
        grads = (wq, wk, wv, zero[..., 0], zero, xp.zeros_like(s0))
    else:
        with entry(xp):
            vjp = (reference.delta_chunked_vjp if call.method == "chunked"
                   else reference.delta_recurrent_vjp)
            grads = vjp(wq, wk, wv, beta, g, s0, wdo, call.chunk_size)
    dq, dk, dv, dbeta, dg, ds0 = grads
    if scale is not None:
        dq = dq * scale
    if call.normalize_qk:
        with entry(xp):
            dq, dk = reference.unit_rows_vjp(rq, dq), reference.unit_rows_vjp(rk, dk)
    # a gate of 0 (g = -inf) is a restart: d exp(g)/dg = 0 exactly (not a rounding of it)
    dg = xp.where(valid & (g != -xp.inf), dg, 0.0)
    if key_mask is not None:
        dk, dv = reference.zero_masked_keys(km, dk, dv)
        dg = xp.where(km[..., None], dg, 0.0)
        dbeta = xp.where(km, dbeta, 0.0)
    out = {"q": dq, "k": dk, "v": dv, "beta": dbeta, "g": dg[..., 0], "initial_state": ds0}
    out = reference.poison_prefix_grads(out, bad, p.n, per_token=("beta", "g"))
    return {name: sum_to_shape(out[name], x.shape) for name, x in args.items()
            if x is not None}


def delta_attention_vjp(q, k, v, do, /, *, beta, normalize_qk=False, causal=True,
                        key_mask=None, method="chunked", chunk_size=16, scale=None,
                        initial_state=None, return_state=False):
    """``{"q", "k", "v", "beta"[, "initial_state"]}`` of
    :func:`~arrayattn.delta_attention` (of its output; ``return_state`` is accepted and
    the final state gets no cotangent)."""
    call = check_delta(q, k, v, beta=beta, normalize_qk=normalize_qk, causal=causal,
                       key_mask=key_mask, method=method, chunk_size=chunk_size, scale=scale,
                       initial_state=initial_state, return_state=return_state)
    return _delta_vjp(call, q, k, v, do, {"q": q, "k": k, "v": v, "beta": beta,
                                          "initial_state": initial_state})


def gated_delta_attention_vjp(q, k, v, do, /, *, beta, g, normalize_qk=False, causal=True,
                              key_mask=None, method="chunked", chunk_size=16, scale=None,
                              initial_state=None, return_state=False):
    """``{"q", "k", "v", "beta", "g"[, "initial_state"]}`` of
    :func:`~arrayattn.gated_delta_attention` (of its output; ``return_state`` is
    accepted and the final state gets no cotangent).  ``dg`` is the cotangent of the log
    decays; at a gate of 0 (``g = -inf``) it is 0."""
    call = check_gated_delta(q, k, v, beta=beta, g=g, normalize_qk=normalize_qk,
                             causal=causal, key_mask=key_mask, method=method,
                             chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                             return_state=return_state)
    return _delta_vjp(call, q, k, v, do, {"q": q, "k": k, "v": v, "beta": beta, "g": g,
                                          "initial_state": initial_state})


# The uniform call's draws and checks are the forward's own (arrayattn.gated.api's *_CALL_SPEC).

def deltanet_vjp(q, k, v, do, /, *, seed=0, **options):
    """``{"q", "k", "v"[, "initial_state"]}`` of the uniform call ``deltanet``:
    ``beta = sigmoid(N(0, 1))`` drawn from ``seed`` (no cotangent), or the ``beta=`` the
    caller gave (the record's ``draws``: then ``"beta"`` too)."""
    call = DELTA_CALL_SPEC.check(q, k, v, seed=seed, **options)
    return _delta_vjp(call, q, k, v, do, {"q": q, "k": k, "v": v, "beta": options.get("beta"),
                                          "initial_state": options.get("initial_state")})


def gated_deltanet_vjp(q, k, v, do, /, *, seed=0, **options):
    """``{"q", "k", "v"[, "initial_state"]}`` of the uniform call ``gated_deltanet``:
    ``beta = sigmoid(N(0, 1))`` and ``g = log sigmoid(N(3, 1))`` drawn from ``seed``
    (no cotangent), or the ``beta=``, ``g=`` the caller gave (then theirs too)."""
    call = GATED_DELTA_CALL_SPEC.check(q, k, v, seed=seed, **options)
    return _delta_vjp(call, q, k, v, do, {"q": q, "k": k, "v": v, "beta": options.get("beta"),
                                          "g": options.get("g"),
                                          "initial_state": options.get("initial_state")})
