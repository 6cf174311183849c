r"""Backward of Performer attention (FAVOR+ and its kin): the chain rule through the
random features, on top of the backward of kernel attention.

The forward (:mod:`arrayattn.reference.performer`) is kernel attention on features of
the exponents :math:`t_f(x) = W_f\cdot x + a_f` (rows ``W`` and offsets ``a`` of
:func:`~arrayattn.reference.favor_rows`), :math:`h(x) = \tfrac{|c|}{2}\|x\|^2`
(``c = scale``; a negative scale negates ``q``):

.. math::

    \text{exp kinds:}\ \phi_q = e^{t(q) - M_q},\ \phi_k = e^{t(k) - h(k) - M_k};\quad
    \text{trig:}\ \phi_q = \sin t(q),\ \phi_k = \sin t(k)\, e^{h(k) - M_k};\quad
    \text{relu, } f\text{:}\ \phi = f(t(x)).

With :math:`d\phi_q, d\phi_k, dV` from the backward of kernel attention
(:func:`~arrayattn.reference.kernel_attention_vjp`), the exponents' cotangents are

.. math::

    \text{exp kinds:}\ dt = d\phi\circ\phi;\quad
    \text{trig:}\ dt_q = d\phi_q \circ \cos t(q),\
    dt_k = d\phi_k \circ \cos t(k)\, e^{h(k) - M_k},\ dh_k = \operatorname{rowsum}(d\phi_k
    \circ \phi_k);\quad \text{relu:}\ dt = d\phi\circ[t > 0],

    dQ = \pm\, dt_q\, W,\qquad dK = dt_k\, W + |c|\, dh_k \circ K,\qquad
    dh_k = -\operatorname{rowsum}(dt_k)\ \text{(exp kinds)}.

**The stabilisers are constants.**  The shifts :math:`M_q` (each query row's largest
exponent), :math:`M_k` (the keys' largest, one number per batch element) and the
causal bounds :math:`c_f` (``+c_f`` on the query side, ``-c_f`` on the key side) leave
the output unchanged -- kernel attention is invariant under a factor per query row, one
factor on all keys, and a factor per feature on the queries balanced by its inverse on
the keys -- so their total derivative is zero and the backward takes them as constants
(stop-gradient).  Autodiff through the forward, which differentiates through the
maxima, agrees to rounding (the terms it adds sum to zero).  The query-side factors that
the forward drops (:math:`e^{-\|\tilde q\|^2/2}`, :math:`e^{\|\tilde q\|^2/2}`,
:math:`m^{-1/2}`, FAVOR++'s ``D``) are per-row or global and cancel the same way.

**FAVOR++** (GERF): :math:`W = B W_0`, :math:`B = \sqrt{1 - 4A}`, :math:`a_f = A
\|\omega_f\|^2`, :math:`W_0 = \omega \sqrt{|c|}`.  ``A`` does *not* cancel, so it gets a
cotangent :math:`dA = \sum_{x, f} dt_f(x)\,(-\tfrac{2}{B} W_{0f}\cdot x + \|\omega_f\|^2)`
(over queries and keys), returned as ``"gerf_a"``.  When ``A`` is the data-dependent
optimum :math:`A^*(\rho)` of :func:`arrayattn.gerf_parameter`, the caller chains it
into ``q`` and ``k`` with :func:`gerf_parameter_vjp`:

.. math::

    \frac{dA^*}{d\rho} = -\frac18\Big(1 + \frac{2\rho + 3}{\sqrt{(2\rho + 1)^2 + 8\rho}}
    \Big),\quad \rho = \frac{\overline{\|\tilde q\|^2} + \overline{\|\tilde k\|^2}
    + 2\bar{\tilde q}\cdot\bar{\tilde k}}{d},\quad
    d\tilde q_i = \frac{2 d\rho}{d\, n}(\tilde q_i + \bar{\tilde k}),\
    d\tilde k_j = \frac{2 d\rho}{d\, s'}(\tilde k_j + \bar{\tilde q})

(``s'`` the number of real keys; a masked key gets 0).

**Not differentiated**: the projection ``ω`` -- drawn from ``seed``, or a caller's
matrix (``features=`` / ``omega=``) -- is a constant of the forward and gets no
cotangent.  ``relu`` at ``t = 0`` takes the slope 0; a caller's ``f`` is differentiated
by a central difference (no symbolic derivative; error ``~eps^(2/3)`` relative).

Array API only, no host reads, no in-place updates.
"""
from __future__ import annotations

