"""Validation of gated and delta-rule attention (retention, GLA, SSD, DeltaNet, gated
DeltaNet): their gates, decays, initial states and options, checked once into a
:class:`GatedCall`.

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
``scale=None`` means *no scale* here (``q`` is used as given), not ``1/sqrt(d)`` as in the
rest of the library: fla's gated kernels take the scale explicitly.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .draws import retention_gammas
from ..core.checks import (Problem, check_array, check_choice, check_flag, check_key_mask,
                           check_positive_int, check_qkv, check_same_array_kind)
from ..core.xp import host_values, xp_from_host

__all__ = ["GATED_METHODS", "GatedCall", "check_gate", "check_decays",
           "check_initial_state", "check_gamma", "check_gated_scale", "log_gamma_gates",
           "checked_gated", "check_retention", "check_gla", "check_ssd", "check_delta",
           "check_gated_delta", "drawn_check", "broadcasts_to"]

#: The forms of gated and delta-rule attention.
GATED_METHODS = ("chunked", "recurrent")


@dataclass(frozen=True)
class GatedCall:
    """A validated call of the gated family.

    ``g (..., n, 1 | dk)``: log gates in the working dtype (one per token, or per token and
    key dimension: GLA); ``beta (..., n)``: the delta rule's writing strengths in the
    working dtype, ``None`` for the additive (gated) update; ``scale``: a float or ``None``
    (no scale); ``initial_state``: ``S_0 (*batch, dk, dv)`` in the working dtype."""

    p: Problem
    key_mask: Any
    g: Any
    beta: Any
    method: str
    chunk_size: int
    scale: float | None
    initial_state: Any
    return_state: bool
    normalize_qk: bool


def broadcasts_to(lead: tuple, batch: tuple) -> bool:
    """Whether leading axes ``lead`` broadcast to ``batch`` (without growing it)."""
    return len(lead) <= len(batch) and all(
        a in (1, b) for a, b in zip(reversed(lead), reversed(batch)))


def check_gate(p: Problem, name: str, x, q, *, per_dim: bool):
    """A real floating gate array ``(..., n)`` (``per_dim=False``) or ``(..., n, dk)``,
    broadcastable to the batch; returned in the working dtype as ``(..., n, 1)`` or
    ``(..., n, dk)``."""
    check_array(name, x)
    check_same_array_kind(p.xp, "q", q, name, x)
    if not p.xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype; got {x.dtype}")
    tail = (p.n, p.d) if per_dim else (p.n,)
    want = "(..., n, dk) = (..., %d, %d)" % tail if per_dim else f"(..., n) = (..., {p.n})"
    lead = tuple(x.shape[:x.ndim - len(tail)])
    if (x.ndim < len(tail) or tuple(x.shape[x.ndim - len(tail):]) != tail
            or not broadcasts_to(lead, p.batch)):
        raise ValueError(f"{name} must have shape {want} broadcastable to the batch "
                         f"{p.batch}; got shape {tuple(x.shape)}")
    x = p.xp.astype(x, p.work_dtype, copy=False)
    return x if per_dim else x[..., None]


def check_decays(host, shown):
    """Retention's decays must lie in ``(0, 1]`` (a NaN or a growth is refused here,
    not turned into NaN outputs)."""
    if not np.all((host > 0) & (host <= 1)):
        bad = host[~((host > 0) & (host <= 1))].ravel()[:4]
        raise ValueError(f"gamma must be decays in (0, 1]; got {shown!r} (entries such as "
                         f"{bad.tolist()})")


def check_initial_state(p: Problem, state, q):
    """``initial_state (..., dk, dv)`` broadcast to ``(*batch, dk, dv)`` in the working
    dtype; ``None`` is zeros."""
    zeros = p.xp.zeros((*p.batch, p.d, p.dv), dtype=p.work_dtype, device=p.device)
    if state is None:
        return zeros
    check_array("initial_state", state)
    check_same_array_kind(p.xp, "q", q, "initial_state", state)
    if not p.xp.isdtype(state.dtype, "real floating"):
        raise TypeError(f"initial_state must have a real floating dtype (it is not cast); "
                        f"got {state.dtype}")
    if (state.ndim < 2 or tuple(state.shape[-2:]) != (p.d, p.dv)
            or not broadcasts_to(tuple(state.shape[:-2]), p.batch)):
        raise ValueError(f"initial_state must have shape (..., dk, dv) broadcastable to the "
                         f"batch: (*{p.batch}, {p.d}, {p.dv}); got shape "
                         f"{tuple(state.shape)}")
    try:
        return zeros + p.xp.astype(state, p.work_dtype, copy=False)
    except Exception as exc:   # a batch that does not broadcast
        raise ValueError(f"initial_state of shape {tuple(state.shape)} does not broadcast "
                         f"to (*batch, dk, dv) = {(*p.batch, p.d, p.dv)}: its leading axes "
                         f"{tuple(state.shape[:-2])} must broadcast to the batch "
                         f"{p.batch}") from exc


def check_gamma(p: Problem, gamma, q):
    """Retention's decays, host numbers or an array ``(..., H)`` in ``(0, 1]``, as an array
    in the working dtype (a device array of a few decays is read once, like a list)."""
    xp = p.xp
    if isinstance(gamma, (numbers.Real, list, tuple, np.ndarray)):   # host numbers
        host = np.asarray(gamma)
        if isinstance(gamma, bool) or host.dtype.kind not in "iuf":
            raise TypeError(f"gamma must hold real numbers; got {gamma!r}")
        host = host.astype(np.float64)
        check_decays(host, gamma)
        out = xp_from_host(xp, host, dtype=p.work_dtype, device=p.device)
        return xp.reshape(out, host.shape)     # one number stays 0-d (any q's batch)
    check_array("gamma", gamma)
    check_same_array_kind(xp, "q", q, "gamma", gamma)
    if not xp.isdtype(gamma.dtype, ("real floating", "integral")):
        raise TypeError(f"gamma must hold real numbers; got dtype {gamma.dtype}")
    host = host_values(gamma)
    if host is not None:
        check_decays(host, f"an array of shape {tuple(gamma.shape)}")
    return xp.astype(gamma, p.work_dtype, copy=False)


def log_gamma_gates(p: Problem, gamma, q):
    """Retention's ``log gamma`` checked and laid out as one gate per token
    ``(..., H, n, 1)``; ``gamma=None`` is RetNet's ``1 - 2^(-5 - h)`` over ``q``'s heads."""
    if gamma is None:     # (an empty batch of no heads takes one decay, for its shape)
        gamma = retention_gammas(max(q.shape[-3], 1) if q.ndim >= 3 else 1)
    # one gate per head: (..., H) -> (..., H, 1, 1), the same at every token
    g = p.xp.log(check_gamma(p, gamma, q))
    g = g[..., None, None] if g.ndim else g
    if g.ndim >= 3 and q.ndim >= 3 and g.shape[-3] not in (1, q.shape[-3]):
        raise ValueError(f"gamma has {g.shape[-3]} heads but q has {q.shape[-3]} "
                         f"(axis -3 of shape {tuple(q.shape)})")
    lead = tuple(g.shape[:-2]) if g.ndim >= 2 else ()
    try:
        fits = np.broadcast_shapes(lead, tuple(p.batch)) == tuple(p.batch)
    except ValueError:
        fits = False
    if not fits:   # e.g. a list of decays with a 2-D q, which has no heads axis
        raise ValueError(f"gamma of shape {tuple(g.shape[:-2])} gives one decay per head "
                         f"(its last axis is q's axis -3) and must broadcast to q's batch "
                         f"{tuple(p.batch)}; q has shape {tuple(q.shape)}"
                         + (" (no heads axis: pass one number as gamma)" if q.ndim < 3
                            else ""))
    return p.xp.zeros((p.n, 1), dtype=p.work_dtype, device=p.device) + g


def check_gated_scale(scale) -> float | None:
    """The gated family's ``scale``: a finite real number, or ``None`` for *no scale*
    (fla's convention for these kernels; elsewhere ``None`` is ``1/sqrt(d)``)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not np.isfinite(
            scale):
        raise ValueError(f"scale must be a finite number or None; got {scale!r}")
    return float(scale)


