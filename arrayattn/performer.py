r"""Performer attention (FAVOR+): softmax attention through random features, in O(n m d).

Choromanski et al. 2020, "Rethinking Attention with Performers" (ICLR 2021).

.. math::

    \widehat{\mathrm{Attn}}(Q, K, V)_i =
        \frac{\sum_j \phi(q_i)\cdot\phi(k_j)\, v_j}{\sum_j \phi(q_i)\cdot\phi(k_j)},
    \qquad \phi(q)\cdot\phi(k) \approx \exp(\mathrm{scale}\; q\cdot k),

computed as ``φ(Q) (φ(K)^T V)`` (never the n x s matrix).  The feature maps and the
projection live in :mod:`arrayattn.random_features`.

Stabilisation (exact, and causal-safe bit for bit)
--------------------------------------------------
Every factor that is removed from the features cancels in the ratio; nothing is added
(no ``eps``: an ``eps`` floors small kernels and biases the estimate).

* Non-causal: each query row is divided by its own largest feature (a per-row factor,
  cancels), each key row ``φ(k_j) = exp(l_j) b_j`` (``b_j`` in ``[-1, 1]``) is scaled by
  ``exp(-L)`` with one ``L = max_j l_j`` over the *unmasked* keys of the sequence (a
  global factor, cancels).
* Causal: a shift may not depend on other keys.  For the exponential maps
  ``ω_f·k̃ - ‖k̃‖²/2 <= ‖ω_f‖²/2`` for every ``k̃``, so the key features
  ``exp(ω_f·k̃ - ‖k̃‖²/2 - ‖ω_f‖²/2) = exp(-‖k̃ - ω_f‖²/2)`` lie in ``(0, 1]`` and depend on
  that key alone; the factor ``exp(‖ω_f‖²/2)`` moves to the query side, whose own row
  maximum is then divided out.
"""
from __future__ import annotations

import math

import array_api_compat

from ._validate import (check_choice, check_key_mask, check_positive_int, check_qkv,
                        check_scale)
from .random_features import FEATURE_KINDS, NORMS, PROJECTIONS, RandomFeatures, as_features
from .kernel import feature_attention
from .registry import Variant, register

__all__ = ["performer_attention", "performer_features"]


#: Stands in for +inf in sums that go through a matmul: ``exp(-_BIG) == 0`` exactly in every
#: float dtype, and BLAS never sees an inf (``0 * inf`` would give NaN).
_BIG = 1e30


def _in_place_ok(xp) -> bool:
    """Whether in-place updates of *our own* temporaries are safe and worth it.

    NumPy and CuPy have no autograd and pay a page-faulting allocation per temporary of
    ``(n, m)``; torch (autograd saves tensors), JAX (immutable) and others get the
    functional form.
    """
    return array_api_compat.is_numpy_namespace(xp) or array_api_compat.is_cupy_namespace(xp)


def _exp_shifted(xp, a, shift=None):
    """``exp(a - shift)`` for a temporary ``a`` that this module owns (it may be consumed)."""
    if _in_place_ok(xp):
        if shift is not None:
            a -= shift
        return xp.exp(a, out=a)
    return xp.exp(a if shift is None else a - shift)


def _rows(xp, omega, kind: str, root: float):
    """The projection rows of the features, ``W (m', d)`` with ``x̃·ω = x·W``, and per row
    the causal shift ``‖ω_f‖²/2`` (exp kinds) or the phase (trig: ``cos t = sin(t + π/2)``).

    positive: ``W = ω``; hyperbolic: ``[ω; -ω]`` (gives ``[P, -P]`` from one matmul);
    trig: ``[ω; ω]`` with phases ``[0, π/2]`` (``[sin P, cos P]`` from one ``sin``).
    """
    w = omega * root
    if kind == "trig":
        m = omega.shape[0]
        zero = xp.zeros((m,), dtype=omega.dtype, device=array_api_compat.device(omega))
        return xp.concat([w, w]), xp.concat([zero, zero + math.pi / 2])
    hw = xp.sum(omega * omega, axis=-1) / 2
    if kind == "hyperbolic":
        return xp.concat([w, -w]), xp.concat([hw, hw])
    return w, hw


def _augment(xp, x, *cols):
    """``[x, c_1, c_2, ...]`` along the last axis; a Python float ``c`` is a constant column."""
    parts = [x]
    for c in cols:
        if isinstance(c, float):
            c = xp.full((*x.shape[:-1], 1), c, dtype=x.dtype,
                        device=array_api_compat.device(x))
        parts.append(c)
    return xp.concat(parts, axis=-1)


