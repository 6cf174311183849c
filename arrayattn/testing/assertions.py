"""Thin assertion wrappers as SciPy's ``_lib/_array_api.py`` has them: check the kind of
array (namespace, dtype, shape, device), then compare the values on the host."""
from __future__ import annotations

import math
import numbers

import numpy as np

from ..core.xp import to_numpy, xp_device, xp_namespace

__all__ = ["default_tolerance", "check_tolerance", "xp_assert_close", "xp_assert_equal",
           "xp_assert_kind"]


def default_tolerance(dtype, *, xp=None, factor: float = 1.0) -> float:
    """A relative tolerance for results computed in ``dtype``.

    ``sqrt(eps)``-free and explicit: ``factor * 64 * eps`` -- 64 ulps covers the
    rounding of a softmax-normalised sum of products of moderate length (the exp, the
    division and a length-``d`` dot product each contribute a few ulps).  Pass a larger
    ``factor`` only with a reason (large logits, long reductions).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import default_tolerance
    >>> bool(default_tolerance("float64") == 64 * np.finfo(np.float64).eps)
    True
    """
    if xp is None:
        eps = float(np.finfo(np.dtype(str(dtype).split(".")[-1])).eps)
    else:
        eps = float(xp.finfo(dtype).eps)
    return factor * 64.0 * eps


def check_tolerance(name: str, value, *, optional: bool = True):
    """``value`` of the tolerance argument ``name`` (``rtol``, ``atol``) as a float: a
    finite real number >= 0 (``None`` kept when ``optional``).  An infinite or NaN
    tolerance would pass any output, NaN included, so it is refused."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number >= 0; got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {value}")
    return value


def _check_meta(actual, desired, *, check_namespace, check_dtype, check_shape,
                check_device):
    """SciPy's ``_strict_check``: the kind of array, before any value is compared."""
    if check_namespace:
        xa, xd = xp_namespace(actual), xp_namespace(desired)
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


def _assert_values_close(a: np.ndarray, d: np.ndarray, rtol: float, atol: float,
                         err_msg: str) -> None:
    """``|a - d| <= atol + rtol |d|`` on host float64 arrays (NaN counts as bad); the
    message gives the worst index and both values."""
    a, d = np.broadcast_arrays(a, d)
    err = np.abs(a - d)
    bad = ~(err <= atol + rtol * np.abs(d))
    if not bad.any():
        return
    excess = np.where(np.isnan(err), np.inf, err - atol - rtol * np.abs(d))
    idx = np.unravel_index(int(np.argmax(excess)), err.shape)
    raise AssertionError(
        f"{int(bad.sum())} of {err.size} values differ (rtol={rtol:.3g}, atol={atol:.3g}); "
        f"worst at {tuple(int(i) for i in idx)}: actual {a[idx]!r}, desired {d[idx]!r}, "
        f"max abs error {np.nanmax(err) if np.isfinite(err).any() else math.nan:.3g}"
        + (f"\n{err_msg}" if err_msg else ""))


def xp_assert_close(actual, desired, *, rtol=None, atol=0.0, check_namespace=True,
                    check_dtype=True, check_shape=True, check_device=True, err_msg=""):
    """Assert ``actual`` is close to ``desired`` and of the same kind of array.

    ``rtol=None`` uses :func:`default_tolerance` of ``desired``'s dtype.  Values are
    compared on the host in float64 as ``|a - d| <= atol + rtol |d|``; the message gives
    the worst index and both values.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import xp_assert_close
    >>> xp_assert_close(np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-15]))
    """
    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    _check_meta(actual, desired, check_namespace=check_namespace, check_dtype=check_dtype,
                check_shape=check_shape, check_device=check_device)
    if rtol is None:
        xd = xp_namespace(desired)
        rtol = default_tolerance(xd.asarray(0, dtype=desired.dtype).dtype, xp=xd)
    _assert_values_close(to_numpy(actual).astype(np.float64),
                         to_numpy(desired).astype(np.float64), rtol, atol, err_msg)


def xp_assert_kind(actual, desired):
    """Assert ``actual`` has the namespace, dtype, shape and device of ``desired``.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import xp_assert_kind
    >>> xp_assert_kind(np.zeros((2, 3)), np.ones((2, 3)))
    """
    _check_meta(actual, desired, check_namespace=True, check_dtype=True, check_shape=True,
                check_device=True)


def xp_assert_equal(actual, desired, **kwargs):
    """Bit-for-bit equality with the same metadata checks as :func:`xp_assert_close`.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import xp_assert_equal
    >>> xp_assert_equal(np.arange(3.0), np.arange(3.0))
    """
    xp_assert_close(actual, desired, rtol=0.0, atol=0.0, **kwargs)
