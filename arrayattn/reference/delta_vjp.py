r"""Backward of the delta rule (DeltaNet, gated DeltaNet): recurrent and chunked.

Forward (:func:`~arrayattn.reference.delta_recurrent`), row vectors ``q_t, k_t (1, dk)``,
``v_t (1, dv)``, state ``S (dk, dv)``, gate :math:`a_t = e^{g_t}`:

.. math::

    S'_{t-1} = a_t S_{t-1},\quad w_t = v_t - k_t S'_{t-1},\quad u_t = \beta_t w_t,\quad
    S_t = S'_{t-1} + k_t^\top u_t,\quad o_t = q_t S_t .

**Recurrent backward** (reverse time, :math:`\bar S_n = 0`; :math:`\bar S_t` the cotangent
of :math:`S_t` from the future plus :math:`q_t^\top do_t`):

.. math::

    \bar S_t \mathrel{+}= q_t^\top do_t,\quad dq_t = do_t S_t^\top,\quad
    \bar u_t = k_t \bar S_t,\quad \bar w_t = \beta_t \bar u_t,\quad
    dv_t = \bar w_t,\quad d\beta_t = \bar u_t \cdot w_t,

    dk_t = u_t \bar S_t^\top - \bar w_t S'^\top_{t-1},\quad
    \bar S'_{t-1} = \bar S_t - k_t^\top \bar w_t,\quad
    dg_t = \langle S'_{t-1}, \bar S'_{t-1}\rangle,\quad
    \bar S_{t-1} = a_t \bar S'_{t-1},\qquad dS_0 = \bar S_0 .

It needs :math:`S_{t-1}` at every step.  Walking the state backwards (``S_{t-1}`` from
``S_t`` through the inverse of ``I - beta k^T k``) is unstable, so the states are
*checkpointed*: one forward pass keeps the state entering every stretch of ``c`` tokens,
and each stretch recomputes its ``c`` states from it before walking back through them
(``O(n/c d dv + c d dv)`` memory).

**Chunked backward** (Yang et al. 2024's WY/UT form; fla's ``chunk_delta_rule`` backward).
Inside a chunk of ``c`` tokens entering with ``S_0``: ``G_t = sum_(l <= t) g_l`` from the
chunk start, :math:`\gamma_t = e^{G_t}`, the decays :math:`\Gamma_{tj} = e^{G_t - G_j}`
(``j <= t``, :func:`decay_matrix`), :math:`e_j = \Gamma_{cj}`,
:math:`A = \operatorname{strict\_tril}(K K^\top) \circ \Gamma`,
:math:`L = I + \operatorname{diag}(\beta) A` (unit lower triangular, always invertible),
:math:`P = (Q K^\top) \circ \Gamma`:

.. math::

    W = V - \operatorname{diag}(\gamma) K S_0,\quad U = L^{-1} \operatorname{diag}(\beta) W
    \;(= T W),\quad O = \operatorname{diag}(\gamma) Q S_0 + P U,\quad
    S_c = \gamma_c S_0 + (\operatorname{diag}(e) K)^\top U .

With :math:`\bar S_c` the cotangent of the state leaving the chunk (reverse scan over
chunks, the states entering each chunk saved by a forward scan):

.. math::

    \bar U = P^\top dO + \operatorname{diag}(e) K \bar S_c,\quad
    \bar Y = L^{-\top} \bar U,\quad \bar W = \operatorname{diag}(\beta) \bar Y,\quad
    dV = \bar W,\quad d\beta = \operatorname{rowsum}(\bar Y \circ (W - A U)),

    \bar P = \operatorname{tril}(dO\, U^\top),\quad
    \bar A = -\operatorname{strict\_tril}(\operatorname{diag}(\beta) \bar Y U^\top)
    \quad(\text{the triangular solve's adjoint } \bar L = -L^{-\top} \bar U U^\top),

    dQ = \operatorname{diag}(\gamma)\, dO\, S_0^\top + (\bar P \circ \Gamma) K,

    dK = (\bar P \circ \Gamma)^\top Q + (\bar A \circ \Gamma + (\bar A \circ \Gamma)^\top) K
         + \operatorname{diag}(e)\, U \bar S_c^\top
         - \operatorname{diag}(\gamma)\, \bar W S_0^\top,

    \bar S_0 = \gamma_c \bar S_c + Q^\top \operatorname{diag}(\gamma)\, dO
               - K^\top \operatorname{diag}(\gamma) \bar W .

The gates: with :math:`R = (\bar P \circ Q K^\top + \bar A \circ K K^\top) \circ \Gamma`
(strictly below the diagonal) and :math:`\bar\gamma_t = do_t \cdot q_t S_0 - \bar W_t
\cdot k_t S_0`, :math:`\bar e_j = (U \bar S_c^\top)_j \cdot k_j`,

.. math::

    \bar G_t = \gamma_t \bar\gamma_t + \textstyle\sum_j R_{tj} - \sum_j R_{jt}
               - e_t \bar e_t + [t = c]\,\big(\gamma_c \langle \bar S_c, S_0\rangle
               + \sum_j e_j \bar e_j\big),\qquad
    dg_l = \textstyle\sum_{t \ge l} \bar G_t\ \ (\text{inside the chunk}).

Every factor is a decay ``<= 1`` computed as in the forward (a gate of 0, ``g = -inf``,
gives exact zeros and a zero ``dg``).  The chunked backward costs ``O(n c d + n d dv)``
time and ``O(n/c d dv + n c)`` memory per head.  The L2 normalisation of ``q`` and ``k``
(``normalize_qk``) is differentiated by :func:`unit_rows_vjp`.
"""
from __future__ import annotations

