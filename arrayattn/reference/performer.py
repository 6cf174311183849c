r"""Reference forms: Performer attention (FAVOR+ and its kin) through random features.

Choromanski et al. 2020, "Rethinking Attention with Performers" (ICLR 2021).  With
``x̃ = sqrt(scale) x`` and rows ``ω_f ~ N(0, I_d)`` of the projection ``omega (m, d)``,

.. math::

    \phi(x)_f = m^{-1/2} \exp(\omega_f\cdot\tilde x - \|\tilde x\|^2/2),\qquad
    \mathbb E[\phi(q)\cdot\phi(k)] = \exp(\tilde q\cdot\tilde k),

and the output is kernel attention on these features,
``φ(Q)(φ(K)^T V) / φ(Q)(φ(K)^T 1)`` (:func:`~arrayattn.reference.kernel_attention`).
Every factor removed from the features cancels in that ratio; nothing is added (no
``eps``, which would floor small kernels and bias the estimate):

* the constants ``m^-1/2`` (and FAVOR++'s ``D``) and each query's own factors;
* non-causal: the keys' largest exponent over the unmasked keys (one global factor);
* causal: a shift may not depend on other keys, so each key feature uses the bound
  ``ω_f·k̃ - ‖k̃‖²/2 <= c_f = ‖ω_f‖²/2``: ``exp(-‖k̃ - ω_f‖²/2) <= 1`` depends on that key
  alone, and ``exp(c_f)`` moves to the query side, which is then shifted by its row max.
"""
from __future__ import annotations

import math

from array_api_compat import array_namespace, device

from .masks import max_shift
from .kernel import kernel_attention

__all__ = ["favor_rows", "performer_features", "performer_attention", "gerf_optimum"]


def favor_rows(omega, *, kind, scale: float, gerf_a=None):
    r"""``(W, a, c)``: the exponents ``t_f(x) = W_f·x + a_f`` of the features and the
    bound ``c_f = max_x (t_f(x) - ‖x̃‖²/2) = a_f + ‖W_f‖² / (2 |scale|)``.

    positive: ``W = ω sqrt|scale|``; hyperbolic: ``[W, -W]``; trig: ``[W, W]`` with
    ``a = [0, π/2]`` (sin, cos); favor++ (GERF, Likhosherstov et al. 2022):
    ``W = sqrt(1 - 4A) ω sqrt|scale|``, ``a_f = A ‖ω_f‖²``; relu or a callable:
    ``W = ω sqrt|scale|``.  ``a`` and ``c`` are ``(..., 1, m')`` (or the float 0).
    """
    xp = array_namespace(omega)
    w, a = omega * math.sqrt(abs(scale)), 0.0
    if kind == "hyperbolic":
        w = xp.concat([w, -w], axis=0)
    elif kind == "trig":
        w, m = xp.concat([w, w], axis=0), omega.shape[0]
        a = xp.concat([xp.zeros((1, m), dtype=w.dtype, device=device(w)),
                       xp.full((1, m), math.pi / 2, dtype=w.dtype, device=device(w))],
                      axis=-1)
    elif kind == "favor++":     # gerf_a: a float or one A per batch element (..., 1, 1)
        w = w * (1 - 4 * gerf_a) ** 0.5
        a = (gerf_a if isinstance(gerf_a, float) else gerf_a[..., 0]) * xp.sum(
            omega * omega, axis=-1)
        a = xp.expand_dims(a, axis=-2)
    c = a + xp.expand_dims(xp.sum(w * w, axis=-1), axis=-2) / (2 * abs(scale))
    return w, a, c


