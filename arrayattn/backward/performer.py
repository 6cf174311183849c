"""The backward adapter of :func:`arrayattn.performer_attention` (``performer_positive``,
``performer_hyperbolic``, ``performer_trig``, ``performer_favorpp``, ``performer_relu``)
and of the registry's uniform call (``omega=``).  The equations are in
:mod:`arrayattn.reference.performer_vjp`; the projection is a constant of the forward
(drawn from ``seed``, or the caller's ``features`` / ``omega``) and gets no cotangent."""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..random_features.calls import checked_performer
from ..random_features.projection import RandomFeatures
from ..reference.exact_vjp import sum_to_shape

__all__ = ["performer_attention_vjp", "uniform_call_vjp"]


def performer_attention_vjp(q, k, v, do, /, *, features=None, num_features=None,
                            kind="positive", projection="orthogonal", norms="chi", seed=0,
                            scale=None, causal=False, key_mask=None, gerf_a=None):
    """``{"q", "k", "v"[, "gerf_a"]}`` of :func:`~arrayattn.performer_attention`.

    The stabilisers (max-shifts, causal bounds) are held constant: the output does not
    depend on them.  ``kind="favor++"`` without ``gerf_a``: the optimal ``A*`` depends
    on ``q`` and every unmasked key and is differentiated (chained into ``dq``, ``dk``);
    an array ``gerf_a`` gets its own cotangent, a float none.
    """
    call = checked_performer(
        q, k, v, features=features, num_features=num_features, kind=kind,
        projection=projection, norms=norms, seed=seed, scale=scale, causal=causal,
        key_mask=key_mask, gerf_a=gerf_a)
    p, kind, scale, causal = call.p, call.kind, call.scale, call.causal
    xp, wd = p.xp, p.work_dtype
    args = {"q": q, "k": k, "v": v}
    if kind == "favor++" and gerf_a is not None and hasattr(gerf_a, "shape"):
        args["gerf_a"] = gerf_a
    if p.empty:                    # (FAVOR++'s A* of no query would be NaN)
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in args.items()}
    wq, wk, wv, wdo = (xp.astype(x, wd, copy=False) for x in (q, k, v, do))
    # the forward's rule (arrayattn.core.pipeline.working): masked keys zeroed; causal, a
    # non-finite key or value is dropped, its rows NaN
    wk, wv = reference.zero_masked_keys(key_mask, wk, wv)
    bad = reference.nonfinite_rows(wk, wv) if causal else None
    wk, wv = (wk, wv) if bad is None else reference.drop_nonfinite(bad, wk, wv)
    optimum = kind == "favor++" and call.gerf_a is None        # A* = A*(q, k)
    a = reference.gerf_optimum(wq, wk, scale=scale, key_mask=key_mask) if optimum else (
        call.gerf_a)
    omega = call.features.on(xp, dtype=wd, device=p.device)
    with entry(xp):
        grads = reference.performer_attention_vjp(wq, wk, wv, wdo, omega, kind=kind,
                                                  scale=scale, causal=causal,
                                                  key_mask=key_mask, gerf_a=a)
        if optimum:                                            # chain it
            dq, dk = reference.gerf_parameter_vjp(wq, wk, grads.pop("gerf_a"), scale=scale,
                                                  key_mask=key_mask)
            grads["q"], grads["k"] = grads["q"] + dq, grads["k"] + dk
        if bad is not None:
            grads = reference.poison_prefix_grads(grads, bad, p.n)
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}


def uniform_call_vjp(q, k, v, do, /, *, omega=None, **options):
    """The registry's uniform call: ``omega=`` (a caller's ``(m, d)`` matrix, a constant:
    no cotangent) replays that projection."""
    if omega is not None:
        if options.get("features") is not None:
            raise ValueError("pass either omega or features, not both")
        options["features"] = RandomFeatures.from_matrix(omega)
    return performer_attention_vjp(q, k, v, do, **options)
