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

from .. import reference
from ..core.engine import entry
from .._numpy import linalg as engine
from ..core.checks import check_flag
from .checks import PINV_INITS, PINV_METHODS, check_svd_available, checked_pinv
from ..core.xp import xp_device
from ..core.pipeline import engine_pays

# check_svd_available, checked_pinv and the choices live in the validation module; they
# stay importable from here.
__all__ = ["pinv", "check_svd_available", "checked_pinv", "PINV_METHODS", "PINV_INITS"]


def _eye_like(xp, a):
    """``I_p`` for ``a (..., p, q)``, in ``a``'s dtype and on its device."""
    return xp.eye(a.shape[-2], dtype=a.dtype, device=xp_device(a))


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
    xp, wa, iters, rtol = checked_pinv(a, method=method, iters=iters, init=init, rtol=rtol)
    return_residual = check_flag("return_residual", return_residual)
    with entry(xp):     # one matrix, no q, k, v: the pipeline's rule, on its size
        if method == "iterative":
            fast = engine_pays(xp, 4 * math.prod(a.shape) * max(a.shape[-2:]))
            z = (engine if fast else reference).pinv_razavi(wa, iters, init)
        elif engine_pays(xp, 4 * math.prod(a.shape) * min(a.shape[-2:])):
            z = engine.pinv_svd(wa, rtol)
        else:
            z = reference.pinv_svd(wa, rtol)
    out = xp.astype(z, a.dtype, copy=False)
    if return_residual:
        return out, xp.astype(_residual(xp, wa, z), a.dtype, copy=False)
    return out
