"""The Moore–Penrose pseudo-inverse of batched matrices, exact (SVD) or iterative.

Nyströmformer (Xiong et al. 2021) needs ``pinv`` of the ``m x m`` landmark softmax
matrix.  Two methods are offered:

* ``"svd"`` -- the array API ``linalg`` extension's ``pinv`` (an SVD), with an explicit
  relative cutoff ``rtol`` for small singular values;
* ``"iterative"`` -- the third-order iteration of Razavi et al. (2014), as used by
  Nyströmformer: matmuls only, so it runs and differentiates on any array library and
  needs no ``linalg`` extension.
"""
from __future__ import annotations

import math
import numbers

from ._parallel import parallel_map, split_rows
from ._validate import check_choice, check_positive_int
from ._xp import compute_dtype, xp_device, xp_namespace

__all__ = ["pinv"]

PINV_METHODS = ("svd", "iterative")
PINV_INITS = ("per_matrix", "global")


def _eye_like(xp, a):
    """``I_p`` for ``a (..., p, q)``, in ``a``'s dtype and on its device."""
    return xp.eye(a.shape[-2], dtype=a.dtype, device=xp_device(a))


def _svd_pinv(xp, a, rtol):
    linalg = getattr(xp, "linalg", None)
    if linalg is None or not hasattr(linalg, "pinv"):
        raise ValueError(
            f"pinv(method='svd') needs the array API 'linalg' extension, which the "
            f"namespace {getattr(xp, '__name__', xp)!r} does not provide; use "
            "method='iterative' (matmuls only)"
        )
    if rtol is None:
        rtol = max(a.shape[-2], a.shape[-1]) * float(xp.finfo(a.dtype).eps)
    p, q = a.shape[-2], a.shape[-1]
    lead = tuple(a.shape[:-2])
    count = math.prod(lead)
    # Groups of whole matrices in parallel threads on NumPy (LAPACK runs one small SVD
    # on one core: 8 SVDs of 64 x 64 took 8 ms, 3.9 ms in two groups); a matrix's work
    # ~ p q min(p, q) stands in for its bytes.
    groups = split_rows(xp, count, row_bytes=4 * p * q * min(p, q))
    if len(groups) < 2:
        return linalg.pinv(a, rtol=rtol)
    flat = xp.reshape(a, (count, p, q))
    parts = parallel_map(xp, lambda g: linalg.pinv(flat[g[0]:g[1], ...], rtol=rtol), groups)
    return xp.reshape(xp.concat(parts, axis=0), (*lead, q, p))


def _iterative_pinv(xp, a, iters: int, init: str):
    """Razavi et al. (2014): ``Z <- Z (13 I - AZ (15 I - AZ (7 I - AZ))) / 4``.

    ``Z0 = A^T / (||A||_1 ||A||_inf)``.  Writing ``R = I - AZ``, one step maps ``R`` to
    ``(3 R^3 + R^4) / 4``: third-order convergence, and since ``Z`` stays a polynomial in
    ``A^T A`` times ``A^T`` every singular direction converges independently and
    monotonically from ``r0 = 1 - sigma^2 / (||A||_1 ||A||_inf)``.
    """
    absa = xp.abs(a)
    col = xp.max(xp.sum(absa, axis=-2), axis=-1)   # ||A||_1 per matrix  (...,)
    row = xp.max(xp.sum(absa, axis=-1), axis=-1)   # ||A||_inf per matrix (...,)
    if init == "global":
        # One max over every matrix of the batch and every head, as the official code
        # and the popular ports do (slower: a sharp head shrinks every head's Z0).
        col, row = xp.max(col), xp.max(row)
    denom = col * row
    alpha = xp.where(denom > 0, 1.0 / xp.where(denom > 0, denom, 1.0), 0.0)  # A = 0 -> Z = 0
    if init == "per_matrix":
        alpha = alpha[..., None, None]
    z = xp.matrix_transpose(a) * alpha
    eye = _eye_like(xp, a)
    for _ in range(iters):
        az = a @ z
        z = 0.25 * (z @ (13.0 * eye - az @ (15.0 * eye - az @ (7.0 * eye - az))))
    return z


def _residual(xp, a, z):
    """``||I - A Z||_F`` for every matrix of the batch, shape ``(...)``."""
    r = _eye_like(xp, a) - a @ z
    return xp.sqrt(xp.sum(r * r, axis=(-2, -1)))


