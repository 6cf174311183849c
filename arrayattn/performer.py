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
  cancels); every key feature by ``exp(L)``, ``L`` the largest key exponent over the
  *unmasked* keys and all features of the sequence (one global factor, cancels; taken as
  per-block maxima whose states are merged, as the online softmax merges blocks).  For
  trig features the key factor ``exp(‖k̃‖²/2)`` is divided by its maximum the same way.
* Causal: a shift may not depend on other keys.  For the exponential maps
  ``ω_f·k̃ - ‖k̃‖²/2 <= ‖ω_f‖²/2`` for every ``k̃``, so the key features
  ``exp(ω_f·k̃ - ‖k̃‖²/2 - ‖ω_f‖²/2) = exp(-‖k̃ - ω_f‖²/2)`` lie in ``(0, 1]`` and depend on
  that key alone; the factor ``exp(‖ω_f‖²/2)`` moves to the query side, whose own row
  maximum is then divided out.  (FAVOR++: the bound is ``A‖ω_f‖² + B²‖ω_f‖²/2``.)
"""
from __future__ import annotations


import array_api_compat
import numpy as np

from ._validate import (check_choice, check_key_mask, check_positive_int, check_qkv,
                        check_scale)
from .random_features import (EXP_KINDS, NORMS, PROJECTIONS, FeatureRows, RandomFeatures,
                              _apply_g, as_features, check_kind, feature_rows,
                              resolve_gerf_a)
from ._parallel import exp_shifted_
from .kernel import _kernel_attention, rows_of
from .registry import Variant, register

__all__ = ["performer_attention", "performer_maps"]


#: Stands in for +inf in sums that go through a matmul: ``exp(-_BIG) == 0`` exactly in every
#: float dtype, and BLAS never sees an inf (``0 * inf`` would give NaN).
_BIG = 1e30


def _augment(xp, x, *cols):
    """``[x, c_1, c_2, ...]`` along the last axis (batch dims broadcast); a Python float
    ``c`` is a constant column."""
    batch = tuple(x.shape[:-1])
    for c in cols:
        if not isinstance(c, float):
            batch = tuple(np.broadcast_shapes(batch, tuple(c.shape[:-1])))
    parts = [xp.broadcast_to(x, (*batch, x.shape[-1]))]
    for c in cols:
        if isinstance(c, float):
            c = xp.full((*batch, 1), c, dtype=x.dtype, device=array_api_compat.device(x))
        parts.append(xp.broadcast_to(c, (*batch, c.shape[-1])))
    return xp.concat(parts, axis=-1)


def _col(xp, v):
    """A per-row vector ``(..., m')`` as a column ``(..., m', 1)``."""
    return xp.expand_dims(v, axis=-1)


def performer_maps(xp, q, k, rows: FeatureRows, *, scale: float, causal: bool,
                   key_mask=None):
    """Row-block callables ``(i0, i1) -> φq[..., i0:i1, :]`` and
    ``(j0, j1) -> φk[..., j0:j1, :]`` of the stabilised features for attention.

    ``φq_i·φk_j = c_i C K̂_ij`` with ``K̂`` the random-feature estimate of the kernel, a
    per-query factor ``c_i`` and a global ``C`` (both cancel in the attention ratio; module
    docstring).  Masked keys get all-zero features.  ``q, k`` are in the working dtype;
    ``rows`` from :func:`arrayattn.random_features.feature_rows`.

    The features are made block by block (in parallel threads on NumPy) and never held
    whole.  Additive terms of an exponent are folded into the projection matmul as extra
    columns (``[k, ‖k̃‖²/2, 1] @ [W, -1, a - c]^T``) or subtracted with the shift in the
    one pass before ``exp``.  Non-causal exponential kinds: the key callable returns
    ``(φk, shift)``, the block's features and its own shift, which
    :func:`arrayattn.kernel._kernel_attention` merges into one global ``C``
    (``shifted_keys``).
    """
    kind, w = rows.kind, rows.w
    wt = xp.matrix_transpose
    if scale < 0:
        q = -q
    exp_kind = kind in EXP_KINDS
    keep = None if key_mask is None else xp.expand_dims(key_mask, axis=-1)
    # A masked key's ‖k̃‖²/2: +_BIG (exponential maps: its features become 0) or -inf
    # (trig: its factor exp(‖k̃‖²/2) becomes 0).
    fill = _BIG if exp_kind else -xp.inf

    def keys(j0, j1):
        """Rows j0:j1 of k (masked keys zeroed: padding may hold anything, even inf or
        NaN) and their ‖k̃‖²/2, block by block so no (s, d) temporary is made whole."""
        kb = k[..., j0:j1, :]
        hb = xp.sum(kb * kb, axis=-1, keepdims=True) * (abs(scale) / 2)
        if keep is not None:
            kp = keep[..., j0:j1, :]
            kb, hb = xp.where(kp, kb, 0.0), xp.where(kp, hb, fill)
        return kb, hb

    if not exp_kind:
        if kind == "trig":
            # φ(x) ∝ exp(‖x̃‖²/2) [sin, cos](ω·x̃): the query factor cancels; the key
            # factor is divided by its max over the (unmasked) keys -- not causal-safe, so
            # causal trig keeps it unshifted (finite while ‖k̃‖² < 2 log(max float)).
            k, hk = keys(0, k.shape[-2])
            phase = _col(xp, rows.a)
            phi_q = xp.sin(_augment(xp, q, 1.0) @ wt(_augment(xp, w, phase)))
            sk = xp.sin(_augment(xp, k, 1.0) @ wt(_augment(xp, w, phase)))
            if not causal:
                top = xp.max(hk, axis=-2, keepdims=True)
                hk = hk - xp.where(top == -xp.inf, 0.0, top)
            return rows_of(phi_q), rows_of(sk * xp.exp(hk))
        # generalized kernels f(ω·x̃): nothing to stabilise (the constant m^-1/2 cancels)
        k = keys(0, k.shape[-2])[0]
        phi_q, phi_k = _apply_g(xp, rows, q @ wt(w)), _apply_g(xp, rows, k @ wt(w))
        if key_mask is not None:
            phi_k = xp.where(keep, phi_k, 0.0)
        return rows_of(phi_q), rows_of(phi_k)
    a = rows.a
    if causal:
        # Keys: a_f + B ω_f·k̃ - ‖k̃‖²/2 - c_f = -‖k̃ - B ω_f‖²/2 <= 0 depends on that key
        # alone; queries carry +c_f and are divided by their own row max.
        cq = rows.c if a is None else a + rows.c
        ck = -rows.c if a is None else a - rows.c
        wq = wt(_augment(xp, w, _col(xp, cq)))
        wk = wt(_augment(xp, w, -1.0, _col(xp, ck)))

        def key_features(j0, j1):
            return exp_shifted_(xp, _augment(xp, *keys(j0, j1), 1.0) @ wk)
    else:
        # One shift per block of keys, max_j (rowmax(a_j) - ‖k̃_j‖²/2) over its keys,
        # floored so that an all-masked block (every exponent ~ -_BIG) keeps zero
        # features; _kernel_attention merges the blocks' states to one global shift.
        wq = wt(w) if a is None else wt(_augment(xp, w, _col(xp, a)))

        def key_features(j0, j1):
            kb, hb = keys(j0, j1)
            ak = (kb if a is None else _augment(xp, kb, 1.0)) @ wq   # ω·k̃ (+ a)
            top = xp.max(xp.max(ak, axis=-1, keepdims=True) - hb, axis=-2, keepdims=True)
            top = xp.maximum(top, -_BIG / 2)
            return exp_shifted_(xp, ak, hb + top), top
    augment_q = causal or a is not None

    def query_features(i0, i1):
        qb = q[..., i0:i1, :]
        aq = (_augment(xp, qb, 1.0) if augment_q else qb) @ wq
        return exp_shifted_(xp, aq, xp.max(aq, axis=-1, keepdims=True))
    return query_features, key_features


def performer_attention(q, k, v, /, *, features=None, num_features=256, kind="positive",
                        projection="orthogonal", norms="chi", seed=0, scale=None,
                        causal=False, key_mask=None, gerf_a=None):
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
        ``m``, the number of random rows when ``features`` is not given (ignored with
        ``projection="identity"``, where ``m = d``).
    kind : {"positive", "hyperbolic", "trig", "favor++", "relu"} or callable
        Feature map (see :func:`arrayattn.estimate_kernel`).  ``"hyperbolic"`` and
        ``"trig"`` use ``2m`` features.  ``"trig"`` features may be negative, so the
        denominator may be near zero or negative: never clamped here (that would bias).
        ``"favor++"``: GERF optimal positive features (Likhosherstov et al. 2022) with
        ``A = gerf_a`` or the optimal ``A*`` of these inputs (:func:`arrayattn.gerf_parameter`),
        much lower variance on large-norm inputs.  ``"relu"`` or a callable ``f``: the
        generalized kernels ``f(ω·x̃)`` of the Performer paper (section 2.4; not an
        estimate of softmax); with ``projection="identity"``, ``f(x̃)`` without projection.
    projection : {"orthogonal", "iid", "identity"}
        ``"identity"``: no random projection (``ω = I_d``).
    norms : {"chi", "fixed", "quasi"}
    seed : int
        See :meth:`RandomFeatures.draw`.  Same seed, same output on every backend.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    causal : bool
        End-aligned causal attention (query ``i`` sees keys ``j <= i + s - n``).
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key; masked keys leave numerator *and* denominator.
    gerf_a : float or array ``(..., 1, 1)``, optional
        The GERF parameter ``A < 1/8`` of ``kind="favor++"``.  ``None``: the optimal
        ``A*`` of ``q`` and the unmasked keys -- it depends on every key, so
        ``causal=True`` requires an explicit ``gerf_a``.

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
    kind = check_kind(kind)
    scale = check_scale(scale, p.d)
    if features is None:
        check_positive_int("num_features", num_features)
        check_choice("projection", projection, PROJECTIONS)
        check_choice("norms", norms, NORMS)
        m = p.d if projection == "identity" else num_features  # no projection: m = d
        features = RandomFeatures.draw(p.d, m, projection=projection, norms=norms, seed=seed)
    else:
        features = as_features(features, p.d)
    xp = p.xp
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    gerf_a = resolve_gerf_a(xp, kind, gerf_a, q, k, scale, key_mask, causal=causal,
                            work_dtype=p.work_dtype, device=p.device)
    rows = feature_rows(xp, omega, kind, scale, gerf_a=gerf_a)
    wq = xp.astype(q, p.work_dtype, copy=False)
    wk = xp.astype(k, p.work_dtype, copy=False)
    wv = xp.astype(v, p.work_dtype, copy=False)
    if key_mask is not None:  # padded values may hold inf/NaN: 0 * inf would leak
        wv = xp.where(xp.expand_dims(key_mask, axis=-1), wv, 0.0)
    query_features, key_features = performer_maps(xp, wq, wk, rows, scale=scale,
                                                   causal=causal, key_mask=key_mask)
    # eps=0: only a zero denominator (no visible key) gives zeros; nothing is added.
    out, _ = _kernel_attention(xp, wv, query_features=query_features,
                               key_features=key_features, n=p.n, s=p.s, batch=p.batch,
                               causal=causal, key_mask=None, method="chunked", chunk=64,
                               sz0=None, eps=0.0, m=rows.w.shape[-2],
                               shifted_keys=not causal and kind in EXP_KINDS)
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

for _kind, _extra, _causal in (
        ("positive", "FAVOR+ positive features: unbiased, positive.", True),
        ("hyperbolic", "2m features [exp(wx), exp(-wx)]: unbiased, positive, lower variance.",
         True),
        ("trig", "2m sin/cos features: unbiased kernel but may be negative; the denominator "
                 "can be near zero or negative on large-norm inputs.", True),
        ("favor++", "FAVOR++ (Likhosherstov et al. 2022, Chefs' Random Tables): GERF positive "
                    "features with the variance-optimal A* of the inputs; unbiased, far lower "
                    "error than FAVOR+ at large norms. Causal only with an explicit gerf_a= "
                    "(A* depends on every key).", False),
        ("relu", "Generalized kernel relu(w.x)/sqrt(m) (Performer paper sec. 2.4): not an "
                 "estimate of softmax; projection='identity' gives relu(x) without "
                 "projection.", True)):
    register(Variant(
        name=f"performer_{_kind.replace('++', 'pp')}",
        fn=performer_attention,
        call=_uniform_call,
        family="random_features",
        exact=False,
        causal=_causal,
        key_mask=True,
        normalized=True,
        defaults={"kind": _kind, "num_features": 256, "projection": "orthogonal",
                  "norms": "chi", "seed": 0},
        parameter="num_features",
        random=True,
        complexity="O((n + s) m d) time, O((n + s) m) memory",
        citation="Choromanski et al. 2020, Rethinking Attention with Performers (ICLR 2021)"
                 + ("; Likhosherstov et al. 2022, Chefs' Random Tables (NeurIPS 2022)"
                    if _kind == "favor++" else ""),
        notes=f"{_extra} {_NOTES}",
    ))
