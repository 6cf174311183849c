"""The backward adapters of :func:`arrayattn.linformer_attention` and of its uniform call
(``linformer``).  The equations are in :mod:`arrayattn.reference.linformer_vjp`.

Cotangents: ``q``, ``k``, ``v``, and ``e`` / ``f`` when the caller passed them (a
replayed projection is a parameter: its gradient is useful).  A projection drawn from
``seed`` is a constant of the forward and gets none; so does a host NumPy ``e``/``f``
that the uniform call moves to another library's ``q`` (pass it in ``q``'s library to
get its cotangent).  With ``e`` and no ``f`` (``F = E``) the cotangent of ``e`` holds
both the key and the value terms.
"""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..lowrank.linformer import checked_linformer, host_to_q
from ..reference.exact_vjp import sum_to_shape

__all__ = ["linformer_attention_vjp", "linformer_call_vjp"]


def linformer_attention_vjp(q, k, v, do, /, *, e=None, f=None, proj_dim=256, seed=0,
                            scale=None, key_mask=None, causal=False):
    """``{"q", "k", "v"[, "e"][, "f"]}`` of :func:`~arrayattn.linformer_attention`."""
    call = checked_linformer(q, k, v, e=e, f=f, proj_dim=proj_dim, seed=seed, scale=scale,
                             key_mask=key_mask, causal=causal)
    p = call.p
    xp = p.xp
    args = {"q": q, "k": k, "v": v, "e": e, "f": f}
    args = {name: x for name, x in args.items() if x is not None}
    if p.s == 0:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in args.items()}
    wq, wk, wv, wdo = (xp.astype(x, p.work_dtype, copy=False) for x in (q, k, v, do))
    with entry(xp):
        grads = reference.linformer_attention_vjp(wq, wk, wv, call.e, call.f, wdo,
                                                  scale=call.scale, key_mask=key_mask,
                                                  projections=e is not None)
    if e is not None and f is None:                  # F = E: both terms are E's
        grads["e"] = grads["e"] + grads.pop("f")
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}


def linformer_call_vjp(q, k, v, do, /, *, e=None, f=None, **options):
    """The uniform call's backward: host NumPy ``e``/``f`` are moved to ``q``'s library
    as the forward moves them, and are then constants (no cotangent)."""
    moved_e, moved_f = host_to_q(q, e), host_to_q(q, f)
    grads = linformer_attention_vjp(q, k, v, do, e=moved_e, f=moved_f, **options)
    for name, given, moved in (("e", e, moved_e), ("f", f, moved_f)):
        if moved is not given:
            grads.pop(name, None)
    return grads


def _output(options):
    """The arrays besides ``q, k, v`` whose batch axes broadcast into the output, and the
    output's last axis (``v``'s)."""
    return {name: options.get(name) for name in ("e", "f")}, None


linformer_attention_vjp.output = linformer_call_vjp.output = _output
