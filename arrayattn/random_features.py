r"""Random features for the softmax kernel (Performer / FAVOR+).

Choromanski et al. 2020, "Rethinking Attention with Performers" (ICLR 2021).  For
``x̃ = sqrt(scale) x`` and ``ω ~ N(0, I_d)``,

.. math::

    \exp(\tilde q\cdot\tilde k) = \mathbb E_\omega\!\left[
        e^{\omega\cdot\tilde q - \|\tilde q\|^2/2}\; e^{\omega\cdot\tilde k - \|\tilde k\|^2/2}
    \right],

so ``m`` draws ``ω_1..ω_m`` (the rows of a :class:`RandomFeatures`) give an unbiased
estimate ``φ(q)·φ(k)`` of the softmax kernel ``exp(scale q·k)``.  This module holds the
host-drawn projection, the feature maps (``"positive"``, ``"hyperbolic"``, ``"trig"``),
the dense kernel estimate for diagnostics (:func:`estimate_kernel`) and the closed-form
variance of the estimators (:func:`kernel_variance`, the paper's Lemma 2).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ._engine import entry
from ._validate import check_choice, check_positive_int, check_qkv, check_scale, check_seed
from ._xp import to_numpy, xp_from_host
from .reference import favor_rows

__all__ = ["RandomFeatures", "estimate_kernel", "kernel_variance", "gerf_parameter",
           "FEATURE_KINDS", "as_features", "check_kind", "resolve_gerf_a"]

PROJECTIONS = ("iid", "orthogonal", "identity")
#: The largest projection drawn on the host (``m * d`` float64 values): more is a typo (an
#: orthogonal draw of ``num_features=10**12`` would loop over ~1e10 QR blocks).
MAX_OMEGA_BYTES = 1 << 33
NORMS = ("chi", "fixed", "quasi")
#: Feature maps, name -> number of features per random row.  The first four estimate the
#: softmax kernel; "relu" (like a caller's function f) is a generalized kernel f(ω·x̃).
FEATURE_KINDS = {"positive": 1, "hyperbolic": 2, "trig": 2, "favor++": 1, "relu": 1}


# ---------------------------------------------------------------------------------
# The projection
# ---------------------------------------------------------------------------------

def _orthogonal_directions(rng, m: int, d: int) -> np.ndarray:
    """``m`` unit rows in blocks of ``d`` mutually orthogonal ones, each block Haar.

    QR of a Gaussian matrix gives ``Q`` whose distribution depends on the sign
    convention of the QR routine; ``Q diag(sign(diag R))`` is exactly Haar
    (Mezzadri 2007, "How to generate random matrices from the classical compact groups").
    """
    blocks = []
    for _ in range(-(-m // d)):
        g = rng.standard_normal((d, d))
        qm, r = np.linalg.qr(g)
        signs = np.where(np.diagonal(r) < 0, -1.0, 1.0)
        blocks.append((qm * signs[None, :]).T)  # rows of a Haar orthogonal matrix
    return np.concatenate(blocks, axis=0)[:m]


def _quasi_radii(rng, m: int, d: int) -> np.ndarray:
    """Radii at the chi_d quantiles ``(i - 1/2)/m``, in random order."""
    from scipy.stats import chi

    radii = chi.ppf((np.arange(m) + 0.5) / m, df=d)
    return radii[rng.permutation(m)]


@functools.lru_cache(maxsize=64)
def _draw_cached(d: int, m: int, projection: str, norms: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if projection == "iid":
        omega = rng.standard_normal((m, d))
        if norms == "chi":
            return omega  # radius and direction of a Gaussian are independent already
        directions = omega / np.linalg.norm(omega, axis=1, keepdims=True)
    else:
        directions = _orthogonal_directions(rng, m, d)
    if norms == "chi":
        radii = np.linalg.norm(rng.standard_normal((m, d)), axis=1)
    elif norms == "fixed":
        radii = np.full(m, math.sqrt(d))
    else:
        radii = _quasi_radii(rng, m, d)
    return directions * radii[:, None]


@dataclass(frozen=True, eq=False)
class RandomFeatures:
    r"""A random projection ``ω (m, d)`` for random-feature attention, and how it was drawn.

    Immutable: ``omega`` is a read-only float64 NumPy array on the host; it is cast and
    moved to the caller's device once per call (:meth:`on`).  Build one with
    :meth:`draw` (seeded, reproducible on every backend) or :meth:`from_matrix` (replay
    a caller's or a peer's matrix exactly).

    Attributes
    ----------
    omega : numpy.ndarray, shape ``(m, d)``
        The projection rows ``ω_1 .. ω_m`` (float64, read-only).
    projection : str
        ``"iid"``, ``"orthogonal"`` or ``"given"`` (from :meth:`from_matrix`).
    norms : str
        ``"chi"``, ``"fixed"``, ``"quasi"`` or ``"given"``.
    seed : int or None
        The seed of :meth:`draw` (``None`` for a given matrix).

    Examples
    --------
    >>> from arrayattn import RandomFeatures
    >>> f = RandomFeatures.draw(4, 6, seed=1)
    >>> f.m, f.d, f.projection, f.norms
    (6, 4, 'orthogonal', 'chi')
    >>> import numpy as np
    >>> u = f.omega / np.linalg.norm(f.omega, axis=1, keepdims=True)
    >>> bool(np.allclose(u[:4] @ u[:4].T, np.eye(4)))  # one orthogonal block of d rows
    True
    >>> g = RandomFeatures.from_matrix(f.omega)
    >>> bool(np.array_equal(g.omega, f.omega)), g.projection
    (True, 'given')
    """

    omega: np.ndarray
    projection: str = "given"
    norms: str = "given"
    seed: int | None = None

    @property
    def m(self) -> int:
        """Number of random rows (features per query before the kind's multiplier)."""
        return self.omega.shape[0]

    @property
    def d(self) -> int:
        """Dimension of the queries and keys the projection applies to."""
        return self.omega.shape[1]

    @classmethod
    def draw(cls, d: int, m: int, *, projection: str = "orthogonal", norms: str = "chi",
             seed: int = 0) -> "RandomFeatures":
        r"""Draw ``m`` rows in dimension ``d`` on the host with ``default_rng(seed)``.

        Parameters
        ----------
        d, m : int
            Dimension and number of rows.
        projection : {"orthogonal", "iid", "identity"}
            ``"iid"``: rows ``ω ~ N(0, I_d)`` independently.  ``"identity"``: no random
            projection, ``ω = I_d`` (requires ``m = d``; ``norms`` and ``seed`` unused) --
            for the generalized kernels ``f(x̃)`` of the Performer paper.  ``"orthogonal"``: blocks of
            ``d`` mutually orthogonal directions, each block Haar-distributed (QR of a
            Gaussian matrix with the sign fix ``Q diag(sign(diag R))``), independent
            blocks when ``m > d``, the last block truncated (Performer's ORFs).
        norms : {"chi", "fixed", "quasi"}
            Row lengths.  ``"chi"``: norms of fresh Gaussian vectors (independent of the
            directions), so every row is marginally ``N(0, I_d)`` and the estimators are
            unbiased.  ``"fixed"``: every row has length ``sqrt(d)`` -- *biased* (the
            kernel estimate no longer has expectation ``exp(q·k)``).  ``"quasi"``: radii
            at the chi_d quantiles ``(i - 1/2)/m``, randomly permuted: the radius
            distribution is covered evenly instead of sampled -- a deterministic
            quadrature of the radius, *biased* at finite ``m`` (the bias shrinks as ``m``
            grows; see the Performer docs page for measured bias and variance).  With
            ``projection="iid"``, ``"chi"`` keeps the Gaussian rows as drawn and the other
            two rescale their directions.
        seed : int
            Seed of ``numpy.random.default_rng``; same seed, same matrix, any backend.

        Notes
        -----
        Draw order (so a port can reproduce it): for ``"iid"``, one
        ``standard_normal((m, d))``; for ``"orthogonal"``, ``ceil(m/d)`` calls
        ``standard_normal((d, d))`` (block ``b`` = rows of ``Q_b diag(sign(diag R_b))``,
        ``Q_b R_b = numpy.linalg.qr``); then for ``"chi"`` norms of
        ``standard_normal((m, d))`` rows, for ``"quasi"`` one ``permutation(m)``.
        """
        d = check_positive_int("d", d)
        m = check_positive_int("m", m)
        check_choice("projection", projection, PROJECTIONS)
        check_choice("norms", norms, NORMS)
        seed = check_seed(seed)
        if m * d * 8 > MAX_OMEGA_BYTES:
            raise ValueError(
                f"num_features (m) = {m} rows of d = {d} need a {m * d * 8 / 2**30:.3g} GiB "
                f"float64 host matrix (m, d); the limit is {MAX_OMEGA_BYTES / 2**30:g} GiB "
                f"(MAX_OMEGA_BYTES): use fewer features")
        if projection == "identity":
            if m != d:
                raise ValueError(f"projection='identity' (no random projection) has m = d = "
                                 f"{d} rows; got m={m}")
            omega = np.eye(d)
            omega.setflags(write=False)
            return cls(omega=omega, projection="identity", norms="unit", seed=None)
        omega = _draw_cached(d, m, projection, norms, int(seed))
        omega = omega.copy()
        omega.setflags(write=False)
        return cls(omega=omega, projection=projection, norms=norms, seed=int(seed))

    @classmethod
    def from_matrix(cls, omega) -> "RandomFeatures":
        """Wrap a caller's projection matrix ``omega (m, d)`` (any array library).

        The matrix is copied to the host in float64 once; every later call casts it to
        the inputs' dtype and device, so a peer's matrix is replayed exactly.

        Examples
        --------
        >>> import numpy as np
        >>> from arrayattn import RandomFeatures
        >>> f = RandomFeatures.from_matrix(np.ones((3, 2)))
        >>> f.m, f.d
        (3, 2)
        """
        if isinstance(omega, RandomFeatures):
            return omega
        host = np.asarray(to_numpy(omega))
        if np.iscomplexobj(host) or not (np.issubdtype(host.dtype, np.floating)
                                         or np.issubdtype(host.dtype, np.integer)):
            raise TypeError(f"omega must be a real matrix; got dtype {host.dtype}")
        host = np.array(host, dtype=np.float64, copy=True)
        if host.ndim != 2 or host.shape[0] < 1 or host.shape[1] < 1:
            raise ValueError(
                f"omega must be a non-empty 2-D matrix (m, d); got shape {host.shape}")
        if not np.isfinite(host).all():
            raise ValueError("omega contains non-finite values")
        host.setflags(write=False)
        return cls(omega=host)

    def on(self, xp, *, dtype, device):
        """``omega`` as an ``xp`` array of ``dtype`` on ``device``."""
        # A writable copy: some libraries (torch) warn on read-only buffers.
        return xp_from_host(xp, np.array(self.omega), dtype=dtype, device=device)

    def __repr__(self) -> str:
        return (f"RandomFeatures(m={self.m}, d={self.d}, projection={self.projection!r}, "
                f"norms={self.norms!r}, seed={self.seed!r})")


def as_features(features, d: int, *, name: str = "features") -> RandomFeatures:
    """A :class:`RandomFeatures` from ``features`` (or a matrix), checked against ``d``."""
    if not isinstance(features, RandomFeatures):
        features = RandomFeatures.from_matrix(features)
    if features.d != d:
        raise ValueError(
            f"{name} has dimension d={features.d} (omega shape {features.omega.shape}) but "
            f"the queries and keys have d={d}")
    return features


# ---------------------------------------------------------------------------------
# Feature maps.  Every map is  φ(x)_f = exp(κ) g(x·W_f + a_f, x)  with rows W (the random
# rows times sqrt(|scale|), and B for GERF), an additive term a_f, a constant κ, and g one of
#   exp kinds:   exp(t - ‖x̃‖²/2)        (positive, hyperbolic, favor++)
#   trig:        exp(‖x̃‖²/2) sin(t)     (a_f = 0 or π/2 gives sin and cos)
#   generalized: f(t)                    (relu, or a caller's function; a_f = 0)
# The rows are arrayattn.reference.favor_rows: they serve the dense diagnostic
# (estimate_kernel), the reference form and the NumPy engine.
# ---------------------------------------------------------------------------------

EXP_KINDS = ("positive", "hyperbolic", "favor++")


def _log_constant(xp, kind, m: int, d: int, gerf_a):
    """The log of the constant factor of ``φ`` per side: ``m^-1/2`` (hyperbolic:
    ``(2m)^-1/2``), and for favor++ also ``D = (1 - 4A)^{d/4}``."""
    log_c = -0.5 * math.log(2 * m if kind == "hyperbolic" else m)
    if kind == "favor++":
        one = 1 - 4 * gerf_a
        log_c = log_c + (d / 4) * (math.log(one) if isinstance(one, float) else xp.log(one))
    return log_c


def _parts(xp, x, kind, rows, scale: float, log_c):
    """``(b, l)`` with ``φ(x) = exp(l) b``: ``b (..., t, m')`` bounded (exp kinds: in
    ``(0, 1]``, trig: in ``[-1, 1]``), ``l (..., t, 1)`` a per-row log-factor; ``rows``
    from :func:`arrayattn.reference.favor_rows`."""
    w, a, _ = rows
    t = x @ xp.matrix_transpose(w) + a
    h = xp.sum(x * x, axis=-1, keepdims=True) * (abs(scale) / 2)
    if kind == "trig":
        return xp.sin(t), h + log_c
    if kind in EXP_KINDS:
        top = xp.max(t, axis=-1, keepdims=True)
        return xp.exp(t - top), top - h + log_c
    g = xp.maximum(t, 0.0) if kind == "relu" else kind(t)
    return g, xp.zeros_like(h) + log_c


def check_kind(kind):
    """A registered kind name, or a caller's callable (a generalized kernel ``f(ω·x̃)``)."""
    if callable(kind):
        return kind
    return check_choice("kind", kind, tuple(FEATURE_KINDS))


def gerf_parameter(q, k, /, *, scale=None, key_mask=None):
    r"""The variance-optimal GERF parameter ``A*`` of FAVOR++ for these inputs.

    Likhosherstov et al. 2022, "Chefs' Random Tables: Non-Trigonometric Random Features"
    (NeurIPS 2022).  Minimising the log second moment averaged over all pairs,

    .. math::

        A^* = \frac{1 - 2\rho - \sqrt{(2\rho + 1)^2 + 8\rho}}{16},\qquad
        \rho = \frac{1}{d\, n s}\sum_{i,j} \|\tilde q_i + \tilde k_j\|^2
             = \frac{\overline{\|\tilde q\|^2} + \overline{\|\tilde k\|^2}
               + 2\,\bar{\tilde q}\cdot\bar{\tilde k}}{d}

    (computed in ``O((n + s) d)``; masked keys excluded).  ``A* <= 0``, with ``A* = 0``
    (plain FAVOR+) only when ``ρ = 0``.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    scale : float, optional
        ``None`` means ``1/sqrt(d)`` (``x̃ = sqrt(scale) x``).
    key_mask : boolean array, shape ``(..., s)``, optional
        Only the real keys enter the means.

    Returns
    -------
    array, shape ``(..., 1, 1)``
        One ``A`` per batch element, in the working dtype of ``q``.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import gerf_parameter
    >>> q = np.zeros((1, 3, 4)); k = np.zeros((1, 5, 4))
    >>> float(gerf_parameter(q, k)[0, 0, 0])
    0.0
    """
    p = check_qkv(q, k, k, names=("q", "k", "k"))
    xp = p.xp
    scale = check_scale(scale, p.d)
    root = math.sqrt(abs(scale))
    qt = xp.astype(q, p.work_dtype, copy=False) * (-root if scale < 0 else root)
    kt = xp.astype(k, p.work_dtype, copy=False) * root
    mq = xp.mean(xp.sum(qt * qt, axis=-1, keepdims=True), axis=-2, keepdims=True)
    qbar = xp.mean(qt, axis=-2, keepdims=True)
    if key_mask is None:
        mk = xp.mean(xp.sum(kt * kt, axis=-1, keepdims=True), axis=-2, keepdims=True)
        kbar = xp.mean(kt, axis=-2, keepdims=True)
    else:
        wgt = xp.astype(xp.expand_dims(key_mask, axis=-1), p.work_dtype)
        cnt = xp.maximum(xp.sum(wgt, axis=-2, keepdims=True), 1.0)
        kt = xp.where(xp.expand_dims(key_mask, axis=-1), kt, 0.0)   # NaN padding: no 0 * NaN
        mk = xp.sum(xp.sum(kt * kt, axis=-1, keepdims=True), axis=-2, keepdims=True) / cnt
        kbar = xp.sum(kt, axis=-2, keepdims=True) / cnt
    rho = (mq + mk + 2 * xp.sum(qbar * kbar, axis=-1, keepdims=True)) / p.d
    return (1 - 2 * rho - xp.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16


def resolve_gerf_a(xp, kind, gerf_a, q, k, scale, key_mask, *, work_dtype, device,
                   causal=False):
    """``gerf_a`` for ``kind="favor++"``: the caller's (float or array), else ``A*`` of the
    inputs (non-causal only: it depends on every key).  ``None`` for other kinds."""
    if kind != "favor++":
        if gerf_a is not None:
            raise ValueError(f"gerf_a is only used with kind='favor++'; got kind={kind!r}")
        return None
    if gerf_a is None:
        if causal:
            raise ValueError(
                "kind='favor++' cannot be causal with the data-dependent optimal A*: it "
                "averages over every key, so a future key would change past outputs; pass "
                "a fixed gerf_a= (e.g. from gerf_parameter on a calibration batch)")
        return gerf_parameter(q, k, scale=scale, key_mask=key_mask)
    if isinstance(gerf_a, (int, float)) and not isinstance(gerf_a, bool):
        if not gerf_a < 0.125:
            raise ValueError(f"gerf_a must be < 1/8 (finite variance); got {gerf_a}")
        return float(gerf_a)
    arr = xp.astype(gerf_a, work_dtype)
    if arr.ndim < 2 or tuple(arr.shape[-2:]) != (1, 1):
        raise ValueError(f"gerf_a must be a float or an array (..., 1, 1); got shape "
                         f"{tuple(arr.shape)}")
    return arr


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
    log_c = _log_constant(xp, kind, features.m, p.d, gerf_a)
    wq = xp.astype(q, p.work_dtype, copy=False)
    if scale < 0:
        wq = -wq
    wk = xp.astype(k, p.work_dtype, copy=False)
    if key_mask is not None:   # padding may hold NaN: a masked key's column is 0
        wk = xp.where(xp.expand_dims(key_mask, axis=-1), wk, 0.0)
    with entry(xp):
        bq, lq = _parts(xp, wq, kind, rows, scale, log_c)
        bk, lk = _parts(xp, wk, kind, rows, scale, log_c)
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
