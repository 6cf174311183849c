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
:class:`~arrayattn.random_features.projection.RandomFeatures` (the Performer's host-drawn projection);
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

from .. import reference
from ..core.engine import entry
from .._numpy import kernel as numpy_kernel
from ..core.checks import check_array, check_qkv
from .calls import RfaCall, check_sigma, checked_rfa
from ..core.pipeline import Spec, Working, run
from .projection import as_features
# moved (kept importable from here)
from ..gated.checks import GATED_METHODS

__all__ = ["rfa_attention", "rfa_features", "checked_rfa", "SPEC", "GATED_METHODS"]


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
    sigma = check_sigma(sigma)
    xp = p.xp
    features = as_features(features, p.d)
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    with entry(xp):
        out = reference.random_fourier_features(xp.astype(x, p.work_dtype, copy=False),
                                                omega, sigma=sigma)
    out = out * (1.0 / math.sqrt(features.m))
    return xp.astype(out, p.dtype, copy=False)


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
    return run(SPEC, q, k, v, num_features=num_features, seed=seed, sigma=sigma,
               causal=causal, gate=gate, key_mask=key_mask, features=features,
               projection=projection, norms=norms, method=method, chunk_size=chunk_size,
               eps=eps)


def _maps(call: RfaCall):
    """``(x -> φ(x̂) / m, x -> φ(x̂))``: the factor ``1/m`` of ``φ(q)·φ(k)`` on the query
    side, so that the denominator compared with ``eps`` is the documented one.  Maps of
    the last axis: the NumPy engine applies them to blocks of rows in its threads."""
    p = call.p
    omega = call.features.on(p.xp, dtype=p.work_dtype, device=p.device)

    def phi_q(x):
        return reference.random_fourier_features(x, omega, sigma=call.sigma) * (
            1.0 / call.features.m)

    def phi_k(x):
        return reference.random_fourier_features(x, omega, sigma=call.sigma)

    return phi_q, phi_k


def _features(call: RfaCall, w: Working):
    """``(φ(q̂) / m, φ(k̂))`` of every token (:func:`_maps`)."""
    phi_q, phi_k = _maps(call)
    return phi_q(w.q), phi_k(w.k)


def _reference(call: RfaCall, w: Working):
    p, xp = call.p, call.p.xp
    phi_q, phi_k = _features(call, w)
    if call.gate is None:       # kernel attention on the features
        out, _ = reference.kernel_attention(
            phi_q, phi_k, w.v, causal=call.causal, key_mask=call.key_mask,
            method=call.method, chunk_size=call.chunk_size, eps=call.eps)
        bad = w.bad
    else:                       # the gated scan
        g = xp.broadcast_to(call.gate, (*call.batch, p.n))[..., None]
        # a non-finite key, value or gate reaches only the rows that see it
        bad = reference.nonfinite_rows(phi_k, w.v, g)
        phi_k, wv, g = reference.drop_nonfinite(bad, phi_k, w.v, g)
        out = reference.gated_rfa(phi_q, phi_k, wv, g[..., 0], key_mask=call.key_mask,
                                  method=call.method, chunk_size=call.chunk_size,
                                  eps=call.eps)
    if bad is None:
        return out
    return reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))


def _engine(call: RfaCall, w: Working):
    p = call.p
    phi_q, phi_k = _maps(call)    # made block by block, in the engine's threads
    out, _ = numpy_kernel.kernel_attention(
        w.v, query_features=numpy_kernel.rows_of(w.q, phi_q),
        key_features=numpy_kernel.rows_of(w.k, phi_k), n=p.n, s=p.s, batch=p.batch,
        causal=call.causal, key_mask=call.key_mask, method=call.method,
        chunk=call.chunk_size, sz0=None, eps=call.eps, m=2 * call.features.m)
    if w.bad is None:
        return out
    return reference.poison_rows(out, reference.seen_by_prefix(w.bad, p.n))


def _work(call: RfaCall, w: Working):
    """Bytes of the kernel engine's largest temporary (the ``2m`` features and the values
    of every token); ``None`` with a gate (the gated scan is the reference form on every
    backend)."""
    p = call.p
    if call.gate is not None:
        return None
    return math.prod(p.batch) * (p.n + p.s) * max(2 * call.features.m, p.dv + 1) * 4


#: The pipeline of :func:`rfa_attention`; the gated scan takes its own non-finite keys
#: out (a gate can be one too).
SPEC = Spec(name="rfa_attention", check=checked_rfa, reference=_reference, engine=_engine,
            work=_work, poison=lambda call: call.causal and call.gate is None,
            none_means={"gate": "no gate (plain RFA)", "key_mask": "every key is real",
                        "features": "drawn from num_features, projection, norms and seed",
                        "method": "chunked",
                        "eps": "the smallest normal number of the working dtype"})