import functools

from array_api_compat import array_namespace, device

from .chunks import in_chunks, unchunk
from .gated import decay_matrix, unit_lower_inverse
from .scan import scan

__all__ = ["delta_recurrent_vjp", "delta_chunked_vjp"]


def _rows(x, c: int):
    """``x (..., n, f)`` in chunks of ``c`` tokens, each token a row: ``(..., n/c, c, 1, f)``."""
    x = in_chunks(x, c)
    return x[..., None, :]


def delta_recurrent_vjp(q, k, v, beta, g, s0, do, checkpoint: int):
    """The recurrent backward of :func:`~arrayattn.reference.delta_recurrent`, with the
    states checkpointed every ``checkpoint`` tokens.  ``q, k (..., n, dk)``, ``v, do
    (..., n, dv)``, ``beta (..., n)``, ``g (..., n, 1)``, ``s0 (..., dk, dv)``, all with
    the same batch: ``(dq, dk, dv, dbeta (..., n), dg (..., n, 1), ds0)``."""
    xp = array_namespace(q, k, v, beta, g, s0, do)
    n = q.shape[-2]
    c = min(checkpoint, max(n, 1))
    tr = xp.matrix_transpose
    qr, kr, vr, br, ar, dor = (_rows(x, c) for x in (q, k, v, beta[..., None], xp.exp(g),
                                                      do))

    def step(s, k_t, v_t, b_t, a_t):                    # S_t from S_(t-1), one token
        s = a_t * s
        s = s + tr(k_t) @ (b_t * (v_t - k_t @ s))
        return s, s

    def enter(s, k_i, v_i, b_i, a_i):                   # the state entering each stretch
        return scan(step, s, (k_i, v_i, b_i, a_i), axis=-3)[0], s[..., None, :, :]

    _, entering = scan(enter, s0, (kr, vr, br, ar), axis=-4)     # (..., n/c, 1, dk, dv)

    def back(ds, q_t, k_t, v_t, b_t, a_t, do_t, s_prev, s_t):
        ds = ds + tr(q_t) @ do_t
        sp = a_t * s_prev                                # S'_(t-1)
        w = v_t - k_t @ sp
        u = b_t * w
        du = k_t @ ds
        dw = b_t * du
        dq = do_t @ tr(s_t)
        dk = u @ tr(ds) - dw @ tr(sp)
        db = xp.sum(du * w, axis=-1, keepdims=True)
        dsp = ds - tr(k_t) @ dw
        dg = xp.sum(sp * dsp, axis=(-2, -1), keepdims=True)
        return a_t * dsp, (dq, dk, dw, db, dg)

    def stretch(ds, q_i, k_i, v_i, b_i, a_i, do_i, s_i):   # recompute, then walk back
        s_i = s_i[..., 0, :, :]
        _, states = scan(step, s_i, (k_i, v_i, b_i, a_i), axis=-3)     # S_1 .. S_c
        prev = xp.concat([s_i[..., None, :, :], states[..., :-1, :, :]], axis=-3)
        return scan(back, ds, (q_i, k_i, v_i, b_i, a_i, do_i, prev, states), axis=-3,
                    reverse=True)

    ds0, grads = scan(stretch, xp.zeros_like(s0), (qr, kr, vr, br, ar, dor, entering),
                      axis=-4, reverse=True)
    dq, dk, dv, db, dg = (unchunk(x[..., 0, :], n) for x in grads)
    return dq, dk, dv, db[..., 0], dg, ds0


def _chunk_constants(k, beta, g, c: int):
    """Per chunk, batched over the chunks: ``(gam, gamma, e, a, linv)`` -- the decays
    ``Gam (c, c)``, ``gamma = exp(G) (c, 1)``, ``e = Gam[c-1, :]^T (c, 1)``,
    ``A = strict_tril(K K^T) * Gam`` and ``L^(-1) = (I + diag(beta) A)^(-1)``."""
    xp = array_namespace(k, beta, g)
    kc, bc, gc = in_chunks(k, c), in_chunks(beta[..., None], c), in_chunks(g, c)
    gam = decay_matrix(gc)[..., 0]                                  # (..., nc, c, c)
    gamma = xp.exp(xp.cumulative_sum(gc, axis=-2))                  # (..., nc, c, 1)
    e = xp.matrix_transpose(gam[..., -1:, :])                       # (..., nc, c, 1)
    strict = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(k)), k=-1)
    a = xp.where(strict, (kc @ xp.matrix_transpose(kc)) * gam, 0.0)
    return gam, gamma, e, a, unit_lower_inverse(bc * a)


