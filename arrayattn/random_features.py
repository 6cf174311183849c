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
import numbers
from dataclasses import dataclass

import numpy as np

from ._validate import check_choice, check_positive_int, check_qkv, check_scale
from ._xp import to_numpy, xp_from_host

__all__ = ["RandomFeatures", "estimate_kernel", "kernel_variance", "FEATURE_KINDS"]

PROJECTIONS = ("iid", "orthogonal")
NORMS = ("chi", "fixed", "quasi")
#: Feature maps of the softmax kernel, name -> number of features per random row.
FEATURE_KINDS = {"positive": 1, "hyperbolic": 2, "trig": 2}


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
        projection : {"orthogonal", "iid"}
            ``"iid"``: rows ``ω ~ N(0, I_d)`` independently.  ``"orthogonal"``: blocks of
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
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise TypeError(f"seed must be a non-negative integer; got {seed!r}")
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
        host = np.array(to_numpy(omega), dtype=np.float64, copy=True)
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
# Feature maps.  Every map is written as  φ(x) = exp(l(x)) · b(x)  with a bounded body
# b (entries in [-1, 1]) and a per-row log-factor l, so that products of features can be
# formed without overflow and the factors that cancel in attention can be dropped.
# ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Projected:
    """``P = x̃ ω^T (..., t, m)`` and ``h = ‖x̃‖²/2 (..., t, 1)`` of one side."""

    p: object
    h: object


def _project(xp, x, omega, scale: float, *, sign: float = 1.0) -> _Projected:
    """Project ``x (..., t, d)`` with ``x̃ = sign·sqrt(|scale|)·x``."""
    root = math.sqrt(abs(scale))
    w = omega * (sign * root)
    p = x @ xp.matrix_transpose(w)
    h = xp.sum(x * x, axis=-1, keepdims=True) * (abs(scale) / 2)
    return _Projected(p, h)


def _exponents(xp, pr: _Projected, kind: str):
    """The linear exponents ``A`` of the exp-kinds: ``P`` or ``[P, -P]``."""
    if kind == "hyperbolic":
        return xp.concat([pr.p, -pr.p], axis=-1)
    return pr.p


def _log_norm(kind: str, m: int) -> float:
    """``log`` of the constant factor ``m^-1/2`` (``(2m)^-1/2`` for hyperbolic)."""
    return -0.5 * math.log(2 * m if kind == "hyperbolic" else m)


def _parts(xp, pr: _Projected, kind: str, m: int):
    """``(b, l)`` with ``φ(x) = exp(l) b``, ``b (..., t, m')`` in ``[-1, 1]``, ``l (..., t, 1)``.

    positive: ``b = exp(P - max_f P)``, ``l = max_f P - h - log(m)/2``;
    hyperbolic: the same on ``A = [P, -P]`` with ``log(2m)/2``;
    trig: ``b = [sin P, cos P]``, ``l = h - log(m)/2``.
    """
    c = _log_norm(kind, m)
    if kind == "trig":
        return xp.concat([xp.sin(pr.p), xp.cos(pr.p)], axis=-1), pr.h + c
    a = _exponents(xp, pr, kind)
    top = xp.max(a, axis=-1, keepdims=True)
    return xp.exp(a - top), top - pr.h + c


def _check_kind(kind) -> str:
    return check_choice("kind", kind, tuple(FEATURE_KINDS))