import math

from array_api_compat import array_namespace

from .masks import max_shift
from .kernel_vjp import kernel_attention_vjp
from .performer import favor_rows, performer_features

__all__ = ["performer_features_vjp", "performer_attention_vjp", "gerf_parameter_vjp"]


def _slope(f, t):
    """``f'(t)`` of a caller's elementwise ``f`` by a central difference, step
    ``eps^(1/3) max(1, |t|)`` (error ``~eps^(2/3)`` relative)."""
    xp = array_namespace(t)
    eps = float(xp.finfo(t.dtype).eps)
    h = eps ** (1 / 3) * xp.maximum(xp.abs(t), 1.0)
    return (f(t + h) - f(t - h)) / (2.0 * h)


def _key_max(xp, e, keep):
    """The max of ``e`` over the unmasked keys (0 when there are none), as the forward."""
    e = e if keep is None else xp.where(keep, e, -xp.inf)
    top = xp.max(e, axis=-2, keepdims=True)
    return max_shift(top)


def performer_features_vjp(q, k, omega, phi_q, phi_k, dphi_q, dphi_k, *, kind,
                           scale: float, causal=False, key_mask=None, gerf_a=None):
    r"""``(dq, dk, dA)``: the cotangents of ``q``, ``k`` (and of FAVOR++'s ``A`` when it
    is an array, else ``None``) from those of the features ``(phi_q, phi_k)`` of
    :func:`~arrayattn.reference.performer_features`, the stabilisers held constant
    (equations in the module docstring).  ``dA`` has the broadcast batch shape
    ``(..., 1, 1)``."""
    xp = array_namespace(q, k, omega, dphi_q, dphi_k)
    w, a, _ = favor_rows(omega, kind=kind, scale=scale, gerf_a=gerf_a)
    sign = -1.0 if scale < 0 else 1.0
    qs = -q if scale < 0 else q
    keep = None if key_mask is None else key_mask[..., None]
    if keep is not None:                # a masked key's features are 0: no cotangent
        dphi_k = xp.where(keep, dphi_k, 0.0)
    if kind == "trig":     # phi_q = sin t_q;  phi_k = sin(t_k) e^(h_k - M_k)
        tq, tk = qs @ xp.matrix_transpose(w) + a, k @ xp.matrix_transpose(w) + a
        hk = xp.sum(k * k, axis=-1, keepdims=True) * (abs(scale) / 2)
        ek = xp.exp(hk if causal else hk - _key_max(xp, hk, keep))
        dtq = dphi_q * xp.cos(tq)
        dtk = dphi_k * xp.cos(tk) * ek
        dhk = xp.sum(dphi_k * phi_k, axis=-1, keepdims=True)
    elif kind in ("positive", "hyperbolic", "favor++"):     # phi = e^(t [- h] - shift)
        dtq, dtk = dphi_q * phi_q, dphi_k * phi_k
        dhk = -xp.sum(dtk, axis=-1, keepdims=True)
    else:                  # f(t): relu (slope 0 at t = 0) or a caller's f
        tq, tk = qs @ xp.matrix_transpose(w), k @ xp.matrix_transpose(w)
        if kind == "relu":
            sq, sk = (xp.astype(t > 0.0, t.dtype) for t in (tq, tk))
        else:
            sq, sk = _slope(kind, tq), _slope(kind, tk)
        dtq, dtk, dhk = dphi_q * sq, dphi_k * sk, None
    dq = sign * (dtq @ w)
    dk = dtk @ w if dhk is None else dtk @ w + (abs(scale) * dhk) * k
    if keep is not None:
        dk = xp.where(keep, dk, 0.0)
    da = None
    if kind == "favor++" and not isinstance(gerf_a, float):
        # t = B (x W0^T) + A |omega|^2:  dt/dA = -2/B (x W0^T) + |omega|^2
        w0 = omega * math.sqrt(abs(scale))
        dbda = -2.0 / xp.sqrt(1 - 4 * gerf_a)     # dB/dA
        nrm = xp.sum(omega * omega, axis=-1)       # |omega_f|^2, (m,)
        da = 0.0
        for x, dt in ((qs, dtq), (k, dtk)):
            u = x @ xp.matrix_transpose(w0)        # (..., t, m)
            da = da + xp.sum(xp.sum(dt * (dbda * u + nrm), axis=-1, keepdims=True),
                             axis=-2, keepdims=True)
    return dq, dk, da


