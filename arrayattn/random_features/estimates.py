r"""Random-feature estimates of the softmax kernel ``exp(scale q·k)`` and their closed-form
variance (the projection is :mod:`arrayattn.random_features.projection`, the kinds
:mod:`arrayattn.random_features.kinds`)."""
from __future__ import annotations

import math

from ..core.engine import entry
from ..core.checks import check_choice, check_positive_int, check_qkv, check_scale
from .kinds import check_kind, feature_parts, log_constant, resolve_gerf_a
from .projection import RandomFeatures, as_features
from ..reference import favor_rows
# moved (kept importable from here): the projection, the kinds, the option values
from ..kernel.checks import MAX_OMEGA_BYTES, NORMS, PROJECTIONS
from .kinds import EXP_KINDS, FEATURE_KINDS, gerf_parameter

__all__ = ["estimate_kernel", "kernel_variance",
           # moved; re-exported
           "RandomFeatures", "gerf_parameter", "FEATURE_KINDS", "as_features", "check_kind",
           "resolve_gerf_a"]


def estimate_kernel(q, k, features, /, *, kind="positive", scale=None, gerf_a=None,
                    key_mask=None):
    r"""The random-feature estimate ``φ(q) φ(k)^T`` of the softmax kernel, as a dense matrix.

    .. math::

        \widehat K_{ij} = \phi(q_i)\cdot\phi(k_j) \approx \exp(\mathrm{scale}\; q_i\cdot k_j)

    with, for ``x̃ = sqrt(scale) x`` and the rows ``ω_f`` of ``features``,

    * ``"positive"``: ``φ(x)_f = m^{-1/2} exp(ω_f·x̃ - ‖x̃‖²/2)`` (FAVOR+, positive and
      unbiased);
    * ``"hyperbolic"``: ``φ(x) = (2m)^{-1/2} exp(-‖x̃‖²/2) [exp(ω x̃), exp(-ω x̃)]``
      (``2m`` features, positive, unbiased, lower variance);
    * ``"trig"``: ``φ(x) = m^{-1/2} exp(‖x̃‖²/2) [sin(ω x̃), cos(ω x̃)]`` (``2m`` features,
      unbiased, **may be negative**);
    * ``"favor++"``: ``φ(x)_f = m^{-1/2} (1-4A)^{d/4} exp(A‖ω_f‖² + sqrt(1-4A) ω_f·x̃ -
      ‖x̃‖²/2)`` (GERF, Likhosherstov et al. 2022; positive, unbiased for any ``A < 1/4``,
      finite variance for ``A < 1/8``; ``A`` = ``gerf_a`` or the optimal
      :func:`gerf_parameter` of ``q, k``);
    * ``"relu"`` or a callable ``f``: the generalized kernels of the Performer paper,
      ``φ(x) = m^{-1/2} f(ω x̃)`` (``relu``: ``max(t, 0)``; ``f`` any elementwise array-API
      function) -- these estimate ``E[f(ω·q̃) f(ω·k̃)]``, not the softmax kernel.

    Meant for diagnostics and tests (it forms the ``(..., n, s)`` matrix).  Products are
    formed as ``(b_q b_k^T) exp(l_q + l_k)`` with bounded bodies ``b``, so an entry is
    finite whenever the estimate itself is representable.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    features : RandomFeatures or array ``(m, d)``
        The projection (an array is wrapped with :meth:`RandomFeatures.from_matrix`).
    kind : {"positive", "hyperbolic", "trig", "favor++", "relu"} or callable
    scale : float, optional
        ``None`` means ``1/sqrt(d)``; a negative scale estimates ``exp(-|scale| q·k)``.
    gerf_a : float or array ``(..., 1, 1)``, optional
        The GERF parameter of ``kind="favor++"``.
    key_mask : boolean array ``(..., s)``, optional
        The real keys: the optimal ``A`` of ``kind="favor++"`` is computed over them, and
        a masked key's column is 0 (its row of ``k`` is never read).

    Returns
    -------
    array, shape ``(..., n, s)``
        In the namespace, dtype and device of ``q`` (half precisions computed in float32).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import RandomFeatures, estimate_kernel
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 8)) * 0.5, rng.standard_normal((3, 8)) * 0.5
    >>> f = RandomFeatures.draw(8, 4096, seed=0)
    >>> est = estimate_kernel(q, k, f)
    >>> bool(np.allclose(est, np.exp(q @ k.T / np.sqrt(8)), rtol=0.1))
    True
    """
    p = check_qkv(q, k, k, names=("q", "k", "k"))
    kind = check_kind(kind)
    scale = check_scale(scale, p.d)
    features = as_features(features, p.d)
    xp = p.xp
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    gerf_a = resolve_gerf_a(xp, kind, gerf_a, q, k, scale, key_mask,
                            work_dtype=p.work_dtype, device=p.device)
    rows = favor_rows(omega, kind=kind, scale=scale, gerf_a=gerf_a)
    log_c = log_constant(xp, kind, features.m, p.d, gerf_a)
    wq = xp.astype(q, p.work_dtype, copy=False)
    if scale < 0:
        wq = -wq
    wk = xp.astype(k, p.work_dtype, copy=False)
    if key_mask is not None:   # padding may hold NaN: a masked key's column is 0
        wk = xp.where(xp.expand_dims(key_mask, axis=-1), wk, 0.0)
    with entry(xp):
        bq, lq = feature_parts(xp, wq, kind, rows, scale, log_c)
        bk, lk = feature_parts(xp, wk, kind, rows, scale, log_c)
        out = (bq @ xp.matrix_transpose(bk)) * xp.exp(lq + xp.matrix_transpose(lk))
    if key_mask is not None:
        out = xp.where(xp.expand_dims(key_mask, axis=-2), out, 0.0)
    return xp.astype(out, p.dtype, copy=False)


