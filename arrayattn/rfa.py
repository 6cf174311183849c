r"""Random Feature Attention (RFA), with the optional gated recurrence.

Peng, Pappas, Yogatama, Schwartz, Smith, Kong, "Random Feature Attention", ICLR 2021.

Random Fourier features (Rahimi & Recht 2007) of ℓ2-normalised queries and keys,

.. math::

    \phi(x) = m^{-1/2}\,[\sin(w_1\cdot\hat x), \ldots, \sin(w_m\cdot\hat x),
                         \cos(w_1\cdot\hat x), \ldots, \cos(w_m\cdot\hat x)],
    \qquad \hat x = x/\|x\|,\quad w_f = \omega_f/\sigma,\ \omega_f \sim N(0, I_d),

satisfy :math:`E[\phi(\hat q)\cdot\phi(\hat k)] = \exp(-\|\hat q - \hat k\|^2/(2\sigma^2))`,
and for unit vectors :math:`\exp(\hat q\cdot\hat k/\sigma^2) = e^{1/\sigma^2}
\exp(-\|\hat q - \hat k\|^2/(2\sigma^2))`: the Gaussian-kernel estimate is proportional,
with one constant for every pair, to the softmax kernel of the normalised inputs at
temperature :math:`\sigma^2`.  The constant cancels in the attention ratio, so RFA
estimates ``softmax(q̂ k̂ᵀ / σ²) v``.  The rows ``ω`` are a
:class:`~arrayattn.random_projection.RandomFeatures` (the Performer's host-drawn projection);
the sin/cos rows are the ``kind="trig"`` rows of ``arrayattn.reference.favor_rows``
at ``scale = 1/σ²``, without the Performer trig map's ``exp(‖x̃‖²/2)`` factor, which is
constant for unit vectors.

Gated RFA (the paper's gating mechanism, causal only): with a gate
:math:`g_t \in (0, 1)` per position,

.. math::

    S_t = g_t S_{t-1} + (1 - g_t)\,\phi(k_t) v_t^\top,\quad
    z_t = g_t z_{t-1} + (1 - g_t)\,\phi(k_t),\quad
    o_t = \frac{\phi(q_t)^\top S_t}{\phi(q_t)\cdot z_t},\quad S_0 = 0,\ z_0 = 0,

i.e. key ``j <= t`` reaches query ``t`` with weight
:math:`(1 - g_j)\prod_{j < l \le t} g_l`.  In the paper
:math:`g_t = \mathrm{sigmoid}(w_g\cdot x_t + b_g)` is learned; arrayattn has no
parameters, so the caller passes ``g``.
"""
from __future__ import annotations

import math

from . import reference
from ._engine import entry
from ._validate import (broadcast_batch, check_array, check_choice, check_flag,
                        check_key_mask, check_positive_int, check_qkv, check_same_array_kind,
                        check_seed)
from ._validate_linear import CAUSAL_METHODS, NORMS, PROJECTIONS, check_eps
from .kernel import feature_attention
from .random_projection import RandomFeatures, as_features

__all__ = ["rfa_attention", "rfa_features", "checked_rfa"]

GATED_METHODS = ("chunked", "recurrent")


