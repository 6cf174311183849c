"""Validation of the random-feature calls (Performer and RFA attention): each ``check_*``
validates one call once and returns its record, which the pipeline
(:mod:`arrayattn.core.pipeline`) and the backward adapters share.

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.checks import (Problem, broadcast_batch, check_choice, check_flag, check_key_mask,
                           check_positive_int, check_qkv, check_same_array_kind, check_scale,
                           check_seed)
from ..gated.checks import GATED_METHODS
from ..kernel.checks import CAUSAL_METHODS, NORMS, PROJECTIONS, check_eps, check_gerf_a
from .kinds import FEATURE_KINDS, check_kind
from .projection import RandomFeatures, as_features

__all__ = ["PerformerCall", "checked_performer", "RfaCall", "checked_rfa", "check_sigma",
           "check_rfa_gate", "drawn_features"]


# ---------------------------------------------------------------------------------------
# Random features: performer_attention, rfa_attention
# ---------------------------------------------------------------------------------------

def drawn_features(p: Problem, features, num_features, projection, norms, seed):
    """The projection of a random-feature call: the caller's ``features`` (a
    :class:`RandomFeatures` or an ``(m, d)`` matrix), else ``num_features`` rows drawn on
    the host from ``seed``."""
    if features is not None:
        return as_features(features, p.d)
    check_positive_int("num_features", num_features)
    check_choice("projection", projection, PROJECTIONS)
    check_choice("norms", norms, NORMS)
    return RandomFeatures.draw(p.d, num_features, projection=projection, norms=norms,
                               seed=check_seed(seed))


@dataclass(frozen=True)
class PerformerCall:
    """A validated :func:`~arrayattn.performer_attention` call: the feature ``kind``, the
    resolved ``scale``, the projection ``features`` and FAVOR++'s ``gerf_a`` (a float, an
    array ``(..., 1, 1)`` in the working dtype, or ``None``: the optimum ``A*`` of the
    inputs, or another kind)."""

    p: Problem
    key_mask: Any
    kind: Any
    scale: float
    causal: bool
    features: RandomFeatures
    gerf_a: Any = None

    @property
    def width(self) -> int:
        """The number of features (``2m`` for the hyperbolic and trig kinds)."""
        m = self.features.m
        return m * FEATURE_KINDS.get(self.kind, 1) if isinstance(self.kind, str) else m


def checked_performer(q, k, v, /, *, features=None, num_features=None, kind="positive",
                      projection="orthogonal", norms="chi", seed=0, scale=None,
                      causal=False, key_mask=None, gerf_a=None) -> PerformerCall:
    """Validate a :func:`~arrayattn.performer_attention` call once (shared with its
    backward), drawing the projection."""
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    kind = check_kind(kind)
    scale = check_scale(scale, p.d)
    causal = check_flag("causal", causal)
    if features is None:
        check_choice("projection", projection, PROJECTIONS)
        if num_features is None:
            num_features = p.d if projection == "identity" else 256
        check_positive_int("num_features", num_features)
        check_choice("norms", norms, NORMS)
        seed = check_seed(seed)
        if projection == "identity" and num_features != p.d:
            raise ValueError(
                f"projection='identity' (no random projection) has m = d = {p.d} rows; got "
                f"num_features={num_features} (pass num_features={p.d})")
        features = RandomFeatures.draw(p.d, num_features, projection=projection,
                                       norms=norms, seed=seed)
    else:
        features = as_features(features, p.d)
    gerf_a = check_gerf_a(p.xp, kind, gerf_a, work_dtype=p.work_dtype, causal=causal)
    return PerformerCall(p, key_mask, kind, scale, causal, features, gerf_a)


def check_sigma(sigma) -> float:
    """RFA's temperature: a finite number ``> 0``."""
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (
            math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0; got {sigma!r}")
    return float(sigma)


def check_rfa_gate(p: Problem, gate, q, batch):
    """RFA's gate as an array ``(..., n)`` in the working dtype (a float in ``[0, 1]`` is
    one gate for every position), and the batch broadcast with its leading axes."""
    xp = p.xp
    if isinstance(gate, (int, float)) and not isinstance(gate, bool):
        gate = float(gate)
        if not 0.0 <= gate <= 1.0:
            raise ValueError(f"gate must lie in [0, 1]; got {gate}")
        return xp.full((p.n,), gate, dtype=p.work_dtype, device=p.device), batch
    check_same_array_kind(xp, "q", q, "gate", gate)
    if not xp.isdtype(gate.dtype, "real floating"):
        raise TypeError(f"gate must have a real floating dtype; got {gate.dtype}")
    if gate.ndim < 1 or gate.shape[-1] not in (p.n, 1):
        raise ValueError(f"gate must have shape (..., n) or (..., 1) with n={p.n}; got "
                         f"shape {tuple(gate.shape)} (q {tuple(q.shape)})")
    batch = broadcast_batch([("inputs", batch), ("gate", tuple(gate.shape[:-1]))])
    return xp.astype(gate, p.work_dtype), batch


@dataclass(frozen=True)
class RfaCall:
    """A validated :func:`~arrayattn.rfa_attention` call.  ``gate`` (working dtype) and
    ``batch`` (the inputs' batch broadcast with the key mask's and the gate's) only for
    the gated recurrence; ``method`` is resolved (``None`` -> ``"chunked"``)."""

    p: Problem
    key_mask: Any
    sigma: float
    causal: bool
    chunk_size: int
    method: str
    gate: Any
    batch: tuple | None
    features: RandomFeatures
    eps: float


def checked_rfa(q, k, v, /, *, num_features=128, seed=0, sigma=1.0, causal=False, gate=None,
                key_mask=None, features=None, projection="iid", norms="chi", method=None,
                chunk_size=64, eps=None) -> RfaCall:
    """Validate an :func:`~arrayattn.rfa_attention` call once (shared with its backward),
    drawing the projection."""
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    sigma = check_sigma(sigma)
    causal = check_flag("causal", causal)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    g = batch = None
    if gate is not None:
        if not causal:
            raise ValueError("gate is the causal recurrence S_t = g_t S_(t-1) + (1 - g_t) "
                             "phi(k_t) v_t^T; pass causal=True")
        if p.n != p.s:
            raise ValueError(f"gate requires n = s (one gate per token of a self-attention "
                             f"sequence); got q {tuple(q.shape)}, k {tuple(k.shape)}")
        method = "chunked" if method is None else check_choice("method", method,
                                                               GATED_METHODS)
        batch = p.batch if key_mask is None else broadcast_batch(
            [("inputs", p.batch), ("key_mask", tuple(key_mask.shape[:-1]))])
        g, batch = check_rfa_gate(p, gate, q, batch)
    elif method is not None:
        check_choice("method", method, CAUSAL_METHODS)
    features = drawn_features(p, features, num_features, projection, norms, seed)
    eps = check_eps(eps, p.xp, p.work_dtype)
    return RfaCall(p, key_mask, sigma, causal, chunk_size, method or "chunked", g, batch,
                   features, eps)
