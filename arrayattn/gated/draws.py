"""The gates of the gated family that the library makes itself: RetNet's per-head decays
and the gates the registry's uniform calls draw from ``seed`` on the host."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from array_api_compat import array_namespace
from array_api_compat import device as xp_device

from ..core.checks import check_positive_int, check_seed
from ..core.xp import xp_from_host

__all__ = ["retention_gammas", "default_gammas", "drawn_gla_gates", "drawn_ssd_decays",
           "drawn_delta_betas", "drawn_gated_delta_gates", "UniformDraws", "GLA_DRAWS",
           "SSD_DRAWS", "DELTA_DRAWS", "GATED_DELTA_DRAWS"]


def retention_gammas(heads: int) -> np.ndarray:
    """RetNet's per-head decays ``gamma_h = 1 - 2^(-5 - h)``, ``h = 0 ... heads-1`` (Sun
    et al. 2023, section 2.2), as a host float64 array.

    Examples
    --------
    >>> from arrayattn import retention_gammas
    >>> retention_gammas(3).tolist()
    [0.96875, 0.984375, 0.9921875]
    """
    return 1.0 - 2.0 ** (-5.0 - np.arange(check_positive_int("heads", heads)))


def default_gammas(q, options: dict) -> dict:
    """RetNet's per-head decays for ``q``'s heads, resolved before grouped-query heads
    split them (query head ``h`` keeps ``gamma_h``): the registry's ``prepare``."""
    if options.get("gamma") is not None or getattr(q, "ndim", 0) < 3 or q.shape[-3] == 0:
        return options
    xp = array_namespace(q)
    wd = q.dtype if xp.isdtype(q.dtype, "real floating") else xp.float64
    gammas = xp_from_host(xp, retention_gammas(q.shape[-3]), dtype=wd, device=xp_device(q))
    return {**options, "gamma": gammas}


def _draw(q, shape, seed, fn):
    """``fn(rng)`` of ``shape`` drawn with ``numpy.random.default_rng(seed)`` in float64,
    moved to ``q``'s library and device in ``q``'s dtype."""
    xp = array_namespace(q)
    host = fn(np.random.default_rng(check_seed(seed)), shape)
    return xp_from_host(xp, host, dtype=q.dtype, device=xp_device(q))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def drawn_gla_gates(q, seed):
    """``gla``'s gates: ``log sigmoid(N(3, 1))`` per token and key dimension."""
    return _draw(q, q.shape, seed, lambda r, s: _log_sigmoid(r.standard_normal(s) + 3.0))


def drawn_ssd_decays(q, seed):
    """``ssd``'s log decays: ``-exp(N(-2.5, 0.5))`` per token."""
    return _draw(q, q.shape[:-1], seed, lambda r, s: -np.exp(r.normal(-2.5, 0.5, s)))


def drawn_delta_betas(q, seed):
    """``deltanet``'s writing strengths: ``sigmoid(N(0, 1))`` per token."""
    return _draw(q, q.shape[:-1], seed, lambda r, s: _sigmoid(r.standard_normal(s)))


def drawn_gated_delta_gates(q, seed):
    """``gated_deltanet``'s ``(beta, g)``: ``sigmoid(N(0, 1))`` and
    ``log sigmoid(N(3, 1))`` per token, in that draw order."""
    bg = _draw(q, q.shape[:-1], seed, lambda r, s: np.stack([
        _sigmoid(r.standard_normal(s)), _log_sigmoid(r.standard_normal(s) + 3.0)]))
    return bg[0, ...], bg[1, ...]


@dataclass(frozen=True)
class UniformDraws:
    """What a registry call draws from ``seed``: ``draws(q, seed=0) -> {option: array}``,
    the options ``names`` in that order, from ``fn(q, seed)``.  Passing them back
    (``rec(q, k, v, **rec.draws(q))``) is the same call; under ``jax.jit`` they are
    then arguments, where drawn inside the traced call they would be constants of the
    program (XLA copies and hashes them: 32 MB for gla's gates at ``(1, 8, 16384, 64)``)."""

    names: tuple
    fn: Callable

    def __call__(self, q, seed=0) -> dict:
        out = self.fn(q, seed)
        return dict(zip(self.names, out if len(self.names) > 1 else (out,)))


GLA_DRAWS = UniformDraws(("g",), drawn_gla_gates)
SSD_DRAWS = UniformDraws(("a",), drawn_ssd_decays)
DELTA_DRAWS = UniformDraws(("beta",), drawn_delta_betas)
GATED_DELTA_DRAWS = UniformDraws(("beta", "g"), drawn_gated_delta_gates)
