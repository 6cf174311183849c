r"""Backward of Random Feature Attention (Peng et al. 2021), plain and gated.

**Features.**  :math:`\phi(x) = [\sin t, \cos t]`, :math:`t = \hat x\, w^\top`,
:math:`\hat x = x / \|x\|`, :math:`w = \omega / \sigma` (the query side also carries
``1/m``).  From the features' cotangent :math:`d\phi = [d\phi_s, d\phi_c]`:

.. math::

    dt = d\phi_s \circ \cos t - d\phi_c \circ \sin t,\quad d\hat x = dt\, w,\quad
    dx = \frac{d\hat x - \hat x\,(\hat x\cdot d\hat x)}{\|x\|}

(a zero row, where :math:`\hat x` is not continuous, is computed as ``x / 1``: its
cotangent is :math:`d\hat x`, what autodiff of the forward gives).  No stabiliser: the
features are bounded.  The projection ``ω`` -- drawn from ``seed`` or the caller's
``features`` -- is a constant of the forward: no cotangent.

**Plain** (causal or not): the backward of kernel attention on these features
(:func:`~arrayattn.reference.kernel_attention_vjp`).

**Gated** (causal, ``n = s``): :math:`S_t = g_t S_{t-1} + (1 - g_t)\,\phi_{k,t}^\top
v_{1,t}` with :math:`v_1 = [v, 1]`, :math:`N_t = \phi_{q,t} S_t`, ``O = N[:, :-1] /
N[:, -1]``.  With :math:`dN` from the guarded division and the reverse-time state
cotangent :math:`U_t = \phi_{q,t}^\top dN_t + g_{t+1} U_{t+1}`:

.. math::

    d\phi_{q,t} = dN_t S_t^\top,\quad
    d\phi_{k,t} = (1 - g_t)\, U_t v_{1,t},\quad
    dv_{1,t} = (1 - g_t)\, U_t^\top \phi_{k,t},\quad
    dg_t = \langle U_t, S_{t-1}\rangle - \phi_{k,t}\, U_t\, v_{1,t}.

Computed **chunked** (chunks of ``c`` tokens, as the forward), never an ``(n, m, dv)``
array: the states entering each chunk :math:`S_b` (a forward scan over the chunks) and
the cotangents of the states leaving each chunk :math:`V_b = dS_{b+1}` (a reverse scan,
:math:`dS_b = \sum_{t \in b} G_{t_0 - 1, t}\,\phi_{q,t}^\top dN_t + G_{b}\, dS_{b+1}`,
:math:`G_{j,i} = \prod_{j < l \le i} g_l`, :math:`G_b` the chunk's whole product); inside
a chunk, with :math:`D_{tj} = (1 - g_j) G_{j,t}` (the forward's decay, ``j <= t``),
:math:`\Gamma_{ti} = G_{t,i}` (``i >= t``), :math:`B_{tj} = D_{t-1,j}` (``j < t``),
:math:`\alpha_t = G_{t_0 - 1, t - 1}`, :math:`A = \phi_Q\phi_K^\top`,
:math:`dA = dN\,V_1^\top`:

.. math::

    d\phi_Q = \alpha'\circ dN S_b^\top + (D\circ dA)\,\phi_K,\qquad
    U_t v_{1,t} = \big((\Gamma\circ dA^\top)\,\phi_Q\big)_t + \Gamma_{t,\text{last}}
    (V_1 V_b^\top)_t,

    \phi_{k,t} U_t = \big((\Gamma\circ A^\top)\, dN\big)_t + \Gamma_{t,\text{last}}
    (\phi_K V_b)_t,\qquad (\alpha'_t = G_{t_0 - 1, t})

    \langle U_t, S_{t-1}\rangle = \alpha_t \Gamma_{t,\text{last}}\langle S_b, V_b\rangle
    + \alpha_t (\Gamma x)_t + \Gamma_{t,\text{last}} (B y)_t
    + \operatorname{rowsum}\big((\Gamma (A\circ dA))\circ B\big)_t,

with :math:`x_i = dN_i\cdot(\phi_{q,i} S_b)`, :math:`y_j = \phi_{k,j}\cdot(V_b v_{1,j})`.
Every factor is a product of gates *other than* :math:`g_t` (formed in log space, like
the forward), so :math:`dg_t` is exact at :math:`g_t = 0` too (no division by
:math:`g_t`).  A masked key is skipped by the forward (``g = 1``, zero features): its
gate, key and value get exactly 0.  The gate's cotangent is the one-sided derivative
at the ends of ``[0, 1]``.

Array API only, no host reads, no in-place updates; loops over chunks through
:func:`~arrayattn.reference.scan.scan`.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .exact_vjp import sum_to_shape
from .chunks import in_chunks, unchunk
from .kernel_vjp import kernel_attention_vjp
from .masks import zero_masked_keys
from .rfa import random_fourier_features
from .scan import scan

__all__ = ["random_fourier_features_vjp", "gated_rfa_vjp", "rfa_attention_vjp"]


def _t(x):
    return array_namespace(x).matrix_transpose(x)


def random_fourier_features_vjp(x, omega, dphi, *, sigma: float):
    r"""The cotangent of ``x (..., t, d)`` from that of
    :func:`~arrayattn.reference.random_fourier_features` ``(..., t, 2m)``."""
    xp = array_namespace(x, omega, dphi)
    m = omega.shape[0]
    w = omega / sigma
    norm = xp.linalg.vector_norm(x, axis=-1, keepdims=True)
    safe = xp.where(norm == 0, 1.0, norm)
    xh = x / safe
    t = xh @ _t(w)
    dt = dphi[..., :m] * xp.cos(t) - dphi[..., m:] * xp.sin(t)
    dxh = dt @ w
    # d(x / |x|): the radial part removed; a zero row (x / 1) keeps dxh
    radial = xp.where(norm == 0, 0.0, xp.sum(xh * dxh, axis=-1, keepdims=True))
    return (dxh - xh * radial) / safe


def _division_cotangent(num, do, eps: float):
    """``dN = [dO / den, -rowsum(dO O) / den]`` of ``O = N[:, :-1] / N[:, -1]`` (zero
    where ``|den| <= eps``: that row's output is 0)."""
    xp = array_namespace(num, do)
    den = num[..., -1:]
    ok = xp.abs(den) > eps
    inv = 1.0 / xp.where(ok, den, 1.0)
    dden = -xp.sum(do * (num[..., :-1] * inv), axis=-1, keepdims=True) * inv
    return xp.where(ok, xp.concat([do * inv, dden], axis=-1), 0.0)


def _zero_state(x, scale):
    """Zeros shaped like one chunk's state of ``x (..., nc, m, f)`` times ``scale (...,
    nc, 1, 1)`` (the broadcast batch), for a scan's initial carry."""
    xp = array_namespace(x, scale)
    lead = xp.broadcast_arrays(x[..., :1, :1, :1], scale[..., :1, :, :])[0].shape[:-3]
    return xp.zeros((*lead, *x.shape[-2:]), dtype=x.dtype, device=device(x))


def _gated_inputs(phi_k, v, g, key_mask):
    """``(phi_k, [v, 1], g, valid)`` as the gated forward sees them: a gate outside
    ``[0, 1]`` is NaN (it poisons its own and later rows), a masked token has gate 1
    (it leaves the state unchanged) and zero features and value."""
    xp = array_namespace(phi_k, v, g)
    valid = (g >= 0.0) & (g <= 1.0)
    g = xp.where(valid, g, xp.nan)
    if key_mask is not None:
        valid = valid & key_mask
        g = xp.where(key_mask, g, 1.0)
    phi_k, v = zero_masked_keys(key_mask, phi_k, v)
    ones = xp.ones((*v.shape[:-1], 1), dtype=v.dtype, device=device(v))
    return phi_k, xp.concat([v, ones], axis=-1), g, valid


def _chunk_decays(lc, wc):
    """The gated forward's tables within each chunk, from its log gates ``lc`` and the
    input weights ``wc = 1 - g`` ``(..., nc, c)``: ``D_tj`` (decay), ``Gamma_ti``,
    ``G_t,last``, ``alpha'_t``, ``alpha_t`` and ``B_tj`` (the decay of the row before)."""
    xp = array_namespace(lc, wc)
    c, dev = lc.shape[-1], device(lc)
    lower = xp.tril(xp.ones((c, c), dtype=xp.bool, device=dev))
    strict = xp.tril(xp.ones((c, c), dtype=xp.bool, device=dev), k=-1)
    seg = xp.cumulative_sum(xp.where(strict, lc[..., :, None], 0.0), axis=-2)  # log G_jt
    decay = xp.where(lower, xp.exp(seg) * wc[..., None, :], 0.0)            # D_tj
    gamma = xp.where(_t(lower), xp.exp(_t(seg)), 0.0)                       # Gamma_ti
    last = gamma[..., :, -1]                                                # G_t,last
    into = xp.exp(xp.cumulative_sum(lc, axis=-1))                           # alpha'_t
    alpha = xp.exp(xp.cumulative_sum(lc, axis=-1, include_initial=True)[..., :-1])
    zero_row = xp.zeros((*decay.shape[:-2], 1, c), dtype=decay.dtype, device=dev)
    before = xp.concat([zero_row, decay[..., :-1, :]], axis=-2)             # B_tj
    return decay, gamma, last, into, alpha, before


def gated_rfa_vjp(phi_q, phi_k, v, g, do, *, key_mask=None, chunk_size=64, eps=0.0):
    r"""``{"phi_q", "phi_k", "v", "g"}``: the cotangents of
    :func:`~arrayattn.reference.gated_rfa` (every ``method``: the forms are equal), by
    the chunked equations in the module docstring; each with its argument's shape."""
    xp = array_namespace(phi_q, phi_k, v, g, do)
    shapes = {"phi_q": phi_q.shape, "phi_k": phi_k.shape, "v": v.shape, "g": g.shape}
    phi_k, v1, g, valid = _gated_inputs(phi_k, v, g, key_mask)
    n = phi_q.shape[-2]
    c = min(chunk_size, n)
    tiny = xp.finfo(phi_q.dtype).smallest_normal
    # the forward's chunk quantities: padding has zero features, log g = 0, weight 0
    qc, kc, vc, dc = (in_chunks(x, c) for x in (phi_q, phi_k, v1, do))
    lc, wc = (in_chunks(x[..., None], c)[..., 0]
              for x in (xp.log(xp.maximum(g, tiny)), 1 - g))
    decay, gamma, last, into, alpha, before = _chunk_decays(lc, wc)
    upd = _t(kc * decay[..., -1, :, None]) @ vc                # (..., nc, m, dv + 1)
    whole = into[..., -1, None, None]                          # G_b, (..., nc, 1, 1)
    # entry states S_b (forward scan) and dN from the recomputed outputs
    _, entry = scan(lambda s, gb, ub: (gb * s + ub, s), _zero_state(upd, whole),
                    (whole, upd), axis=-3)
    a = qc @ _t(kc)
    num = into[..., None] * (qc @ entry) + (a * decay) @ vc
    dn = _division_cotangent(num, dc, eps)
    # cotangents of the states leaving each chunk, V_b = dS_(b+1) (reverse scan)
    push = _t(qc * into[..., None]) @ dn
    _, leave = scan(lambda u, gb, pb: (pb + gb * u, u), _zero_state(push, whole),
                    (whole, push), axis=-3, reverse=True)
    da = dn @ _t(vc)                                           # dN_i . v1_j
    dq = into[..., None] * (dn @ _t(entry)) + (decay * da) @ kc
    uv = (gamma * _t(da)) @ qc + last[..., None] * (vc @ _t(leave))      # U_t v1_t
    pu = (gamma * _t(a)) @ dn + last[..., None] * (kc @ leave)          # phi_k,t U_t
    x = xp.sum(dn * (qc @ entry), axis=-1)
    y = xp.sum(kc * (vc @ _t(leave)), axis=-1)
    sv = xp.sum(xp.sum(entry * leave, axis=-1), axis=-1)                # <S_b, V_b>
    h = (alpha * last * sv[..., None] + alpha * (gamma @ x[..., None])[..., 0]
         + last * (before @ y[..., None])[..., 0]
         + xp.sum((gamma @ (a * da)) * before, axis=-1))               # <U_t, S_(t-1)>
    dg = h - xp.sum(kc * uv, axis=-1)
    dk, dv1 = wc[..., None] * uv, wc[..., None] * pu

    dk, dv = zero_masked_keys(key_mask, unchunk(dk, n), unchunk(dv1, n)[..., :-1])
    dg = xp.where(valid, unchunk(dg[..., None], n)[..., 0], 0.0)
    grads = {"phi_q": unchunk(dq, n), "phi_k": dk, "v": dv, "g": dg}
    return {name: sum_to_shape(z, shapes[name]) for name, z in grads.items()}


def rfa_attention_vjp(q, k, v, do, omega, *, sigma: float, causal=False, gate=None,
                      key_mask=None, method="chunked", chunk_size=64, eps=0.0):
    r"""``{"q", "k", "v"[, "gate"]}`` of :func:`~arrayattn.reference.rfa_attention`:
    the features recomputed, the backward of kernel attention (or of the gated
    recurrence), then the chain rule through the features."""
    m = omega.shape[0]
    phi_q = random_fourier_features(q, omega, sigma=sigma) * (1.0 / m)
    phi_k = random_fourier_features(k, omega, sigma=sigma)
    if gate is None:
        g = kernel_attention_vjp(phi_q, phi_k, v, do, causal=causal, key_mask=key_mask,
                                 method=method, chunk_size=chunk_size, eps=eps)
    else:
        g = gated_rfa_vjp(phi_q, phi_k, v, gate, do, key_mask=key_mask,
                          chunk_size=chunk_size, eps=eps)
    dq = random_fourier_features_vjp(q, omega, g["phi_q"] * (1.0 / m), sigma=sigma)
    dk = zero_masked_keys(key_mask, random_fourier_features_vjp(k, omega, g["phi_k"],
                                                                sigma=sigma))
    out = {"q": dq, "k": dk, "v": g["v"]}
    if gate is not None:
        out["gate"] = g["g"]
    return out