def _check_sigma(sigma) -> float:
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not (
            math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a finite number > 0; got {sigma!r}")
    return float(sigma)


def _resolve_features(p, features, num_features, projection, norms, seed):
    if features is None:
        check_positive_int("num_features", num_features)
        check_choice("projection", projection, PROJECTIONS)
        check_choice("norms", norms, NORMS)
        return RandomFeatures.draw(p.d, num_features, projection=projection, norms=norms,
                                   seed=check_seed(seed))
    return as_features(features, p.d)


def rfa_features(x, features, /, *, sigma=1.0):
    r"""The RFA feature map :math:`\phi(\hat x)` of the rows of ``x``.

    .. math::

        \phi(x) = m^{-1/2}[\sin(w\hat x), \cos(w\hat x)],\quad \hat x = x/\|x\|,\quad
        w = \omega/\sigma

    so that :math:`E_\omega[\phi(x)\cdot\phi(y)] = \exp(-\|\hat x - \hat y\|^2/(2\sigma^2))`
    for ``ω ~ N(0, I_d)`` (``projection="iid"`` or ``"orthogonal"`` with ``norms="chi"``).
    A zero row is left at zero before the map.

    Parameters
    ----------
    x : array, shape ``(..., t, d)``
    features : RandomFeatures or array ``(m, d)``
        The projection ``ω``.
    sigma : float
        The temperature ``σ > 0``.

    Returns
    -------
    array, shape ``(..., t, 2m)``
        Sines first, then cosines; in the namespace, dtype and device of ``x``.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import RandomFeatures, rfa_features
    >>> f = RandomFeatures.draw(3, 20000, projection="iid", seed=0)
    >>> x, y = np.array([[1.0, 0.0, 0.0]]), np.array([[0.0, 2.0, 0.0]])
    >>> est = (rfa_features(x, f, sigma=0.5) @ rfa_features(y, f, sigma=0.5).T)[0, 0]
    >>> bool(abs(est - np.exp(-2 / (2 * 0.25))) < 0.02)   # ‖x̂ - ŷ‖² = 2
    True
    """
    check_array("x", x)
    p = check_qkv(x, x, x, names=("x", "x", "x"))
    sigma = _check_sigma(sigma)
    xp = p.xp
    features = as_features(features, p.d)
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    with entry(xp):
        out = reference.random_fourier_features(xp.astype(x, p.work_dtype, copy=False),
                                                omega, sigma=sigma)
    out = out * (1.0 / math.sqrt(features.m))
    return xp.astype(out, p.dtype, copy=False)


def _check_gate(p, gate, q, batch):
    """The gate as an array ``(..., n)`` in the working dtype, and the broadcast batch."""
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


def checked_rfa(q, k, v, /, *, num_features, seed, sigma, causal, gate, key_mask,
                features, projection, norms, method, chunk_size, eps):
    """The validation of :func:`rfa_attention` (shared with its backward): ``(problem,
    sigma, causal, chunk_size, method, gate (working dtype) or None, batch,
    RandomFeatures, eps)``."""
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    sigma = _check_sigma(sigma)
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
        g, batch = _check_gate(p, gate, q, batch)
    elif method is not None:
        check_choice("method", method, CAUSAL_METHODS)
    features = _resolve_features(p, features, num_features, projection, norms, seed)
    eps = check_eps(eps, p.xp, p.work_dtype)
    return p, sigma, causal, chunk_size, method, g, batch, features, eps


def rfa_attention(q, k, v, /, *, num_features=128, seed=0, sigma=1.0, causal=False,
                  gate=None, key_mask=None, features=None, projection="iid", norms="chi",
                  method=None, chunk_size=64, eps=None):
    r"""Random Feature Attention (Peng et al. 2021), optionally gated.

    .. math::

        o_i = \frac{\phi(\hat q_i)^\top \sum_{j\in J_i} \phi(\hat k_j)\, v_j^\top}
                   {\phi(\hat q_i)\cdot \sum_{j\in J_i} \phi(\hat k_j)},\qquad
        \phi(x) = m^{-1/2}[\sin(w x), \cos(w x)],\quad w = \omega/\sigma,\
        \omega \sim N(0, I_d)

    with :math:`\hat x = x/\|x\|`.  :math:`\phi(\hat q)\cdot\phi(\hat k)` is an unbiased
    estimate of :math:`\exp(-\|\hat q - \hat k\|^2/(2\sigma^2)) = e^{-1/\sigma^2}
    \exp(\hat q\cdot\hat k/\sigma^2)`, so RFA estimates softmax attention of the normalised
    inputs with scale :math:`1/\sigma^2`.  ``J_i`` is every unmasked key, or with
    ``causal=True`` those with ``j <= i + s - n``.  With ``gate``, the gated recurrence of
    the paper (causal, ``n = s``):

    .. math::

        S_t = g_t S_{t-1} + (1 - g_t)\phi(\hat k_t) v_t^\top,\quad
        z_t = g_t z_{t-1} + (1 - g_t)\phi(\hat k_t),\quad
        o_t = \frac{\phi(\hat q_t)^\top S_t}{\phi(\hat q_t)\cdot z_t}.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    num_features : int
        ``m``, the number of random rows (``2m`` features) when ``features`` is not given.
    seed : int
        Seed of the host draw (:meth:`RandomFeatures.draw`): same seed, same result on
        every backend.
    sigma : float
        The temperature ``σ > 0``: ``w = ω/σ``, kernel ``exp(-‖q̂ - k̂‖²/(2σ²))``.
    causal : bool
        End-aligned causal attention (query ``i`` sees keys ``j <= i + s - n``).
    gate : array ``(..., n)`` or ``(..., 1)``, or float, optional
        ``g_t`` per position (``(..., 1)`` or a float: one gate for every position),
        broadcast over the leading dimensions; e.g. a sigmoid of the caller's learned
        projection.  Requires ``causal=True`` and ``n = s``.  **Precondition**
        ``0 <= g <= 1``: ``g = 0`` restarts the state at that token, ``g = 1`` skips the
        token (nothing decays, nothing is added).  Checking the values would synchronise a
        GPU, so instead an array value outside ``[0, 1]`` (or NaN) makes the outputs at
        and after its position NaN (a float is checked on the host).  :func:`arrayattn.vjp`
        returns the cotangent of an array gate under ``"gate"`` (a float gets none).
    key_mask : boolean array ``(..., s)``, optional
        ``True`` = real key.  A masked key enters neither numerator nor denominator; with a
        gate it is skipped (taken as ``g = 1``: no decay, no contribution).
    features : RandomFeatures or array ``(m, d)``, optional
        The projection ``ω ~ N(0, I_d)`` (replays a caller's or a peer's matrix exactly;
        then ``num_features``, ``projection``, ``norms`` and ``seed`` are ignored)  The
        backward (:func:`arrayattn.vjp`) treats it, like a drawn one, as a constant.
    projection : {"iid", "orthogonal"}
        ``"iid"`` (as in the paper) or orthogonal blocks (lower variance).
    norms : {"chi", "fixed", "quasi"}
        Row lengths (see :meth:`RandomFeatures.draw`; only ``"chi"`` is unbiased).
    method : {"chunked", "cumsum", "recurrent"}, optional
        Causal form (``None`` = ``"chunked"``), all equal to rounding.  Without a gate,
        those of :func:`arrayattn.feature_attention`; with a gate ``"chunked"`` (log-space
        chunked scan) or ``"recurrent"`` (token by token, the reference).
    chunk_size : int
        Tokens per chunk of the chunked forms.
    eps : float, optional
        Guards the division only, as in :func:`arrayattn.feature_attention`: a row with
        ``|den| <= eps`` returns zeros (default: the smallest normal number of the working
        dtype, so only a zero denominator is caught); nothing is added to the features.

    Returns
    -------
    array ``(..., n, dv)``
        In the namespace, dtype and device of ``q`` (float16/bfloat16 computed in
        float32).

    Notes
    -----
    The sin/cos features are bounded (``|φ(q̂)·φ(k̂)| <= 1``: no overflow, no
    stabiliser needed) but **signed**: the denominator :math:`\sum_j \phi(\hat q_i)\cdot
    \phi(\hat k_j)` can be near zero or negative when the kernel values are small
    compared with the estimator's standard deviation ``~(2m)^{-1/2}`` (small ``σ``, few
    visible keys, strong gate decay).  A denominator with ``|den| <= eps`` (by default
    only zero) gives a zero row, never NaN; a small non-zero one gives a large row -- the
    estimate itself is poor there.  Since ``|φ(q̂)·φ(k̂)| <= 1`` the numerator is at most
    ``s max|v|``, so the row stays finite unless ``|den| < s max|v| / max_float``
    (``~3e-35`` in float32 for ``s max|v| ~ 1e4``); pass a larger ``eps`` to zero such
    rows as well.

    Cost: ``O((n + s) m (d + dv))`` non-causal; causal chunked
    ``O(n m (c + dv) + n c dv)`` with ``c = chunk_size``, a ``2m x (dv + 1)`` state per
    chunk.  The gated chunked form keeps one state and loops over the ``n / c`` chunks.

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
    >>> ref = rfa_attention(q, k, v, gate=g, causal=True, method="recurrent")
    >>> bool(np.allclose(gated, ref))
    True
    """
    p, sigma, causal, chunk_size, method, g, batch, features, eps = checked_rfa(
        q, k, v, num_features=num_features, seed=seed, sigma=sigma, causal=causal,
        gate=gate, key_mask=key_mask, features=features, projection=projection, norms=norms,
        method=method, chunk_size=chunk_size, eps=eps)
    xp, wd, dev = p.xp, p.work_dtype, p.device
    if p.s == 0:
        return p.zeros()
    omega = features.on(xp, dtype=wd, device=dev)
    with entry(xp):
        wq, wk, wv = (xp.astype(x, wd, copy=False) for x in (q, k, v))
        wk, wv = reference.zero_masked_keys(key_mask, wk, wv)   # padding may hold NaN/inf
        # φ(q)·φ(k) carries the factor 1/m (both m^-1/2), put on the query side, so that
        # the denominator compared with eps is the documented one
        phi_q = reference.random_fourier_features(wq, omega, sigma=sigma) * (
            1.0 / features.m)
        phi_k = reference.random_fourier_features(wk, omega, sigma=sigma)
        if gate is None:   # kernel attention: its NumPy engine or reference form
            out = feature_attention(phi_q, phi_k, wv, causal=causal, key_mask=key_mask,
                                    eps=eps, method=method, chunk_size=chunk_size)
        else:              # the gated scan: the reference form on every backend
            g = xp.broadcast_to(g, (*batch, p.n))
            # a non-finite key, value or gate reaches only the rows that see it
            bad = reference.nonfinite_rows(phi_k, wv, g[..., None])
            phi_k, wv, g1 = reference.drop_nonfinite(bad, phi_k, wv, g[..., None])
            out = reference.gated_rfa(phi_q, phi_k, wv, g1[..., 0], key_mask=key_mask,
                                      method=method, chunk_size=chunk_size, eps=eps)
            out = reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))
    return xp.astype(out, p.dtype, copy=False)