def kernel_variance(q, k, /, *, num_features, kind="positive", scale=None, gerf_a=None,
                    key_mask=None):
    r"""Closed-form variance of the ``m``-feature estimate of ``exp(scale q·k)``, iid ``ω``.

    Choromanski et al. 2020, Lemma 2 (and its hyperbolic analogue), with
    ``x = x̃_q``, ``y = x̃_k``, ``SM = exp(x·y)``:

    .. math::

        \mathrm{Var}_{\mathrm{positive}} &= \tfrac1m\, SM^2 \left(e^{\|x+y\|^2} - 1\right)\\
        \mathrm{Var}_{\mathrm{hyperbolic}} &= \tfrac1m\, SM^2
            \left(\cosh\|x+y\|^2 - 1\right)\\
        \mathrm{Var}_{\mathrm{trig}} &= \tfrac{1}{2m}\, e^{\|x\|^2+\|y\|^2}
            \left(1 - e^{-\|x-y\|^2}\right)^2\\
        \mathrm{Var}_{\mathrm{favor++}} &= \tfrac1m \left(\frac{(1-4A)^{d}}{(1-8A)^{d/2}}
            e^{\frac{2(1-4A)}{1-8A}\|x+y\|^2 - \|x\|^2 - \|y\|^2} - SM^2\right)

    (``m`` random rows, i.e. ``m`` features for positive and ``2m`` for the other two).
    Valid for ``projection="iid"``, ``norms="chi"``; orthogonal rows have lower variance
    (Theorem 2 of the paper; tested empirically).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    num_features : int
        ``m``, the number of random rows.
    kind : {"positive", "hyperbolic", "trig", "favor++"}
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    gerf_a, key_mask
        As in :func:`estimate_kernel` (``kind="favor++"`` only).

    Returns
    -------
    array, shape ``(..., n, s)``
        Variance of each entry of :func:`estimate_kernel`.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import kernel_variance
    >>> x = np.array([[1.0, 0.0]]); y = np.array([[0.0, 1.0]])
    >>> var = kernel_variance(x, y, num_features=10, scale=1.0)
    >>> bool(np.isclose(var[0, 0], (np.exp(2.0) - 1) / 10))  # x·y = 0, ‖x+y‖² = 2
    True
    """
    p = check_qkv(q, k, k, names=("q", "k", "k"))
    kind = check_choice("kind", kind, ("positive", "hyperbolic", "trig", "favor++"))
    scale = check_scale(scale, p.d)
    m = check_positive_int("num_features", num_features)
    xp = p.xp
    gerf_a = resolve_gerf_a(xp, kind, gerf_a, q, k, scale, key_mask,
                            work_dtype=p.work_dtype, device=p.device)
    wq = xp.astype(q, p.work_dtype, copy=False) * math.sqrt(abs(scale))
    if scale < 0:
        wq = -wq
    wk = xp.astype(k, p.work_dtype, copy=False) * math.sqrt(abs(scale))
    with entry(xp):
        xy = wq @ xp.matrix_transpose(wk)
    nq = xp.sum(wq * wq, axis=-1, keepdims=True)
    nk = xp.matrix_transpose(xp.sum(wk * wk, axis=-1, keepdims=True))
    if kind == "trig":
        diff = nq + nk - 2 * xy          # ‖x - y‖²
        out = xp.exp(nq + nk) * (-xp.expm1(-diff)) ** 2 / (2 * m)
    else:
        plus = nq + nk + 2 * xy          # ‖x + y‖²
        if kind == "favor++":
            a = gerf_a
            one, eight = 1 - 4 * a, 1 - 8 * a
            log_one = math.log(one) if isinstance(one, float) else xp.log(one)
            log_eight = math.log(eight) if isinstance(eight, float) else xp.log(eight)
            second = xp.exp(p.d * log_one - (p.d / 2) * log_eight
                            + 2 * one / eight * plus - nq - nk)
            out = (second - xp.exp(2 * xy)) / m
        elif kind == "positive":
            # SM² (e^{u} - 1) = exp(2xy + u) - exp(2xy), with expm1 for small u.
            out = xp.exp(2 * xy) * xp.expm1(plus) / m
        else:
            # cosh(u) - 1 = 2 sinh²(u/2)
            out = xp.exp(2 * xy) * 2 * xp.sinh(plus / 2) ** 2 / m
    return xp.astype(out, p.dtype, copy=False)