def performer_features(xp, q, k, omega, *, kind: str, scale: float, causal: bool,
                       key_mask=None):
    """Stabilised features ``(φq (..., n, m'), φk (..., s, m'))`` for attention.

    ``φq_i·φk_j = c_i C K̂_ij`` with ``K̂`` the random-feature estimate of
    ``exp(scale q_i·k_j)``, a per-query factor ``c_i`` and a global ``C`` (both cancel in
    the attention ratio; module docstring).  Masked keys get all-zero features.  ``q, k``
    and ``omega (m, d)`` are in the working dtype.  Every additive term of an exponent is
    folded into the projection matmul as an extra column (``[k, h_k, 1] @ [W, -1, -c]^T``),
    so the features cost one matmul and at most three elementwise passes per side.
    """
    root = math.sqrt(abs(scale))
    sign = -1.0 if scale < 0 else 1.0
    w, extra = _rows(xp, omega, kind, root)
    wt = xp.matrix_transpose
    m2 = w.shape[0]
    hk = xp.sum(k * k, axis=-1, keepdims=True) * (abs(scale) / 2)   # ‖k̃‖²/2
    if key_mask is not None:
        keep = xp.expand_dims(key_mask, axis=-1)
        k = xp.where(keep, k, 0.0)  # padding may hold anything, even inf or NaN
        hk = xp.where(keep, hk, _BIG if kind != "trig" else -xp.inf)
    if kind == "trig":
        # φ(x) ∝ exp(‖x̃‖²/2) [sin, cos](ω·x̃): the query factor cancels; the key factor
        # is divided by its max over the (unmasked) keys -- not causal-safe, so causal
        # trig keeps it unshifted (finite while ‖k̃‖² < 2 log(max float)).
        phase = xp.reshape(extra, (m2, 1))
        phi_q = xp.sin(_augment(xp, q, 1.0) @ wt(_augment(xp, w * sign, phase)))
        sk = xp.sin(_augment(xp, k, 1.0) @ wt(_augment(xp, w, phase)))
        if not causal:
            top = xp.max(hk, axis=-2, keepdims=True)
            hk = hk - xp.where(top == -xp.inf, 0.0, top)
        return phi_q, sk * xp.exp(hk)
    c = xp.reshape(extra, (m2, 1))           # ‖ω_f‖²/2 per feature row
    if causal:
        # Keys: ω·k̃ - ‖k̃‖²/2 - ‖ω‖²/2 = -‖k̃ - ω‖²/2 <= 0 depends on that key alone;
        # queries carry +‖ω‖²/2 and are divided by their own row max.
        aq = _augment(xp, q, 1.0) @ wt(_augment(xp, w * sign, c))
        ak = _augment(xp, k, hk, 1.0) @ wt(_augment(xp, w, -1.0, -c))
        phi_k = _exp_shifted(xp, ak)
    else:
        aq = q @ wt(w * sign)
        ak = _augment(xp, k, hk) @ wt(_augment(xp, w, -1.0))
        # One shift for all keys of a sequence; floored so that an all-masked sequence
        # (every exponent ~ -_BIG) keeps all-zero features.
        top = xp.maximum(xp.max(ak, axis=(-2, -1), keepdims=True), -_BIG / 2)
        phi_k = _exp_shifted(xp, ak, top)
    phi_q = _exp_shifted(xp, aq, xp.max(aq, axis=-1, keepdims=True))
    return phi_q, phi_k


