"""The backward adapter of :func:`arrayattn.rfa_attention` (``rfa``), plain and gated.
The equations are in :mod:`arrayattn.reference.rfa_vjp`; the projection is a constant of
the forward (drawn from ``seed``, or the caller's ``features``) and gets no cotangent;
an array ``gate`` gets its cotangent under ``"gate"``."""
from __future__ import annotations

from .. import reference
from .._engine import entry
from ..reference.exact_vjp import sum_to_shape
from ..rfa import checked_rfa

__all__ = ["rfa_attention_vjp"]


def rfa_attention_vjp(q, k, v, do, /, *, num_features=128, seed=0, sigma=1.0,
                      causal=False, gate=None, key_mask=None, features=None,
                      projection="iid", norms="chi", method=None, chunk_size=64, eps=None):
    """``{"q", "k", "v"[, "gate"]}`` of :func:`~arrayattn.rfa_attention`.  Every causal
    ``method`` shares one chunked backward (the forms compute one function)."""
    p, sigma, causal, chunk_size, method, g, batch, features, eps = checked_rfa(
        q, k, v, num_features=num_features, seed=seed, sigma=sigma, causal=causal,
        gate=gate, key_mask=key_mask, features=features, projection=projection, norms=norms,
        method=method, chunk_size=chunk_size, eps=eps)
    xp, wd = p.xp, p.work_dtype
    args = {"q": q, "k": k, "v": v}
    if gate is not None and hasattr(gate, "shape"):
        args["gate"] = gate
    if p.s == 0:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in args.items()}
    wq, wk, wv, wdo = (xp.astype(x, wd, copy=False) for x in (q, k, v, do))
    wk, wv = reference.zero_masked_keys(key_mask, wk, wv)   # padding may hold NaN / inf
    omega = features.on(xp, dtype=wd, device=p.device)
    if g is not None:
        g = xp.broadcast_to(g, (*batch, p.n))
    with entry(xp):
        grads = reference.rfa_attention_vjp(
            wq, wk, wv, wdo, omega, sigma=sigma, causal=causal, gate=g, key_mask=key_mask,
            method=method or "chunked", chunk_size=chunk_size, eps=eps)
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}