def checked_gated(q, k, v, *, causal, key_mask, method, chunk_size, scale, initial_state,
                  return_state, gate=None, beta=None, normalize_qk=False,
                  problem=None) -> GatedCall:
    """The family's checks (its backward's too), in this order: ``q, k, v`` (unless
    ``problem``, their :class:`Problem`, is given), ``beta``, the gate, ``normalize_qk``
    and the options.

    ``gate``: ``(name, array, per_dim)`` to check (:func:`check_gate`), log gates already
    laid out ``(..., n, 1 | dk)`` in the working dtype, or ``None`` (no decay: the delta
    rule).  ``beta``: ``(name, array)`` to check, writing strengths ``(..., n)`` already
    checked, or ``None`` (the additive update)."""
    p = check_qkv(q, k, v) if problem is None else problem
    if isinstance(beta, tuple):
        beta = check_gate(p, *beta, q, per_dim=False)[..., 0]
    if isinstance(gate, tuple):
        gate = check_gate(p, gate[0], gate[1], q, per_dim=gate[2])
    elif gate is None:
        gate = p.xp.zeros((p.n, 1), dtype=p.work_dtype, device=p.device)
    normalize_qk = check_flag("normalize_qk", normalize_qk)
    if not check_flag("causal", causal):
        raise ValueError("gated and delta-rule attention is causal (a recurrence over the "
                         "tokens); causal=False is not defined")
    if p.n != p.s:
        raise ValueError(f"gated and delta-rule attention needs n == s (self-attention "
                         f"over one sequence); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    check_key_mask(p, key_mask, q)
    method = check_choice("method", method, GATED_METHODS)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    return_state = check_flag("return_state", return_state)
    scale = check_gated_scale(scale)
    return GatedCall(p, key_mask, gate, beta, method, chunk_size, scale,
                     check_initial_state(p, initial_state, q), return_state, normalize_qk)


def check_retention(q, k, v, /, *, gamma, problem=None, **options) -> GatedCall:
    """:func:`~arrayattn.retention`'s call: ``q, k, v``, then ``gamma``, then the rest."""
    p = check_qkv(q, k, v) if problem is None else problem
    return checked_gated(q, k, v, gate=log_gamma_gates(p, gamma, q), problem=p, **options)


def check_gla(q, k, v, /, *, g, **options) -> GatedCall:
    """:func:`~arrayattn.gla_attention`'s call (``g (..., n, dk)``)."""
    return checked_gated(q, k, v, gate=("g", g, True), **options)


def check_ssd(q, k, v, /, *, a, **options) -> GatedCall:
    """:func:`~arrayattn.ssd_attention`'s call (``a (..., n)``)."""
    return checked_gated(q, k, v, gate=("a", a, False), **options)


def check_delta(q, k, v, /, *, beta, **options) -> GatedCall:
    """:func:`~arrayattn.delta_attention`'s call (``beta (..., n)``, no decay)."""
    return checked_gated(q, k, v, beta=("beta", beta), **options)


def check_gated_delta(q, k, v, /, *, beta, g, **options) -> GatedCall:
    """:func:`~arrayattn.gated_delta_attention`'s call (``beta``, then ``g (..., n)``)."""
    return checked_gated(q, k, v, beta=("beta", beta), gate=("g", g, False), **options)


def drawn_check(public: Callable, check: Callable, draw: Callable) -> Callable:
    """The check of a registry call that draws its gates: ``q, k, v`` checked once, then
    ``draw(q, seed) -> {gate name: array}`` unless the caller gave every one of those
    gates (``draw.names``, as :class:`~arrayattn.jit_uniform` hands the record's
    ``draws`` to a ``jax.jit``; a gate given wins over its draw), then ``check`` with
    ``public``'s defaults for the options not given.  An option ``public`` does not take is the ``TypeError``
    ``public`` raises."""
    params = inspect.signature(public).parameters.values()
    defaults = {x.name: x.default for x in params if x.kind is x.KEYWORD_ONLY}

    def checked(q, k, v, /, *, seed=0, **options) -> GatedCall:
        p = check_qkv(q, k, v)
        if not all(name in options for name in draw.names):
            options = {**draw(q, seed), **options}
        for name in options.keys() - defaults.keys() - set(draw.names):
            raise TypeError(f"{public.__name__}() got an unexpected keyword argument "
                            f"{name!r}")
        return check(q, k, v, **{**defaults, **options}, problem=p)
    checked.__name__ = f"check_{public.__name__}_drawn"
    return checked