def gerf_parameter_vjp(q, k, da, *, scale: float, key_mask=None):
    r"""``(dq, dk)``: the cotangents of ``q``, ``k`` from that of the data-dependent
    optimum ``A* (..., 1, 1)`` of :func:`arrayattn.gerf_parameter` (equations in the
    module docstring); a masked key gets 0."""
    xp = array_namespace(q, k, da)
    d, n = q.shape[-1], q.shape[-2]
    root = math.sqrt(abs(scale))
    qt = q * (-root if scale < 0 else root)
    kt = k * root
    keep = None if key_mask is None else key_mask[..., None]
    if keep is None:
        cnt = float(k.shape[-2])
    else:
        kt = xp.where(keep, kt, 0.0)
        cnt = xp.maximum(xp.sum(xp.astype(keep, q.dtype), axis=-2, keepdims=True), 1.0)
    mq = xp.mean(xp.sum(qt * qt, axis=-1, keepdims=True), axis=-2, keepdims=True)
    mk = xp.sum(xp.sum(kt * kt, axis=-1, keepdims=True), axis=-2, keepdims=True) / cnt
    qbar = xp.mean(qt, axis=-2, keepdims=True)
    kbar = xp.sum(kt, axis=-2, keepdims=True) / cnt
    rho = (mq + mk + 2 * xp.sum(qbar * kbar, axis=-1, keepdims=True)) / d
    drho = -(1 + (2 * rho + 3) / xp.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 8 * da
    dqt = (2 / d) * drho * (qt + kbar) / n
    dkt = (2 / d) * drho * (kt + qbar) / cnt
    if keep is not None:
        dkt = xp.where(keep, dkt, 0.0)
    return dqt * (-root if scale < 0 else root), dkt * root


def performer_attention_vjp(q, k, v, do, omega, *, kind="positive", scale: float,
                            causal=False, key_mask=None, gerf_a=None):
    r"""``{"q", "k", "v"}`` (and ``"gerf_a"``, the cotangent of FAVOR++'s ``A`` as an
    array ``(..., 1, 1)``, when ``gerf_a`` is an array) of
    :func:`~arrayattn.reference.performer_attention`: the features recomputed, the
    backward of kernel attention, then the chain rule through the features.  ``A`` is
    taken as given: a data-dependent ``A*`` is chained by the caller
    (:func:`gerf_parameter_vjp`)."""
    phi_q, phi_k = performer_features(q, k, omega, kind=kind, scale=scale, causal=causal,
                                      key_mask=key_mask, gerf_a=gerf_a)
    g = kernel_attention_vjp(phi_q, phi_k, v, do, causal=causal, key_mask=key_mask,
                             eps=0.0)
    dq, dk, da = performer_features_vjp(q, k, omega, phi_q, phi_k, g["phi_q"], g["phi_k"],
                                        kind=kind, scale=scale, causal=causal,
                                        key_mask=key_mask, gerf_a=gerf_a)
    out = {"q": dq, "k": dk, "v": g["v"]}
    if kind == "favor++" and not isinstance(gerf_a, float):
        out["gerf_a"] = da
    return out