def performer_features(q, k, omega, *, kind, scale: float, causal=False, key_mask=None,
                       gerf_a=None):
    r"""The stabilised features ``(φq, φk)`` of Performer attention: ``φq_i·φk_j`` is the
    random-feature estimate of ``exp(scale q_i·k_j)`` times a factor per query row and one
    global factor (both cancel in the attention ratio); masked keys' features are 0."""
    xp = array_namespace(q, k, omega)
    w, a, c = favor_rows(omega, kind=kind, scale=scale, gerf_a=gerf_a)
    q = -q if scale < 0 else q                      # exp(-|scale| q·k): negate one side
    tq, tk = q @ xp.matrix_transpose(w), k @ xp.matrix_transpose(w)   # (..., n|s, m')
    if not isinstance(a, float):                    # trig and favor++ offsets
        tq, tk = tq + a, tk + a
    hk = xp.sum(k * k, axis=-1, keepdims=True) * (abs(scale) / 2)      # ‖k̃‖²/2
    keep = None if key_mask is None else key_mask[..., None]

    def key_max(e):         # the max of e over the unmasked keys (0 when there are none)
        e = e if keep is None else xp.where(keep, e, -xp.inf)
        top = xp.max(e, axis=-2, keepdims=True)
        return max_shift(top)

    if kind == "trig":      # exp(‖x̃‖²/2) [sin, cos]: the query factor cancels; causal
        phi_q = xp.sin(tq)  # keeps exp(‖k̃‖²/2) unshifted (no key max over the future)
        phi_k = xp.sin(tk) * xp.exp(hk if causal else hk - key_max(hk))
    elif kind in ("positive", "hyperbolic", "favor++"):
        if causal:          # each key within its own bound c_f; exp(c_f) to the queries
            eq = tq + c
            phi_q = xp.exp(eq - xp.max(eq, axis=-1, keepdims=True))
            phi_k = xp.exp(tk - hk - c)
        else:
            phi_q = xp.exp(tq - xp.max(tq, axis=-1, keepdims=True))
            ek = tk - hk
            phi_k = xp.exp(ek - key_max(xp.max(ek, axis=-1, keepdims=True)))
    else:                   # generalized kernels f(ω·x̃): nothing to stabilise
        f = (lambda t: xp.maximum(t, 0.0)) if kind == "relu" else kind
        phi_q, phi_k = f(tq), f(tk)
    return phi_q, phi_k if keep is None else xp.where(keep, phi_k, 0.0)


def performer_attention(q, k, v, omega, *, kind="positive", scale: float, causal=False,
                        key_mask=None, gerf_a=None):
    r"""Performer attention ``φ(Q)(φ(K)^T V) / φ(Q)(φ(K)^T 1)`` with the features of
    :func:`performer_features` (a row with no visible key returns zeros)."""
    phi_q, phi_k = performer_features(q, k, omega, kind=kind, scale=scale, causal=causal,
                                      key_mask=key_mask, gerf_a=gerf_a)
    return kernel_attention(phi_q, phi_k, v, causal=causal, key_mask=key_mask, eps=0.0)[0]


def gerf_optimum(q, k, *, scale: float, key_mask=None):
    r"""FAVOR++'s variance-optimal ``A* (..., 1, 1)`` of these inputs (Likhosherstov et
    al. 2022): ``A* = (1 - 2ρ - sqrt((2ρ + 1)² + 8ρ)) / 16`` with
    ``ρ = (mean‖q̃‖² + mean‖k̃‖² + 2 q̄̃·k̄̃) / d`` over the real keys."""
    xp = array_namespace(q, k)
    root = math.sqrt(abs(scale))
    qt, kt = q * (-root if scale < 0 else root), k * root
    mq = xp.mean(xp.sum(qt * qt, axis=-1, keepdims=True), axis=-2, keepdims=True)
    qbar = xp.mean(qt, axis=-2, keepdims=True)
    if key_mask is None:
        mk = xp.mean(xp.sum(kt * kt, axis=-1, keepdims=True), axis=-2, keepdims=True)
        kbar = xp.mean(kt, axis=-2, keepdims=True)
    else:
        wgt = xp.astype(xp.expand_dims(key_mask, axis=-1), q.dtype)
        cnt = xp.maximum(xp.sum(wgt, axis=-2, keepdims=True), 1.0)
        kt = xp.where(xp.expand_dims(key_mask, axis=-1), kt, 0.0)   # NaN padding: no 0 * NaN
        mk = xp.sum(xp.sum(kt * kt, axis=-1, keepdims=True), axis=-2, keepdims=True) / cnt
        kbar = xp.sum(kt, axis=-2, keepdims=True) / cnt
    rho = (mq + mk + 2 * xp.sum(qbar * kbar, axis=-1, keepdims=True)) / q.shape[-1]
    return (1 - 2 * rho - xp.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16
