"""Testing helpers for arrayattn and for people validating their own kernels.

``xp_assert_close`` follows SciPy's ``scipy._lib._array_api.xp_assert_close``: it checks
the namespace, dtype, shape and device of ``actual`` against ``desired``, not only the
values.
"""
from __future__ import annotations

import math

import numpy as np

from ._xp import to_numpy, xp_device, xp_namespace

__all__ = ["xp_assert_close", "xp_assert_equal", "xp_assert_kind", "default_tolerance",
           "compare_to_reference", "assert_matches_reference", "Comparison"]


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


# ---------------------------------------------------------------------------------------
# Validating another implementation against the registry's reference
# ---------------------------------------------------------------------------------------

#: Machine epsilon of the floating dtypes an external output may have.
_EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
        "float64": 2.0 ** -52}

#: Safety factor between arrayattn's own rounding error and the tolerance (see
#: :func:`compare_to_reference`).
TOLERANCE_FACTOR = 8.0


def _dtype_name(x) -> str:
    return str(x.dtype).split(".")[-1]


def _is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (str, bytes))


def _host64(x) -> np.ndarray:
    """A host copy of ``x``: floating arrays as float64, others (masks, indices) as they are."""
    h = np.asarray(to_numpy(x))
    return h.astype(np.float64) if h.dtype.kind == "f" else h


def _heads(a: np.ndarray) -> np.ndarray:
    """``(..., n, dv)`` -> ``(heads, n, dv)``; a 2-D array is one head."""
    return a.reshape((-1, *a.shape[-2:]))


class Comparison:
    """Per-head result of :func:`compare_to_reference` (host NumPy arrays).

    Attributes
    ----------
    variant : str
        Registry name of the reference.
    dtype : str
        dtype of the output under test (sets the tolerance).
    heads : list of tuple
        Index of each head in the leading dimensions, e.g. ``(0, 3)``.
    max_abs, rel, tolerance : ndarray, shape ``(heads,)``
        Largest absolute error, the same relative to the head's largest reference entry,
        and the allowed absolute error.
    worst : list of tuple
        ``(query, column)`` of the largest error in each head.
    own_error : ndarray, shape ``(heads,)``
        Largest error of arrayattn's own evaluation in the output's precision.
    """

    def __init__(self, variant, dtype, heads, max_abs, rel, tolerance, worst, own_error,
                 notes=()):
        self.variant, self.dtype, self.heads = variant, dtype, heads
        self.max_abs, self.rel, self.tolerance = max_abs, rel, tolerance
        self.worst, self.own_error, self.notes = worst, own_error, list(notes)

    @property
    def failing(self) -> list[int]:
        """Indices of the heads over tolerance, worst (largest error/tolerance) first."""
        ratio = np.where(self.tolerance > 0, self.max_abs / np.where(self.tolerance > 0,
                         self.tolerance, 1.0), np.where(self.max_abs > 0, np.inf, 0.0))
        bad = [int(i) for i in np.flatnonzero(~(self.max_abs <= self.tolerance))]
        return sorted(bad, key=lambda i: -ratio[i])

    @property
    def ok(self) -> bool:
        return not self.failing

    def _head_line(self, i: int) -> str:
        qi, ci = self.worst[i]
        return (f"head {self.heads[i]}: max abs error {self.max_abs[i]:.3g} at query {qi}, "
                f"column {ci} (relative {self.rel[i]:.3g}, tolerance {self.tolerance[i]:.3g})")

    def verdict(self) -> str:
        """One line: MATCH or MISMATCH, with the worst head."""
        h = len(self.heads)
        if self.ok:
            i = int(np.argmax(self.max_abs / np.maximum(self.tolerance, 1e-300)))
            return (f"MATCH: {self.variant}, {h} head(s), {self.dtype} output; worst "
                    f"head {self.heads[i]} max abs error {self.max_abs[i]:.3g} <= tolerance "
                    f"{self.tolerance[i]:.3g}")
        bad = self.failing
        i = bad[0]
        return (f"MISMATCH: {self.variant}, {len(bad)} of {h} head(s) over tolerance "
                f"({self.dtype} output); worst {self._head_line(i)}")

    def table(self) -> str:
        """Per-head table: max abs error, relative error, arrayattn's own rounding error
        in the working precision (``own error``), tolerance, worst position, verdict."""
        head = ["head", "max abs error", "rel. error", "own error", "tolerance",
                "worst (query, col)", ""]
        rows = [[str(self.heads[i]), f"{self.max_abs[i]:.3e}", f"{self.rel[i]:.3e}",
                 f"{self.own_error[i]:.3e}", f"{self.tolerance[i]:.3e}",
                 str(tuple(self.worst[i])),
                 "ok" if self.max_abs[i] <= self.tolerance[i] else "FAIL"]
                for i in range(len(self.heads))]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Comparison {self.verdict()}>"


