"""The backward adapter of :func:`arrayattn.rfa_attention` (``rfa``), plain and gated.
The equations are in :mod:`arrayattn.reference.rfa_vjp`; the projection is a constant of
the forward (drawn from ``seed``, or the caller's ``features``) and gets no cotangent;
an array ``gate`` gets its cotangent under ``"gate"``."""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..reference.exact_vjp import sum_to_shape
from ..random_features.calls import checked_rfa

__all__ = ["rfa_attention_vjp"]


def rfa_attention_vjp(q, k, v, do, /, *, num_features=128, seed=0, sigma=1.0,
                      causal=False, gate=None, key_mask=None, features=None,
                      projection="iid", norms="chi", method=None, chunk_size=64, eps=None):
    """``{"q", "k", "v"[, "gate"]}`` of :func:`~arrayattn.rfa_attention`.  Every causal
    ``method`` shares one chunked backward (the forms compute one function)."""
    call = checked_rfa(
        q, k, v, num_features=num_features, seed=seed, sigma=sigma, causal=causal,
        gate=gate, key_mask=key_mask, features=features, projection=projection, norms=norms,
        method=method, chunk_size=chunk_size, eps=eps)
    p, causal, g, batch, features = call.p, call.causal, call.gate, call.batch, call.features
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
    bad = None
    if causal:     # the forward's rule: a non-finite key, value or gate is dropped
        extra = () if g is None else (g[..., None],)
        bad = reference.nonfinite_rows(wk, wv, *extra)
        wk, wv, *rest = reference.drop_nonfinite(bad, wk, wv, *extra)
        g = g if g is None else rest[0][..., 0]
    with entry(xp):
        grads = reference.rfa_attention_vjp(
            wq, wk, wv, wdo, omega, sigma=call.sigma, causal=causal, gate=g,
            key_mask=key_mask, method=call.method, chunk_size=call.chunk_size, eps=call.eps)
        if bad is not None:
            grads = reference.poison_prefix_grads(grads, bad, p.n)
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}