def estimate_kernel(q, k, features, /, *, kind="positive", scale=None):
    r"""The random-feature estimate ``φ(q) φ(k)^T`` of the softmax kernel, as a dense matrix.

    .. math::

        \widehat K_{ij} = \phi(q_i)\cdot\phi(k_j) \approx \exp(\mathrm{scale}\; q_i\cdot k_j)

    with, for ``x̃ = sqrt(scale) x`` and the rows ``ω_f`` of ``features``,

    * ``"positive"``: ``φ(x)_f = m^{-1/2} exp(ω_f·x̃ - ‖x̃‖²/2)`` (FAVOR+, positive and
      unbiased);
    * ``"hyperbolic"``: ``φ(x) = (2m)^{-1/2} exp(-‖x̃‖²/2) [exp(ω x̃), exp(-ω x̃)]``
      (``2m`` features, positive, unbiased, lower variance);
    * ``"trig"``: ``φ(x) = m^{-1/2} exp(‖x̃‖²/2) [sin(ω x̃), cos(ω x̃)]`` (``2m`` features,
      unbiased, **may be negative**).

    Meant for diagnostics and tests (it forms the ``(..., n, s)`` matrix).  Products are
    formed as ``(b_q b_k^T) exp(l_q + l_k)`` with bounded bodies ``b``, so an entry is
    finite whenever the estimate itself is representable.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    features : RandomFeatures or array ``(m, d)``
        The projection (an array is wrapped with :meth:`RandomFeatures.from_matrix`).
    kind : {"positive", "hyperbolic", "trig"}
    scale : float, optional
        ``None`` means ``1/sqrt(d)``; a negative scale estimates ``exp(-|scale| q·k)``.

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
    kind = _check_kind(kind)
    scale = check_scale(scale, p.d)
    features = as_features(features, p.d)
    xp = p.xp
    omega = features.on(xp, dtype=p.work_dtype, device=p.device)
    wq = xp.astype(q, p.work_dtype, copy=False)
    wk = xp.astype(k, p.work_dtype, copy=False)
    sign = -1.0 if scale < 0 else 1.0
    bq, lq = _parts(xp, _project(xp, wq, omega, scale, sign=sign), kind, features.m)
    bk, lk = _parts(xp, _project(xp, wk, omega, scale), kind, features.m)
    out = (bq @ xp.matrix_transpose(bk)) * xp.exp(lq + xp.matrix_transpose(lk))
    return xp.astype(out, p.dtype, copy=False)


def kernel_variance(q, k, /, *, num_features, kind="positive", scale=None):
    r"""Closed-form variance of the ``m``-feature estimate of ``exp(scale q·k)``, iid ``ω``.

    Choromanski et al. 2020, Lemma 2 (and its hyperbolic analogue), with
    ``x = x̃_q``, ``y = x̃_k``, ``SM = exp(x·y)``:

    .. math::

        \mathrm{Var}_{\mathrm{positive}} &= \tfrac1m\, SM^2 \left(e^{\|x+y\|^2} - 1\right)\\
        \mathrm{Var}_{\mathrm{hyperbolic}} &= \tfrac1m\, SM^2
            \left(\cosh\|x+y\|^2 - 1\right)\\
        \mathrm{Var}_{\mathrm{trig}} &= \tfrac{1}{2m}\, e^{\|x\|^2+\|y\|^2}
            \left(1 - e^{-\|x-y\|^2}\right)^2

    (``m`` random rows, i.e. ``m`` features for positive and ``2m`` for the other two).
    Valid for ``projection="iid"``, ``norms="chi"``; orthogonal rows have lower variance
    (Theorem 2 of the paper; tested empirically).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    num_features : int
        ``m``, the number of random rows.
    kind : {"positive", "hyperbolic", "trig"}
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.

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
    kind = _check_kind(kind)
    scale = check_scale(scale, p.d)
    m = check_positive_int("num_features", num_features)
    xp = p.xp
    wq = xp.astype(q, p.work_dtype, copy=False) * math.sqrt(abs(scale))
    if scale < 0:
        wq = -wq
    wk = xp.astype(k, p.work_dtype, copy=False) * math.sqrt(abs(scale))
    xy = wq @ xp.matrix_transpose(wk)
    nq = xp.sum(wq * wq, axis=-1, keepdims=True)
    nk = xp.matrix_transpose(xp.sum(wk * wk, axis=-1, keepdims=True))
    if kind == "trig":
        diff = nq + nk - 2 * xy          # ‖x - y‖²
        out = xp.exp(nq + nk) * (-xp.expm1(-diff)) ** 2 / (2 * m)
    else:
        plus = nq + nk + 2 * xy          # ‖x + y‖²
        if kind == "positive":
            # SM² (e^{u} - 1) = exp(2xy + u) - exp(2xy), with expm1 for small u.
            out = xp.exp(2 * xy) * xp.expm1(plus) / m
        else:
            # cosh(u) - 1 = 2 sinh²(u/2)
            out = xp.exp(2 * xy) * 2 * xp.sinh(plus / 2) ** 2 / m
    return xp.astype(out, p.dtype, copy=False)