def compare_to_reference(out, variant, q, k, v, /, *, rtol=None, **params) -> Comparison:
    r"""Compare another implementation's ``out`` with arrayattn's float64 reference.

    The reference is ``variant(q, k, v, **params)`` evaluated by the registry record in
    float64 on the host, from the caller's own inputs (and the caller's own random
    matrices, passed as array ``params``; floating arrays are converted to float64,
    boolean masks are kept).

    Parameters
    ----------
    out : array, shape ``(..., n, dv)``
        The output under test, any supported array library.  Its dtype sets the
        tolerance.
    variant : str or Variant
        Registry name (see :func:`arrayattn.variants`).
    q, k, v : array
        The inputs ``out`` was computed from.
    rtol : float, optional
        Override: allowed max-abs error of a head relative to the head's largest
        reference entry.  ``None`` derives the tolerance as below.
    **params
        Options of the variant (``causal=True``, ``num_features=64``, ``omega=...``).

    Returns
    -------
    Comparison
        Per-head errors, tolerances and worst positions; ``.ok``, ``.verdict()``,
        ``.table()``.

    Notes
    -----
    **Tolerance.**  A head is the trailing ``(n, dv)`` block of ``out``; all leading
    dimensions index heads.  For head ``h`` with reference ``R_h`` the allowed
    max-abs error is

    .. math::

       \tau_h = F \cdot \max\bigl(e_h,\; \epsilon_{out} \|R_h\|_\infty\bigr),
       \qquad F = 8,

    where

    * :math:`e_h` is the max-abs error of *arrayattn's own* evaluation of the same
      variant in the working precision (float64 for a float64 output, float32
      otherwise: float16 and bfloat16 are computed in float32, as every arrayattn
      variant and every fused kernel does), on the inputs with a random relative
      perturbation of one unit roundoff of that precision.  It measures the rounding
      error that this variant incurs on *these* inputs: large logits, long sequences
      or an ill-conditioned pseudo-inverse all show up in it.  This is the criterion
      of FlashAttention's own test suite (error at most a small multiple of a plain
      implementation's error in the same precision);
    * the floor :math:`\epsilon_{out}\|R_h\|_\infty` (machine epsilon of the output dtype
      times the head's largest entry) is the rounding of the result itself: it is what
      counts for float16 and bfloat16 outputs, whose arithmetic is float32;
    * :math:`F = 8` allows a correct implementation to sum in another order (blocked
      or online softmax, fused kernels, another BLAS), whose rounding error is of
      the same order but not the same value (measured: torch's
      ``scaled_dot_product_attention``, blockwise softmax and a plain float32 port stay
      within 1.4 e_h at n = 256 ... 2048, d = 64, diffuse and sharp attention).

    For random-feature and random-pattern variants pass the matrix the other
    implementation used (e.g. ``omega=``, ``e=``, ``f=``): the reference then uses the
    same matrix, the comparison is deterministic and the same rounding-level tolerance
    applies.  Without it the reference draws its own from ``seed`` and only matches an
    implementation that drew the identical matrix.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import softmax_attention
    >>> from arrayattn.testing import compare_to_reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 3, 16, 8), dtype=np.float32) for _ in range(3))
    >>> out = softmax_attention(q, k, v, causal=True, block_size=4)  # "their" kernel
    >>> c = compare_to_reference(out, "softmax", q, k, v, causal=True)
    >>> c.ok, len(c.heads), c.heads[4]
    (True, 6, (1, 1))
    >>> bad = out.copy(); bad[1, 2] += 1e-3
    >>> compare_to_reference(bad, "softmax", q, k, v, causal=True).verdict()[:60]
    'MISMATCH: softmax, 1 of 6 head(s) over tolerance (float32 ou'
    """
    from .registry import get_variant

    rec = get_variant(variant)
    dtype = _dtype_name(out)
    if dtype not in _EPS:
        raise TypeError(f"out must have a floating dtype ({', '.join(_EPS)}); got {dtype}")
    out64 = _host64(out)
    q64, k64, v64 = (_host64(x) for x in (q, k, v))
    p64 = {key: _host64(val) if _is_array(val) else val for key, val in params.items()}
    ref = np.asarray(to_numpy(rec(q64, k64, v64, **p64)), dtype=np.float64)
    if out64.shape != ref.shape:
        raise ValueError(
            f"out has shape {out64.shape} but {rec.name} gives {ref.shape} for q "
            f"{q64.shape}, k {k64.shape}, v {v64.shape}")
    if out64.ndim < 2:
        raise ValueError(f"out must have at least 2 dimensions (..., n, dv); got {out64.shape}")
    lead = out64.shape[:-2]
    heads = [tuple(int(i) for i in idx) for idx in np.ndindex(*lead)] or [()]
    o, r = _heads(out64), _heads(ref)
    err = np.abs(o - r)
    err = np.where(np.isnan(err), np.inf, err)
    flat = err.reshape(len(heads), -1)
    max_abs = flat.max(axis=1, initial=0.0)
    arg = flat.argmax(axis=1) if flat.shape[1] else np.zeros(len(heads), int)
    worst = [tuple(int(t) for t in np.unravel_index(int(a), err.shape[1:])) for a in arg]
    scale = np.abs(r).reshape(len(heads), -1).max(axis=1, initial=0.0)
    rel = max_abs / np.where(scale > 0, scale, 1.0)

    # arrayattn's own evaluation in the output's precision, inputs perturbed by one
    # unit roundoff (fixed seed: the tolerance is reproducible).
    work = "float64" if dtype == "float64" else "float32"
    u = _EPS[work] / 2
    prng = np.random.default_rng(0)

    def nudge(x):
        return (x * (1.0 + u * prng.choice([-1.0, 1.0], size=x.shape))).astype(work)

    pw = {key: val.astype(work) if _is_array(val) and val.dtype.kind == "f" else val
          for key, val in p64.items()}
    own = np.asarray(to_numpy(rec(nudge(q64), nudge(k64), nudge(v64), **pw)), np.float64)
    own_err = np.abs(_heads(own) - r).reshape(len(heads), -1).max(axis=1, initial=0.0)
    notes = []
    if not np.all(np.isfinite(own_err)):
        notes.append(f"arrayattn's own {work} evaluation is not finite on these inputs; "
                     "the tolerance uses the rounding floor only")
        own_err = np.where(np.isfinite(own_err), own_err, 0.0)
    floor = scale * _EPS[dtype]
    if rtol is None:
        tol = TOLERANCE_FACTOR * np.maximum(own_err, floor)
    else:
        tol = float(rtol) * scale
    return Comparison(rec.name, dtype, heads, max_abs, rel, tol, worst, own_err, notes)