def _chunk_back(ds, q_i, k_i, v_i, b_i, gam_i, gamma_i, e_i, a_i, linv_i, do_i, s_i, *,
                strict, last):
    """One chunk of :func:`delta_chunked_vjp`, last chunk first: ``dS`` leaving the chunk
    -> ``dS`` entering it, and the chunk's ``(dq, dk, dW, dbeta, dG)``."""
    xp = array_namespace(q_i, ds)
    tr = xp.matrix_transpose
    ks = k_i @ s_i                                             # k_t S_0
    w = v_i - gamma_i * ks                                     # W
    u = linv_i @ (b_i * w)                                     # U = T W
    qk, kk = q_i @ tr(k_i), k_i @ tr(k_i)
    du = tr(qk * gam_i) @ do_i + (k_i * e_i) @ ds              # dU
    dy = tr(linv_i) @ du                                       # L^-T dU
    dw = b_i * dy
    db = xp.sum(dy * (w - a_i @ u), axis=-1, keepdims=True)
    dp = (do_i @ tr(u)) * gam_i                                # dP * Gam
    da = xp.where(strict, -(b_i * (dy @ tr(u))), 0.0) * gam_i  # dA * Gam
    dkc = u @ tr(ds)                                           # d(diag(e) K)
    dq = gamma_i * (do_i @ tr(s_i)) + dp @ k_i
    dk = (tr(dp) @ q_i + (da + tr(da)) @ k_i + e_i * dkc
          - gamma_i * (dw @ tr(s_i)))
    r = xp.where(strict, dp * qk + da * kk, 0.0)              # dGam * Gam
    de = e_i * xp.sum(dkc * k_i, axis=-1, keepdims=True)
    gamma_c = gamma_i[..., -1:, :]
    dgam = gamma_i * (xp.sum(do_i * (q_i @ s_i), axis=-1, keepdims=True)
                      - xp.sum(dw * ks, axis=-1, keepdims=True))
    at_end = gamma_c * xp.sum(ds * s_i, axis=(-2, -1), keepdims=True) + xp.sum(
        de, axis=-2, keepdims=True)
    dgg = (dgam + xp.sum(r, axis=-1, keepdims=True) - tr(xp.sum(r, axis=-2,
                                                                keepdims=True))
           - de + xp.where(last, at_end, 0.0))
    ds_prev = gamma_c * ds + tr(q_i * gamma_i) @ do_i - tr(k_i * gamma_i) @ dw
    return ds_prev, (dq, dk, dw, db, dgg)


def delta_chunked_vjp(q, k, v, beta, g, s0, do, chunk_size: int):
    """The chunked backward of :func:`~arrayattn.reference.delta_chunked` (the equations
    of the module docstring), the states entering each chunk saved by a forward scan.
    Arguments and result as :func:`delta_recurrent_vjp`."""
    xp = array_namespace(q, k, v, beta, g, s0, do)
    n = q.shape[-2]
    c = min(chunk_size, max(n, 1))
    tr = xp.matrix_transpose
    gam, gamma, e, a, linv = _chunk_constants(k, beta, g, c)
    qc, kc, vc, bc, doc = (in_chunks(x, c) for x in (q, k, v, beta[..., None], do))
    strict = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(q)), k=-1)
    last = xp.eye(c, 1, k=1 - c, dtype=xp.bool, device=device(q))   # (c, 1): t = c

    def enter(s, k_i, v_i, b_i, gamma_i, e_i, linv_i):
        u = linv_i @ (b_i * (v_i - (k_i * gamma_i) @ s))
        return gamma_i[..., -1:, :] * s + tr(k_i * e_i) @ u, s

    _, entering = scan(enter, s0, (kc, vc, bc, gamma, e, linv), axis=-3)

    back = functools.partial(_chunk_back, strict=strict, last=last)
    ds0, (dq, dk, dv, db, dgg) = scan(
        back, xp.zeros_like(s0), (qc, kc, vc, bc, gam, gamma, e, a, linv, doc, entering),
        axis=-3, reverse=True)
    # dg_l = sum of dG_t over t >= l in l's chunk (G_t = sum_(l <= t) g_l)
    dg = xp.flip(xp.cumulative_sum(xp.flip(dgg, axis=-2), axis=-2), axis=-2)
    return (unchunk(dq, n), unchunk(dk, n), unchunk(dv, n), unchunk(db, n)[..., 0],
            unchunk(dg, n), ds0)
