"""The feature kinds of random-feature attention (positive, hyperbolic, trig, FAVOR++'s GERF,
generalized ``f(ω·x̃)``): their widths, their bounded parts and FAVOR++'s parameter."""
from __future__ import annotations

import math

from ..core.checks import check_choice, check_qkv, check_scale
from ..kernel.checks import check_gerf_a
from ..reference.performer import gerf_optimum

__all__ = ["FEATURE_KINDS", "EXP_KINDS", "check_kind", "log_constant", "feature_parts",
           "gerf_parameter", "resolve_gerf_a"]

#: Feature maps, name -> number of features per random row.  The first four estimate the
#: softmax kernel; "relu" (like a caller's function f) is a generalized kernel f(ω·x̃).
FEATURE_KINDS = {"positive": 1, "hyperbolic": 2, "trig": 2, "favor++": 1, "relu": 1}
#: The kinds whose features are exponentials (positive, bounded by a per-row shift).
EXP_KINDS = ("positive", "hyperbolic", "favor++")

# ---------------------------------------------------------------------------------
# Feature maps.  Every map is  φ(x)_f = exp(κ) g(x·W_f + a_f, x)  with rows W (the random
# rows times sqrt(|scale|), and B for GERF), an additive term a_f, a constant κ, and g one of
#   exp kinds:   exp(t - ‖x̃‖²/2)        (positive, hyperbolic, favor++)
#   trig:        exp(‖x̃‖²/2) sin(t)     (a_f = 0 or π/2 gives sin and cos)
#   generalized: f(t)                    (relu, or a caller's function; a_f = 0)
# The rows are arrayattn.reference.favor_rows: they serve the dense diagnostic
# (estimate_kernel), the reference form and the NumPy engine.
# ---------------------------------------------------------------------------------


def check_kind(kind):
    """A registered kind name, or a caller's callable (a generalized kernel ``f(ω·x̃)``)."""
    if callable(kind):
        return kind
    return check_choice("kind", kind, tuple(FEATURE_KINDS))


def log_constant(xp, kind, m: int, d: int, gerf_a):
    """The log of the constant factor of ``φ`` per side: ``m^-1/2`` (hyperbolic:
    ``(2m)^-1/2``), and for favor++ also ``D = (1 - 4A)^{d/4}``."""
    log_c = -0.5 * math.log(2 * m if kind == "hyperbolic" else m)
    if kind == "favor++":
        one = 1 - 4 * gerf_a
        log_c = log_c + (d / 4) * (math.log(one) if isinstance(one, float) else xp.log(one))
    return log_c


def feature_parts(xp, x, kind, rows, scale: float, log_c):
    """``(b, l)`` with ``φ(x) = exp(l) b``: ``b (..., t, m')`` bounded (exp kinds: in
    ``(0, 1]``, trig: in ``[-1, 1]``), ``l (..., t, 1)`` a per-row log-factor; ``rows``
    from :func:`arrayattn.reference.favor_rows`."""
    w, a, _ = rows
    t = x @ xp.matrix_transpose(w) + a
    h = xp.sum(x * x, axis=-1, keepdims=True) * (abs(scale) / 2)
    if kind == "trig":
        return xp.sin(t), h + log_c
    if kind in EXP_KINDS:
        top = xp.max(t, axis=-1, keepdims=True)
        return xp.exp(t - top), top - h + log_c
    g = xp.maximum(t, 0.0) if kind == "relu" else kind(t)
    return g, xp.zeros_like(h) + log_c


def gerf_parameter(q, k, /, *, scale=None, key_mask=None):
    r"""The variance-optimal GERF parameter ``A*`` of FAVOR++ for these inputs.

    Likhosherstov et al. 2022, "Chefs' Random Tables: Non-Trigonometric Random Features"
    (NeurIPS 2022).  Minimising the log second moment averaged over all pairs,

    .. math::

        A^* = \frac{1 - 2\rho - \sqrt{(2\rho + 1)^2 + 8\rho}}{16},\qquad
        \rho = \frac{1}{d\, n s}\sum_{i,j} \|\tilde q_i + \tilde k_j\|^2
             = \frac{\overline{\|\tilde q\|^2} + \overline{\|\tilde k\|^2}
               + 2\,\bar{\tilde q}\cdot\bar{\tilde k}}{d}

    (computed in ``O((n + s) d)``; masked keys excluded).  ``A* <= 0``, with ``A* = 0``
    (plain FAVOR+) only when ``ρ = 0``.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    scale : float, optional
        ``None`` means ``1/sqrt(d)`` (``x̃ = sqrt(scale) x``).
    key_mask : boolean array, shape ``(..., s)``, optional
        Only the real keys enter the means.

    Returns
    -------
    array, shape ``(..., 1, 1)``
        One ``A`` per batch element, in the working dtype of ``q``.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import gerf_parameter
    >>> q = np.zeros((1, 3, 4)); k = np.zeros((1, 5, 4))
    >>> float(gerf_parameter(q, k)[0, 0, 0])
    0.0
    """
    p = check_qkv(q, k, k, names=("q", "k", "k"))
    xp = p.xp
    scale = check_scale(scale, p.d)
    return gerf_optimum(xp.astype(q, p.work_dtype, copy=False),
                        xp.astype(k, p.work_dtype, copy=False), scale=scale,
                        key_mask=key_mask)


def resolve_gerf_a(xp, kind, gerf_a, q, k, scale, key_mask, *, work_dtype, device,
                   causal=False):
    """``gerf_a`` for ``kind="favor++"``: the caller's (float or array), else ``A*`` of the
    inputs (non-causal only: it depends on every key).  ``None`` for other kinds."""
    a = check_gerf_a(xp, kind, gerf_a, work_dtype=work_dtype, causal=causal)
    if kind == "favor++" and a is None:
        return gerf_parameter(q, k, scale=scale, key_mask=key_mask)
    return a