def assert_matches_reference(out, variant, q, k, v, /, *, rtol=None, **params) -> None:
    """Assert that ``out`` equals arrayattn's float64 reference to rounding, per head.

    Runs :func:`compare_to_reference` (see there for the tolerance derivation) and
    raises ``AssertionError`` naming the worst heads, their largest errors and the
    positions ``(query, column)`` where they occur.

    Parameters
    ----------
    out : array, shape ``(..., n, dv)``
        The output under test.
    variant : str or Variant
        Registry name of the reference.
    q, k, v : array
        The inputs ``out`` was computed from.
    rtol : float, optional
        Override of the derived tolerance (max-abs error relative to the head's largest
        reference entry).
    **params
        Options of the variant, including the random matrices the other implementation
        used (``omega=``, ``e=``, ``f=`` ...).

    Raises
    ------
    AssertionError
        When a head's max-abs error exceeds its tolerance.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import assert_matches_reference
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal((4, 32, 16)) for _ in range(3))
    >>> w = np.exp(q @ k.swapaxes(-1, -2) / 4.0)
    >>> mine = (w / w.sum(-1, keepdims=True)) @ v         # a plain float64 port
    >>> assert_matches_reference(mine, "softmax", q, k, v)  # passes silently
    >>> mine[2, 7, 3] += 1e-6
    >>> assert_matches_reference(mine, "softmax", q, k, v)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: MISMATCH: softmax, 1 of 4 head(s) over tolerance (float64 output); worst head (2,): max abs error 1e-06 at query 7, column 3 ...
    """
    c = compare_to_reference(out, variant, q, k, v, rtol=rtol, **params)
    if not c.ok:
        lines = [c.verdict()]
        lines += ["  " + c._head_line(i) for i in c.failing[:5]]
        if len(c.failing) > 5:
            lines.append(f"  ... and {len(c.failing) - 5} more head(s)")
        lines += c.notes
        raise AssertionError("\n".join(lines))
