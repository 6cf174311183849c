r"""Random Feature Attention (RFA), with the optional gated recurrence.

Peng et al. 2021, "Random Feature Attention" (ICLR 2021).  With ℓ2-normalised queries and
keys, ``exp(q̂·k̂/σ²) = e^{1/σ²} exp(-‖q̂ - k̂‖²/(2σ²))``, and the Gaussian kernel is the
expectation of random Fourier features
``φ(x) = m^{-1/2} [sin(w_1·x), .., sin(w_m·x), cos(w_1·x), .., cos(w_m·x)]``,
``w_i ~ N(0, σ^{-2} I_d)`` (Rahimi & Recht 2007).  So RFA is the trigonometric random-feature
attention of :mod:`arrayattn.performer` on ``q̂, k̂`` with ``scale = 1/σ²`` (``w = ω/σ``),
and is computed by it.

The gated variant (the paper's section 3.1, for causal attention) carries a recency bias:

.. math::

    S_t = g_t S_{t-1} + (1 - g_t)\, \phi(k_t) v_t^\top,\qquad
    z_t = g_t z_{t-1} + (1 - g_t)\, \phi(k_t),\qquad
    o_t = \frac{\phi(q_t)^\top S_t}{\phi(q_t)\cdot z_t},

with a gate ``g_t in (0, 1)`` per position.  In the paper ``g_t = sigmoid(w_g·x_t + b_g)`` is
learned; arrayattn has no parameters, so the caller passes ``g``.
"""
from __future__ import annotations

import math

import numpy as np

from ._validate import (check_key_mask, check_positive_int, check_qkv,
                        check_same_array_kind)
from .kernel import _divide
from .performer import performer_attention, performer_features
from .random_features import RandomFeatures, as_features, feature_rows
from .registry import Variant, register

__all__ = ["rfa_attention"]


def _normalize(xp, x):
    """``x / ‖x‖`` per row; a zero row stays zero."""
    norm = xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True))
    return x / xp.where(norm == 0, 1.0, norm)


def _gated_scan(xp, phi_q, phi_k, v1, log_g, keep_w, *, chunk: int, device):
    """Numerators ``(..., n, dv+1)`` of the gated recurrence, chunk by chunk.

    With ``L_t`` the running sum of ``log g`` inside a chunk, key ``j`` reaches query
    ``t >= j`` of the same chunk with weight ``(1 - g_j) e^{L_t - L_j} <= 1``; the state
    entering a chunk reaches its query ``t`` with ``e^{L_t}``, and leaves the chunk as
    ``S' = e^{L_end} S + sum_j (1 - g_j) e^{L_end - L_j} φ(k_j) [v_j, 1]^T``.  Every factor
    is at most 1 (no overflow for any sequence length), and chunk ``c`` reads only chunks
    ``<= c``.  A Python loop over chunks (not tokens).
    """
    *batch, n, m = phi_q.shape
    dv1 = v1.shape[-1]
    c = min(chunk, n)
    nc = -(-n // c)
    pad = nc * c - n
    if pad:
        def zpad(x, value=0.0):
            z = xp.full((*x.shape[:-2], pad, x.shape[-1]), value, dtype=x.dtype,
                        device=device)
            return xp.concat([x, z], axis=-2)
        phi_q, phi_k, v1 = zpad(phi_q), zpad(phi_k), zpad(v1)
        log_g, keep_w = zpad(log_g), zpad(keep_w)
    qc = xp.reshape(phi_q, (*batch, nc, c, m))
    kc = xp.reshape(phi_k, (*batch, nc, c, m))
    vc = xp.reshape(v1, (*batch, nc, c, dv1))
    lc = xp.cumulative_sum(xp.reshape(log_g, (*batch, nc, c)), axis=-1)   # L_t
    wc = xp.reshape(keep_w, (*batch, nc, c))                              # 1 - g_j
    # (log_g, keep_w arrive as (..., n, 1); padded positions have g = 1 and add nothing)
    lend = lc[..., -1:]
    tril = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device))
    expo = xp.where(tril, lc[..., :, None] - lc[..., None, :], -xp.inf)
    decay = xp.exp(expo) * wc[..., None, :]                              # (.., nc, c, c)
    a = (qc @ xp.matrix_transpose(kc)) * decay
    intra = a @ vc                                                        # (.., nc, c, dv1)
    kw = kc * (wc * xp.exp(lend - lc))[..., None]
    upd = xp.matrix_transpose(kw) @ vc                                    # (.., nc, m, dv1)
    into = xp.exp(lc)[..., None]                                          # (.., nc, c, 1)
    carry = xp.exp(lend)[..., None]                                       # (.., nc, 1, 1)
    state = xp.zeros((*batch, m, dv1), dtype=phi_q.dtype, device=device)
    outs = []
    for i in range(nc):
        outs.append(intra[..., i, :, :] + into[..., i, :, :] * (qc[..., i, :, :] @ state))
        state = carry[..., i, :, :] * state + upd[..., i, :, :]
    num = xp.concat(outs, axis=-2) if nc > 1 else outs[0]
    return num[..., :n, :]


