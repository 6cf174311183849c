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
from .._engine import entry
from .._validate import check_flag, check_qkv
from .._validate_linear import checked_gated
from ..gated import drawn_delta_betas, drawn_gated_delta_gates
from ..reference.exact_vjp import sum_to_shape

__all__ = ["delta_attention_vjp", "gated_delta_attention_vjp", "deltanet_vjp",
           "gated_deltanet_vjp"]


def _delta_vjp(q, k, v, do, beta, g, *, normalize_qk, causal, key_mask, method, chunk_size,
               scale, initial_state, return_state):
    """Gradients of the forward ``_linear_run.run_gated(q, k, v, g, beta, ...)`` for the
    arguments the call received (``g=None``: DeltaNet), each summed to its shape."""
    gates = (("beta", beta, False),) + ((("g", g, False),) if g is not None else ())
    p, method, chunk_size, _, s0, checked = checked_gated(
        q, k, v, causal=causal, key_mask=key_mask, method=method, chunk_size=chunk_size,
        scale=scale, initial_state=initial_state, return_state=return_state, gates=gates)
    normalize_qk = check_flag("normalize_qk", normalize_qk)
    xp, wd = p.xp, p.work_dtype
    args = {"q": q, "k": k, "v": v, **{name: x for name, x, _ in gates}}
    if initial_state is not None:
        args["initial_state"] = initial_state
    wbeta = checked[0][..., 0]
    wg = checked[1] if g is not None else xp.zeros((p.n, 1), dtype=wd, device=p.device)
    full = (*p.batch, p.n)
    wq, wk = (xp.broadcast_to(xp.astype(x, wd, copy=False), (*full, p.d)) for x in (q, k))
    wv = xp.broadcast_to(xp.astype(v, wd, copy=False), (*full, p.dv))
    wdo = xp.astype(do, wd, copy=False)
    beta = xp.broadcast_to(wbeta, full)
    g = xp.broadcast_to(wg, (*full, 1))
    valid = g <= 0.0                                    # a gate outside (0, 1]: NaN
    g = xp.where(valid, g, xp.nan)
    if key_mask is not None:       # select masked tokens out before any arithmetic
        km = xp.broadcast_to(key_mask, full)
        wk, wv = reference.zero_masked_keys(km, wk, wv)
        g = xp.where(km[..., None], g, 0.0)
        beta = xp.where(km, beta, 0.0)
    # the forward's rule (run_gated): a bad token is dropped, the rows from it on are NaN
    bad = reference.nonfinite_rows(wk, wv) | xp.any(xp.isnan(g), axis=-1) | ~xp.isfinite(beta)
    wk, wv = reference.drop_nonfinite(bad, wk, wv)
    g, beta = xp.where(bad[..., None], 0.0, g), xp.where(bad, 0.0, beta)
    rq, rk = wq, wk                                     # before normalisation
    if normalize_qk:
        wq, wk = (reference.unit_rows(x)[0] for x in (wq, wk))
    if scale is not None:
        wq = wq * float(scale)
    if p.n == 0:
        zero = xp.zeros((*full, 1), dtype=wd, device=p.device)
        grads = (wq, wk, wv, zero[..., 0], zero, xp.zeros_like(s0))
    else:
        with entry(xp):
            vjp = (reference.delta_chunked_vjp if method == "chunked"
                   else reference.delta_recurrent_vjp)
            grads = vjp(wq, wk, wv, beta, g, s0, wdo, chunk_size)
    dq, dk, dv, dbeta, dg, ds0 = grads
    if scale is not None:
        dq = dq * float(scale)
    if normalize_qk:
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
    return {name: sum_to_shape(out[name], x.shape) for name, x in args.items()}


def delta_attention_vjp(q, k, v, do, /, *, beta, normalize_qk=False, causal=True,
                        key_mask=None, method="chunked", chunk_size=16, scale=None,
                        initial_state=None, return_state=False):
    """``{"q", "k", "v", "beta"[, "initial_state"]}`` of
    :func:`~arrayattn.delta_attention` (of its output; ``return_state`` is accepted and
    the final state gets no cotangent)."""
    return _delta_vjp(q, k, v, do, beta, None, normalize_qk=normalize_qk, causal=causal,
                      key_mask=key_mask, method=method, chunk_size=chunk_size, scale=scale,
                      initial_state=initial_state, return_state=return_state)


def gated_delta_attention_vjp(q, k, v, do, /, *, beta, g, normalize_qk=False, causal=True,
                              key_mask=None, method="chunked", chunk_size=16, scale=None,
                              initial_state=None, return_state=False):
    """``{"q", "k", "v", "beta", "g"[, "initial_state"]}`` of
    :func:`~arrayattn.gated_delta_attention` (of its output; ``return_state`` is
    accepted and the final state gets no cotangent).  ``dg`` is the cotangent of the log
    decays; at a gate of 0 (``g = -inf``) it is 0."""
    return _delta_vjp(q, k, v, do, beta, g, normalize_qk=normalize_qk, causal=causal,
                      key_mask=key_mask, method=method, chunk_size=chunk_size, scale=scale,
                      initial_state=initial_state, return_state=return_state)


# The uniform call's draws are the forward's own (arrayattn.gated.drawn_*).

def deltanet_vjp(q, k, v, do, /, *, seed=0, **options):
    """``{"q", "k", "v"[, "initial_state"]}`` of the uniform call ``deltanet``:
    ``beta = sigmoid(N(0, 1))`` drawn from ``seed`` (no cotangent)."""
    check_qkv(q, k, v)
    beta = drawn_delta_betas(q, seed)
    grads = delta_attention_vjp(q, k, v, do, beta=beta, **options)
    return {name: x for name, x in grads.items() if name != "beta"}


def gated_deltanet_vjp(q, k, v, do, /, *, seed=0, **options):
    """``{"q", "k", "v"[, "initial_state"]}`` of the uniform call ``gated_deltanet``:
    ``beta = sigmoid(N(0, 1))`` and ``g = log sigmoid(N(3, 1))`` drawn from ``seed``
    (no cotangent)."""
    check_qkv(q, k, v)
    beta, g = drawn_gated_delta_gates(q, seed)
    grads = gated_delta_attention_vjp(q, k, v, do, beta=beta, g=g, **options)
    return {name: x for name, x in grads.items() if name not in ("beta", "g")}
