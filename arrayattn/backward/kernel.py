"""The backward adapters of :func:`arrayattn.linear_attention` (``linear_elu``,
``linear_relu``, ``linear_cosine``, ``linear_taylor``), :func:`arrayattn.feature_attention`
and :func:`arrayattn.efficient_attention` (``efficient``).  The equations are in
:mod:`arrayattn.reference.kernel_vjp`; the causal backward is the chunked one for every
``method`` (the three causal forms compute one function)."""
from __future__ import annotations

from dataclasses import replace

from .. import reference
from ..core.engine import entry
from ..kernel.state import LinearAttentionState
from ..kernel.calls import check_efficient, check_features, check_linear
from ..kernel.feature_maps import FEATURE_MAPS
from ..reference.exact_vjp import sum_to_shape

__all__ = ["linear_attention_vjp", "feature_attention_vjp", "efficient_attention_vjp"]


def _user_map_vjp(fm, vjp, which, ref):
    """``vjp`` with its output checked to have the input's shape and dtype."""
    def checked(x, dphi):
        dx = vjp(x, dphi)
        if tuple(getattr(dx, "shape", ())) != tuple(x.shape) or dx.dtype != x.dtype:
            raise ValueError(f"feature_map {fm.name!r}'s {which}_vjp must return the "
                             f"cotangent of its input, shape {tuple(x.shape)} and dtype "
                             f"{x.dtype}; got {getattr(dx, 'shape', type(dx).__name__)}")
        return dx
    return checked


def _drop_bad(causal, key_mask, k, v):
    """The forward's rule (:func:`arrayattn.core.pipeline.working`): causal, a non-finite key or value
    is dropped and the rows that see it become NaN; masked keys are not faults."""
    if not causal:
        return k, v, None
    k, v = reference.zero_masked_keys(key_mask, k, v)
    bad = reference.nonfinite_rows(k, v)
    return (*reference.drop_nonfinite(bad, k, v), bad)


def linear_attention_vjp(q, k, v, do, /, *, feature_map="elu+1", causal=False,
                         key_mask=None, eps=None, method=None, chunk_size=64,
                         return_state=False, normalize=True):
    """``{"q", "k", "v"}`` of :func:`~arrayattn.linear_attention` (of its output;
    ``return_state`` is accepted and ignored).  A user feature map needs its
    derivatives: a :class:`~arrayattn.kernel.feature_maps.FeatureMap` with ``query_vjp`` and
    ``key_vjp`` (``NotImplementedError`` otherwise)."""
    call = check_linear(q, k, v, feature_map=feature_map, causal=causal, key_mask=key_mask,
                        eps=eps, method=method, chunk_size=chunk_size,
                        return_state=return_state, normalize=normalize)
    p, fm, causal = call.p, call.feature_map, call.causal
    if fm.query_vjp is None or fm.key_vjp is None:
        raise NotImplementedError(
            f"the backward of linear_attention needs the derivatives of the feature map "
            f"{fm.name!r}: pass arrayattn.kernel.feature_maps.FeatureMap(name, phi_q, phi_k, "
            f"query_vjp=..., key_vjp=...) with (x, dphi) -> dx for each map")
    if not (fm.name in FEATURE_MAPS and fm is FEATURE_MAPS[fm.name]):
        fm = replace(fm, query=call.maps[0], key=call.maps[1],
                     query_vjp=_user_map_vjp(fm, fm.query_vjp, "query", q),
                     key_vjp=_user_map_vjp(fm, fm.key_vjp, "key", q))
    xp = p.xp
    wq, wk, wv, wdo = (xp.astype(x, p.work_dtype, copy=False) for x in (q, k, v, do))
    with entry(xp):
        wk, wv, bad = _drop_bad(causal, key_mask, wk, wv)
        grads = reference.linear_attention_vjp(
            wq, wk, wv, wdo, feature_map=fm, causal=causal, key_mask=key_mask,
            method=call.method, chunk_size=call.chunk_size, eps=call.eps,
            normalize=call.normalize)
        if bad is not None:
            grads = reference.poison_prefix_grads(grads, bad, p.n)
    args = {"q": q, "k": k, "v": v}
    return {name: sum_to_shape(g, args[name].shape) for name, g in grads.items()}


def feature_attention_vjp(phi_q, phi_k, v, do, /, *, causal=False, key_mask=None, eps=None,
                          method=None, chunk_size=64, return_state=False, state=None):
    """``{"phi_q", "phi_k", "v"[, "state"]}`` of :func:`~arrayattn.feature_attention`
    (of its output; ``return_state`` is accepted and ignored).  The cotangent of a given
    ``state`` is a :class:`~arrayattn.LinearAttentionState` holding ``dS`` and ``dz``
    (same ``num_tokens`` and feature map)."""
    call = check_features(phi_q, phi_k, v, causal=causal, key_mask=key_mask, eps=eps,
                          method=method, chunk_size=chunk_size, return_state=return_state,
                          state=state)
    p, causal, xp = call.p, call.causal, call.p.xp
    sz0 = None if state is None else xp.concat([state.S, state.z[..., None]], axis=-1)
    wq, wk, wv, wdo = (xp.astype(x, p.work_dtype, copy=False)
                       for x in (phi_q, phi_k, v, do))
    with entry(xp):
        wk, wv, bad = _drop_bad(causal, key_mask, wk, wv)
        grads = reference.kernel_attention_vjp(
            wq, wk, wv, wdo, causal=causal, key_mask=key_mask, method=call.method,
            chunk_size=call.chunk_size, eps=call.eps, state=sz0, normalize=True)
        if bad is not None:
            grads = reference.poison_prefix_grads(grads, bad, p.n, queries=("phi_q",))
    args = {"phi_q": phi_q, "phi_k": phi_k, "v": v}
    out = {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}
    if state is not None:
        ds = grads["state"]
        out["state"] = LinearAttentionState(ds[..., :-1], ds[..., -1], state.num_tokens,
                                            state.feature_map)
    return out


feature_attention_vjp.argument_names = ("phi_q", "phi_k", "v")


def efficient_attention_vjp(q, k, v, do, /, *, causal=False, key_mask=None):
    """``{"q", "k", "v"}`` of :func:`~arrayattn.efficient_attention`."""
    p = check_efficient(q, k, v, causal=causal, key_mask=key_mask).p
    xp = p.xp
    args = {"q": q, "k": k, "v": v}
    if p.s == 0:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in args.items()}
    wq, wk, wv, wdo = (xp.astype(x, p.work_dtype, copy=False) for x in (q, k, v, do))
    with entry(xp):
        grads = reference.efficient_attention_vjp(wq, wk, wv, wdo, key_mask=key_mask)
    return {name: sum_to_shape(g, args[name].shape) for name, g in grads.items()}
