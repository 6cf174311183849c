"""Testing helpers for arrayattn and for people validating their own kernels.

``xp_assert_close`` follows SciPy's ``scipy._lib._array_api.xp_assert_close``: it checks
the namespace, dtype, shape and device of ``actual`` against ``desired``, not only the
values.
"""
from __future__ import annotations

import math

import numpy as np

from ._xp import to_numpy, xp_device, xp_namespace

__all__ = ["xp_assert_close", "xp_assert_equal", "xp_assert_kind", "default_tolerance"]


def default_tolerance(dtype, *, xp=None, factor: float = 1.0) -> float:
    """A relative tolerance for results computed in ``dtype``.

    ``sqrt(eps)``-free and explicit: ``factor * 64 * eps`` -- 64 ulps covers the
    rounding of a softmax-normalised sum of products of moderate length (the exp, the
    division and a length-``d`` dot product each contribute a few ulps).  Pass a larger
    ``factor`` only with a reason (large logits, long reductions).
    """
    if xp is None:
        eps = float(np.finfo(np.dtype(str(dtype).split(".")[-1])).eps)
    else:
        eps = float(xp.finfo(dtype).eps)
    return factor * 64.0 * eps


def _check_meta(actual, desired, *, check_namespace, check_dtype, check_shape,
                check_device):
    if check_namespace:
        xa = xp_namespace(actual)
        xd = xp_namespace(desired)
        assert xa == xd, f"namespace {xa.__name__} != expected {xd.__name__}"
    if check_dtype:
        assert actual.dtype == desired.dtype, f"dtype {actual.dtype} != expected {desired.dtype}"
    if check_shape:
        assert tuple(actual.shape) == tuple(desired.shape), (
            f"shape {tuple(actual.shape)} != expected {tuple(desired.shape)}")
    if check_device:
        da, dd = xp_device(actual), xp_device(desired)
        if da is not None and dd is not None:
            assert da == dd, f"device {da} != expected {dd}"


def xp_assert_close(actual, desired, *, rtol=None, atol=0.0, check_namespace=True,
                    check_dtype=True, check_shape=True, check_device=True, err_msg=""):
    """Assert ``actual`` is close to ``desired`` and of the same kind of array.

    ``rtol=None`` uses :func:`default_tolerance` of ``desired``'s dtype.  Values are
    compared on the host in float64 as ``|a - d| <= atol + rtol |d|``; the message gives
    the worst index and both values.
    """
    _check_meta(actual, desired, check_namespace=check_namespace, check_dtype=check_dtype,
                check_shape=check_shape, check_device=check_device)
    a = to_numpy(actual).astype(np.float64)
    d = to_numpy(desired).astype(np.float64)
    if rtol is None:
        rtol = default_tolerance(xp_namespace(desired).asarray(0, dtype=desired.dtype).dtype,
                                 xp=xp_namespace(desired))
    a, d = np.broadcast_arrays(a, d)
    err = np.abs(a - d)
    bound = atol + rtol * np.abs(d)
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        excess = np.where(np.isnan(err), np.inf, err - bound)
        idx = np.unravel_index(int(np.argmax(excess)), err.shape)
        raise AssertionError(
            f"{int(bad.sum())} of {err.size} values differ (rtol={rtol:.3g}, atol={atol:.3g}); "
            f"worst at {tuple(int(i) for i in idx)}: actual {a[idx]!r}, desired {d[idx]!r}, "
            f"max abs error {np.nanmax(err) if np.isfinite(err).any() else math.nan:.3g}"
            + (f"\n{err_msg}" if err_msg else "")
        )


def xp_assert_kind(actual, desired):
    """Assert ``actual`` has the namespace, dtype, shape and device of ``desired``."""
    _check_meta(actual, desired, check_namespace=True, check_dtype=True, check_shape=True,
                check_device=True)


def xp_assert_equal(actual, desired, **kwargs):
    """Bit-for-bit equality with the same metadata checks as :func:`xp_assert_close`."""
    xp_assert_close(actual, desired, rtol=0.0, atol=0.0, **kwargs)
