r"""The rounding baseline of the referees: how far a plain, correct evaluation in a given
precision lands from the float64 reference, on *these* inputs.

A plain evaluation of attention in precision :math:`u` (the textbook order: scores, max
shift, exp, normalise, matmul) rounds every input and intermediate by a relative
:math:`u`.  To first order its error is the reference's response to those perturbations:
a logit :math:`S_{ij}` formed from :math:`q_i \cdot k_j` (plus a bias, an ALiBi term, a
soft cap) moves by about :math:`u\,|S_{ij}|`, so the output moves by
:math:`\sum_j P_{ij}\,\delta S_{ij}\,(v_j - o_i)` -- an error that grows with the spread of
the logits the kernel forms, the reduction lengths and, for gradients, the size of
``do``.  :func:`sensitivity` measures that response directly: it evaluates the float64
reference on inputs (and option arrays: biases, slopes, gates, states) perturbed by
random relative amounts of :data:`JITTER_SCALE` :math:`u`, :data:`JITTER_DRAWS` times,
and keeps the largest deviation.  Being the reference's own response, it holds for every
variant, for the output, the log-sum-exp and every gradient, and it does not depend on
one lucky or unlucky rounding pattern of a single evaluation.

The referees' tolerance is a multiple of ``max(sensitivity, own evaluation error,
eps |R|)``; ``docs/validating.rst`` derives it and gives the calibration against plain
float32 evaluations (``benchmarks/referee_calibration.py``).
"""
from __future__ import annotations

import numpy as np

from .measures import value_signs

__all__ = ["JITTER_SCALE", "HALF_JITTER_SCALE", "JITTER_DRAWS", "Jitter", "sensitivity",
           "logit_sizes", "logit_rounding", "key_group", "logit_scale"]

#: The perturbation, in units of the precision's unit roundoff ``u = eps / 2``: a plain
#: evaluation rounds each operand and each intermediate once, and a dot product of
#: length ``d`` accumulates up to ``~sqrt(d)`` roundings; calibrated on plain float32
#: evaluations (``benchmarks/referee_calibration.py``).
JITTER_SCALE = 2.0
#: The same for the ``same-dtype`` rule: half-precision inputs are exact in their dtype and
#: a plain half-precision evaluation (FlashAttention's ``attention_ref(upcast=False)``)
#: rounds each intermediate once; calibrated against it (its error is 0.65-0.85 of this
#: baseline, q, k of standard deviation 1 to 4 at d = 32).
HALF_JITTER_SCALE = 1.0
#: The share of the perturbation that values and output cotangents (``v``, ``do``) get: they
#: are exact inputs that only the products and sums after them round (the logits' inputs
#: ``q``, ``k`` stand for the rounding of a dot product of length ``d`` as well).
VALUE_SHARE = 0.5
#: Measure the response to rounding even where the verdict is already MATCH without it
#: (the referees skip it there: it can only raise the tolerance).  The calibration sets it
#: to report every tolerance in full.
MEASURE_ALWAYS = False
#: Independent perturbations; the baseline is the largest response among them.
JITTER_DRAWS = 3


class Jitter:
    """``x (1 + c u s)`` in float64 with random signs ``s`` (seeded: reproducible), never
    rounded away: ``u`` the unit roundoff of the precision whose rounding it stands for."""

    def __init__(self, eps: float, seed: int = 0, scale: float = JITTER_SCALE):
        self.u, self.rng, self.seed = scale * eps / 2, np.random.default_rng(seed), seed

    def __call__(self, x: np.ndarray, share: float = 1.0) -> np.ndarray:
        # signs by value, as a rounding: the same numbers in any layout move alike
        x = np.asarray(x, dtype=np.float64)
        return x * (1.0 + share * self.u * value_signs(x, self.seed))

    def named(self, name: str):
        """The perturbation of the array called ``name`` (:data:`VALUE_SHARE` of it for
        ``v`` and ``do``)."""
        share = VALUE_SHARE if name in ("v", "do") else 1.0
        return lambda x: self(x, share)


