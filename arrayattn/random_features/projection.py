"""The random projection of random-feature attention (:class:`RandomFeatures`), drawn on the
host from a seed or given by the caller."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..kernel.checks import check_draw, check_omega
from ..core.xp import to_numpy, xp_from_host

__all__ = ["RandomFeatures", "as_features"]


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
        d, m, seed = check_draw(d, m, projection, norms, seed)
        if projection == "identity":
            omega = np.eye(d)
            omega.setflags(write=False)
            return cls(omega=omega, projection="identity", norms="unit", seed=None)
        omega = _draw_cached(d, m, projection, norms, seed).copy()
        omega.setflags(write=False)
        return cls(omega=omega, projection=projection, norms=norms, seed=seed)

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
        host = check_omega(np.asarray(to_numpy(omega)))
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