def pinv(a, /, *, method="svd", iters=6, init="per_matrix", rtol=None,
         return_residual=False):
    r"""Moore–Penrose pseudo-inverse of a batch of matrices.

    ``Z = pinv(a)`` is the unique matrix with :math:`AZA = A`, :math:`ZAZ = Z`,
    :math:`(AZ)^\top = AZ` and :math:`(ZA)^\top = ZA`.

    Parameters
    ----------
    a : array, shape ``(..., p, q)``
        Real floating matrices; leading dimensions are a batch.
    method : {"svd", "iterative"}
        ``"svd"``: the array API ``linalg.pinv`` (an SVD); singular values at most
        ``rtol * sigma_max`` are treated as zero.  ``"iterative"``: the iteration of
        Razavi et al. (2014) used by Nyströmformer,

        .. math:: Z_{k+1} = \tfrac14 Z_k\,(13 I - A Z_k (15 I - A Z_k (7 I - A Z_k))),
                  \qquad Z_0 = \frac{A^\top}{\lVert A\rVert_1 \lVert A\rVert_\infty},

        matmuls only (runs and differentiates on every library).  With
        :math:`R = I - AZ` one step maps :math:`R \mapsto (3R^3 + R^4)/4`, so each singular
        direction converges monotonically and with third order once
        :math:`1 - \sigma^2/(\lVert A\rVert_1\lVert A\rVert_\infty)` is well below 1; a
        direction with small :math:`\sigma` needs about
        :math:`\log_{3.25}(\lVert A\rVert_1\lVert A\rVert_\infty / \sigma^2)` steps to
        start.  There is no cutoff: enough iterations also invert rounding-level
        singular values of a numerically singular ``a``.
    iters : int
        Number of iterations of the ``"iterative"`` method (ignored by ``"svd"``).
        Nyströmformer uses 6.
    init : {"per_matrix", "global"}
        Scaling of :math:`Z_0` for ``"iterative"``: ``"per_matrix"`` uses each matrix's
        own norms (default; never slower, see Notes); ``"global"`` takes one maximum of
        each norm over the whole batch (all heads), as the official Nyströmformer code
        and the popular ports do -- a compatibility option.
    rtol : float, optional
        Relative cutoff of ``"svd"``; ``None`` means ``max(p, q) * eps`` of the working
        dtype (the array API default, made explicit so every backend agrees).
    return_residual : bool
        Also return :math:`\lVert I_p - AZ\rVert_F` per matrix, shape ``(...)``: 0 at
        convergence for an invertible ``a``, :math:`\sqrt{p - \operatorname{rank} A}` for
        an exact pseudo-inverse of a rank-deficient or wide/tall one.

    Returns
    -------
    z : array, shape ``(..., q, p)``
        Same namespace, device and dtype as ``a`` (float16/bfloat16 are computed in
        float32).
    residual : array, shape ``(...)``
        Only with ``return_residual=True``.

    Raises
    ------
    TypeError
        ``a`` is not a real floating array.
    ValueError
        ``a`` has fewer than 2 dimensions; unknown ``method``/``init``; ``rtol`` given
        for ``"iterative"`` or ``init="global"`` for ``"svd"``; ``"svd"`` on a namespace
        without the ``linalg`` extension.

    Notes
    -----
    Since :math:`\lVert A\rVert_2^2 \le \lVert A\rVert_1\lVert A\rVert_\infty`, every
    :math:`r_0` lies in :math:`[0, 1)` for a nonzero singular value.  The map
    :math:`r \mapsto (3r^3 + r^4)/4` is increasing, and the global scaling only makes
    :math:`Z_0` smaller, hence every :math:`r_0` larger: per-matrix scaling reaches any
    residual in no more iterations than the global one, usually in fewer when one head
    of the batch is much sharper than the others.

    References
    ----------
    M. Kafaei Razavi, A. Kerayechian, M. Gachpazan, S. Shateyi (2014), "A new iterative
    method for finding approximate inverses of complex matrices", Abstract and Applied
    Analysis.  Xiong et al. (2021), "Nyströmformer", AAAI.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import pinv
    >>> a = np.array([[[2.0, 1.0], [1.0, 3.0]], [[1.0, 2.0], [2.0, 4.0]]])  # 2nd singular
    >>> z = pinv(a)
    >>> bool(np.allclose(a @ z @ a, a)) and bool(np.allclose(z[1], np.linalg.pinv(a[1])))
    True
    >>> zi, res = pinv(a[:1], method="iterative", iters=8, return_residual=True)
    >>> bool(np.allclose(zi, np.linalg.inv(a[:1]))), bool(res[0] < 1e-12)
    (True, True)
    """
    xp = xp_namespace(a)
    if a.ndim < 2:
        raise ValueError(f"a must have at least 2 dimensions (..., p, q); got shape "
                         f"{tuple(a.shape)}")
    if not xp.isdtype(a.dtype, "real floating"):
        raise TypeError(f"a must have a real floating dtype; got {a.dtype}")
    check_choice("method", method, PINV_METHODS)
    check_choice("init", init, PINV_INITS)
    iters = check_positive_int("iters", iters, minimum=0)
    if method == "svd" and init != "per_matrix":
        raise ValueError("init applies to method='iterative' only (the SVD needs no "
                         f"initial guess); got init={init!r}")
    if rtol is not None:
        if method != "svd":
            raise ValueError("rtol applies to method='svd' only (the iterative method has "
                             "no cutoff: choose iters)")
        if (isinstance(rtol, bool) or not isinstance(rtol, numbers.Real)
                or not rtol >= 0):
            raise ValueError(f"rtol must be a real number >= 0; got {rtol!r}")
    work = compute_dtype(xp, a.dtype)
    wa = xp.astype(a, work, copy=False)
    if method == "svd":
        z = _svd_pinv(xp, wa, rtol)
    else:
        z = _iterative_pinv(xp, wa, iters, init)
    out = xp.astype(z, a.dtype, copy=False)
    if return_residual:
        return out, xp.astype(_residual(xp, wa, z), a.dtype, copy=False)
    return out