def sensitivity(evaluate, ref, eps: float, *, draws: int = JITTER_DRAWS, seed: int = 1,
                scale: float = JITTER_SCALE):
    """Elementwise ``max_k |evaluate(Jitter(eps, seed + k, scale)) - ref|`` over ``draws``
    perturbations (``ref`` and the results: an array, or a dict of arrays keyed alike);
    positions where the reference is not finite get 0."""
    if isinstance(ref, dict):
        worst = {key: np.zeros(np.shape(r)) for key, r in ref.items()}
    else:
        worst = np.zeros(np.shape(ref))
    for k in range(draws):
        res = evaluate(Jitter(eps, seed + k, scale))
        if isinstance(ref, dict):
            for key in worst:
                worst[key] = np.maximum(worst[key], _deviation(res[key], ref[key]))
        else:
            worst = np.maximum(worst, _deviation(res, ref))
    return worst


def _deviation(res, ref) -> np.ndarray:
    res, ref = np.asarray(res, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    seen = np.isfinite(ref) & np.isfinite(res)
    with np.errstate(invalid="ignore"):
        return np.where(seen, np.abs(np.where(seen, res, 0.0) - np.where(seen, ref, 0.0)), 0.0)


def key_group(q, k) -> int:
    """Query heads per key head where ``k (..., h_k, s, d)`` has fewer heads than ``q
    (..., h, n, d)``, taken natively (query head ``i`` reads key head ``i // group``); 1
    otherwise (equal or broadcast heads)."""
    if q.ndim >= 3 and k.ndim >= 3 and k.shape[-3] not in (1, q.shape[-3]) \
            and q.shape[-3] % k.shape[-3] == 0:
        return q.shape[-3] // k.shape[-3]
    return 1


def logit_scale(options: dict, d: int) -> float:
    """``|scale|`` of exact attention's logits: the option, else ``1 / sqrt(d)``."""
    scale = options.get("scale")
    return abs(float(scale)) if scale is not None else d ** -0.5


def logit_sizes(q, k, options: dict) -> np.ndarray:
    """``|x_ij|``, the magnitudes of the logits ``x = scale q_i . k_j`` (soft-capped) that
    exact attention forms, shape ``(..., n, s)`` (host float64; non-finite entries 0).
    ``q (..., h, n, d)``; ``k (..., h_k, s, d)`` with ``h_k`` dividing ``h`` (grouped
    heads: query head ``i`` reads key head ``i // (h / h_k)``), or a paged cache
    ``(num_blocks, page, h_k, d)`` when ``options`` has ``block_table``."""
    q, k = (np.nan_to_num(np.asarray(x, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
            for x in (q, k))
    table = options.get("block_table")
    if table is not None:                       # the cache's slots, in logical order
        table = np.asarray(table)
        k = np.take(k, table.reshape(-1), axis=0).reshape(
            table.shape[0], table.shape[1] * k.shape[1], *k.shape[2:]).transpose(0, 2, 1, 3)
    x = logit_scale(options, q.shape[-1]) * np.abs(
        q @ np.swapaxes(np.repeat(k, key_group(q, k), axis=-3), -1, -2))
    cap = options.get("softcap")
    return cap * np.tanh(x / cap) if cap else x


def logit_rounding(options: dict, q, k, jitter: Jitter, shift=None) -> dict:
    """``options`` with the rounding of the logits a kernel forms added to the bias: a
    random ``c u (|x_ij| + |shift_i|)`` on each logit (``c u`` the jitter's size).

    A plain evaluation rounds each logit after its dot product (the scale, a bias, a
    softcap: ``u |x_ij|`` each), which no relative perturbation of ``q`` and ``k``
    reproduces where the logits are large and aligned: a perturbation of ``q`` moves
    ``x_ij`` by ``u sqrt(sum_c (q_c k_c)^2)``, up to ``sqrt(d)`` times less than
    ``u |x_ij|`` when every term has one sign -- the sharp rows of trained heads, logits
    of 10^3, near-tied maxima.  ``shift (..., n)``: logits a convention forms larger by a
    per-row amount (FlashAttention's causal ALiBi ``+slope j``), rounded at that size."""
    size = jitter.u * logit_sizes(q, k, options)
    if shift is not None:
        size = size + jitter.u * np.abs(np.asarray(shift, dtype=np.float64))[..., None]
    noise = size * jitter.rng.choice([-1.0, 1.0], size=size.shape)
    bias = options.get("bias")
    return dict(options, bias=noise if bias is None else bias + noise)