def performer_attention(q, k, v, /, *, features=None, num_features=256, kind="positive",
                        projection="orthogonal", norms="chi", seed=0, scale=None,
                        causal=False, key_mask=None):
    r"""Performer attention: softmax attention through random features (FAVOR+).

    .. math::

        O_i = \frac{\sum_j \phi(q_i)\cdot\phi(k_j)\, v_j}{\sum_j \phi(q_i)\cdot\phi(k_j)},
        \qquad \phi(x)_f = m^{-1/2}\exp(\omega_f\cdot\tilde x - \|\tilde x\|^2/2),
        \quad \tilde x = \sqrt{\mathrm{scale}}\, x

    (``kind="positive"``), so that ``E[φ(q)·φ(k)] = exp(scale q·k)``: unbiased kernel,
    hence (to first order in ``1/m``) softmax attention.  Computed as ``φ(Q)(φ(K)^T V)`` in
    ``O((n + s) m d)`` time and ``O((n + s) m)`` memory; causal via the chunked prefix-sum
    form of linear attention.  Choromanski et al. 2020, "Rethinking Attention with
    Performers".

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    features : RandomFeatures or array ``(m, d)``, optional
        The projection ``ω``; a caller's (or a peer's) matrix is replayed exactly.  When
        given, ``num_features``, ``projection``, ``norms`` and ``seed`` are ignored.  One
        projection is shared by every batch element and head.
    num_features : int
        ``m``, the number of random rows when ``features`` is not given.
    kind : {"positive", "hyperbolic", "trig"}
        Feature map (see :func:`arrayattn.estimate_kernel`).  ``"hyperbolic"`` and
        ``"trig"`` use ``2m`` features.  ``"trig"`` features may be negative, so the
        denominator may be near zero or negative: never clamped here (that would bias).
    projection : {"orthogonal", "iid"}
    norms : {"chi", "fixed", "quasi"}
    seed : int
        See :meth:`RandomFeatures.draw`.  Same seed, same output on every backend.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    causal : bool
        End-aligned causal attention (query ``i`` sees keys ``j <= i + s - n``).
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key; masked keys leave numerator *and* denominator.

    Returns
    -------
    array, shape ``(..., n, dv)``
        In the namespace, dtype and device of ``q``; a query with no visible key returns
        zeros.  float16/bfloat16 are computed in float32.

    Notes
    -----
    Stabilisation cancels exactly (see the module docstring and the docs page): nothing
    is added to the features.  In causal mode the key features ``exp(-‖k̃ - ω_f‖²/2)``
    underflow (float32) when ``‖k̃ - ω_f‖ > ~13``, e.g. for ``d = 64`` only once ``‖k‖``
    exceeds ~30; keys whose every feature underflows get weight 0.  The causal ``"trig"``
    map keeps ``exp(‖k̃‖²/2)`` unshifted (finite for ``‖k̃‖² < 176`` in float32).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import performer_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 64, 16)) for _ in range(3))
    >>> q, k = q / 2, k / 2  # moderate logits: FAVOR+ variance grows like exp(‖q̃ + k̃‖²)
    >>> out = performer_attention(q, k, v, num_features=1024, seed=0)
    >>> out.shape
    (2, 64, 16)
    >>> err = np.abs(out - softmax_attention(q, k, v)).mean()
    >>> bool(err < 0.02)
    True
    >>> c = performer_attention(q, k, v, causal=True)
    >>> bool(np.allclose(c[:, 0], v[:, 0]))  # the first query sees only the first key
    True
    """
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    check_choice("kind", kind, tuple(FEATURE_KINDS))
    scale = check_scale(scale, p.d)
    if features is None:
        check_positive_int("num_features", num_features)
        check_choice("projection", projection, PROJECTIONS)
        check_choice("norms", norms, NORMS)
        features = RandomFeatures.draw(p.d, num_features, projection=projection,
                                       norms=norms, seed=seed)
    else:
        features = as_features(features, p.d)
    xp = p.xp
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    wq = xp.astype(q, p.work_dtype, copy=False)
    wk = xp.astype(k, p.work_dtype, copy=False)
    wv = xp.astype(v, p.work_dtype, copy=False)
    if key_mask is not None:  # padded values may hold inf/NaN: 0 * inf would leak
        wv = xp.where(xp.expand_dims(key_mask, axis=-1), wv, 0.0)
    phi_q, phi_k = performer_features(xp, wq, wk, omega, kind=kind, scale=scale,
                                      causal=causal, key_mask=key_mask)
    # eps=0: only a zero denominator (no visible key) gives zeros; nothing is added.
    out = feature_attention(phi_q, phi_k, wv, causal=causal, eps=0.0)
    return xp.astype(out, p.dtype, copy=False)


def _uniform_call(q, k, v, /, *, omega=None, **options):
    """The registry's uniform call: ``omega=`` replays a caller's ``(m, d)`` matrix."""
    if omega is not None:
        if options.get("features") is not None:
            raise ValueError("pass either omega or features, not both")
        options["features"] = RandomFeatures.from_matrix(omega)
    return performer_attention(q, k, v, **options)


_NOTES = ("omega= (an (m, d) matrix, e.g. a peer's projection loaded from an .npz file) "
          "replays that projection exactly via RandomFeatures.from_matrix; otherwise one is "
          "drawn from num_features, projection, norms and seed. One projection is shared by "
          "all batch elements and heads.")

for _kind, _extra in (
        ("positive", "FAVOR+ positive features: unbiased, positive."),
        ("hyperbolic", "2m features [exp(wx), exp(-wx)]: unbiased, positive, lower variance."),
        ("trig", "2m sin/cos features: unbiased kernel but may be negative; the denominator "
                 "can be near zero or negative on large-norm inputs.")):
    register(Variant(
        name=f"performer_{_kind}",
        fn=performer_attention,
        call=_uniform_call,
        family="random_features",
        exact=False,
        causal=True,
        key_mask=True,
        normalized=True,
        defaults={"kind": _kind, "num_features": 256, "projection": "orthogonal",
                  "norms": "chi", "seed": 0},
        parameter="num_features",
        random=True,
        complexity="O((n + s) m d) time, O((n + s) m) memory",
        citation="Choromanski et al. 2020, Rethinking Attention with Performers (ICLR 2021)",
        notes=f"{_extra} {_NOTES}",
    ))