def rfa_attention(q, k, v, /, *, num_features=128, sigma=1.0, seed=0, features=None,
                  projection="iid", causal=False, gate=None, key_mask=None, chunk_size=64):
    r"""Random Feature Attention (Peng et al. 2021), optionally gated.

    .. math::

        o_i = \frac{\sum_{j} \phi(\hat q_i)\cdot\phi(\hat k_j)\, v_j}
                   {\sum_{j} \phi(\hat q_i)\cdot\phi(\hat k_j)},\qquad
        \hat x = x / \|x\|,\quad
        \phi(x) = m^{-1/2}[\sin(w x), \cos(w x)],\ w \sim N(0, \sigma^{-2} I)

    so that ``φ(q̂)·φ(k̂)`` is an unbiased estimate of
    ``exp(-‖q̂ - k̂‖²/(2σ²)) = e^{-1/σ²} exp(q̂·k̂/σ²)``: softmax attention on the
    normalised inputs at temperature ``σ²``.  Computed by :func:`performer_attention`
    (``kind="trig"``, ``scale = 1/σ²``); with ``gate``, by the gated recurrence of the
    paper (module docstring), chunked.

    Parameters
    ----------
    q, k, v : arrays ``(..., n, d)``, ``(..., s, d)``, ``(..., s, dv)``
    num_features : int
        ``m`` random rows (``2m`` features).
    sigma : float
        The temperature ``σ > 0`` (``w = ω/σ``).
    seed, projection, features
        As in :func:`performer_attention` (``features`` holds ``ω ~ N(0, I)``; RFA uses iid
        rows by default).
    causal : bool
        End-aligned causal attention.
    gate : array ``(..., s)``, optional
        ``g_t`` in ``(0, 1)`` per position (the caller's, e.g. a sigmoid of a learned
        projection).  Requires ``causal=True`` and ``n = s``.  Values are not checked
        (that would synchronise a GPU); ``g = 0`` keeps only the current token,
        ``g -> 1`` forgets nothing but also adds nothing.
    key_mask : boolean array ``(..., s)``, optional
        Masked keys contribute nothing; with a gate they are skipped (their gate is taken
        as 1: no decay).
    chunk_size : int
        Chunk length of the gated scan.

    Returns
    -------
    array ``(..., n, dv)``
        In the namespace, dtype and device of ``q``.  Trig features may be negative: the
        denominator is not clamped (see the Performer docs page).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import rfa_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 32, 8)) for _ in range(3))
    >>> out = rfa_attention(q, k, v, num_features=4096, sigma=1.0)
    >>> qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    >>> kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    >>> ref = softmax_attention(qn, kn, v, scale=1.0)  # exp(q̂·k̂/σ²)
    >>> bool(np.abs(out - ref).mean() < 0.05)
    True
    >>> g = np.full((2, 32), 0.9)
    >>> gated = rfa_attention(q, k, v, gate=g, causal=True)
    >>> bool(np.allclose(gated[:, 0], v[:, 0]))  # the first query sees only its own key
    True
    """
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (
            math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0; got {sigma!r}")
    scale = 1.0 / (sigma * sigma)
    xp = p.xp
    qn = _normalize(xp, xp.astype(q, p.work_dtype, copy=False))
    kn = _normalize(xp, xp.astype(k, p.work_dtype, copy=False))
    if gate is None:
        out = performer_attention(qn, kn, xp.astype(v, p.work_dtype, copy=False),
                                  features=features, num_features=num_features,
                                  kind="trig", projection=projection, seed=seed,
                                  scale=scale, causal=causal, key_mask=key_mask)
        return xp.astype(out, p.dtype, copy=False)
    if not causal:
        raise ValueError("gate is the causal recurrence S_t = g_t S_(t-1) + (1 - g_t) "
                         "phi(k_t) v_t^T; pass causal=True")
    if p.n != p.s:
        raise ValueError(f"gate requires n = s (self-attention); got n={p.n}, s={p.s}")
    check_same_array_kind(xp, "q", q, "gate", gate)
    if not xp.isdtype(gate.dtype, "real floating") or gate.ndim < 1 or \
            gate.shape[-1] != p.s:
        raise ValueError(f"gate must be a real floating array (..., s) with s={p.s}; got "
                         f"shape {tuple(gate.shape)} and dtype {gate.dtype}")
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if features is None:
        features = RandomFeatures.draw(p.d, check_positive_int("num_features", num_features),
                                       projection=projection, seed=seed)
    features = as_features(features, p.d)
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    rows = feature_rows(xp, omega, "trig", scale)
    phi_q, phi_k = performer_features(xp, qn, kn, rows, scale=scale, causal=True,
                                      key_mask=key_mask)
    g = xp.astype(gate, p.work_dtype)
    if key_mask is not None:
        g = xp.where(key_mask, g, 1.0)        # a masked position neither decays nor adds
    log_g = xp.expand_dims(xp.log(g), axis=-1)
    keep_w = xp.expand_dims(1 - g, axis=-1)
    wv = xp.astype(v, p.work_dtype, copy=False)
    if key_mask is not None:
        wv = xp.where(xp.expand_dims(key_mask, axis=-1), wv, 0.0)
    v1 = xp.concat([wv, xp.ones((*wv.shape[:-1], 1), dtype=p.work_dtype, device=p.device)],
                   axis=-1)
    # (shapes only: np.broadcast_shapes never touches the arrays)
    batch = tuple(np.broadcast_shapes(
        p.batch, tuple(gate.shape[:-1]),
        () if key_mask is None else tuple(key_mask.shape[:-1])))
    shape = lambda x: (*batch, *x.shape[-2:])  # noqa: E731
    phi_q, phi_k, v1, log_g, keep_w = (xp.broadcast_to(x, shape(x))
                                       for x in (phi_q, phi_k, v1, log_g, keep_w))
    num = _gated_scan(xp, phi_q, phi_k, v1, log_g, keep_w, chunk=chunk_size,
                      device=p.device)
    out = _divide(xp, num, 0.0, p.work_dtype)
    return xp.astype(out, p.dtype, copy=False)


def _gated_call(q, k, v, /, *, gate=None, **options):
    """Uniform call of ``rfa_gated``: a constant gate 0.9 unless the caller passes one."""
    if gate is None:
        from ._xp import xp_device, xp_namespace
        xp = xp_namespace(q, k, v)
        gate = xp.full(tuple(k.shape[:-1]), 0.9, dtype=k.dtype, device=xp_device(k))
    return rfa_attention(q, k, v, gate=gate, **options)


register(Variant(
    name="rfa",
    fn=rfa_attention,
    family="random_features",
    exact=False,
    causal=True,
    key_mask=True,
    normalized=True,
    defaults={"num_features": 128, "sigma": 1.0, "seed": 0},
    parameter="num_features",
    random=True,
    complexity="O((n + s) m d) time, O((n + s) m) memory",
    citation="Peng et al. 2021, Random Feature Attention (ICLR 2021)",
    notes="Random Fourier (sin/cos) features of l2-normalised q, k at temperature sigma; "
          "estimates softmax attention of q/|q|, k/|k| with scale 1/sigma^2. Trig features "
          "may be negative.",
))

register(Variant(
    name="rfa_gated",
    fn=rfa_attention,
    call=_gated_call,
    family="random_features",
    exact=False,
    causal=True,
    key_mask=True,
    normalized=True,
    defaults={"num_features": 128, "sigma": 1.0, "seed": 0, "causal": True},
    parameter="num_features",
    random=True,
    cross=False,
    complexity="O(n m d) time, chunked scan (Python loop over n / chunk chunks)",
    citation="Peng et al. 2021, Random Feature Attention (ICLR 2021), gated variant",
    notes="Gated causal recurrence S_t = g_t S_(t-1) + (1 - g_t) phi(k_t) v_t^T; the "
          "uniform call uses a constant gate 0.9 unless gate= (an (..., s) array in (0, 1)) "
          "is passed. Causal only (causal=False raises), n = s.",
))
