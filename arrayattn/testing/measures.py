"""Per-head errors, the rounding baseline and the derived tolerance that the output,
gradient and log-sum-exp referees share."""
from __future__ import annotations

import numpy as np

from ..core.xp import to_numpy

__all__ = ["EPS", "TOLERANCE_FACTOR", "dtype_name", "is_array", "host64", "working_dtype",
           "cast_floating", "Nudge", "value_signs", "HeadErrors", "head_errors", "own_head_error",
           "derived_tolerance", "round_to", "error_of"]

#: Machine epsilon of the floating dtypes an external output may have.
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
       "float64": 2.0 ** -52}

#: The smallest subnormal of each dtype: below the normal range a result is quantised in
#: these absolute steps, whatever its size.
TINY = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149,
        "float64": 2.0 ** -1074}
#: Subnormal steps a plain evaluation may lose near underflow: the result's own rounding
#: and that of the few products and sums rounded before it (gates' exp(g) of very
#: negative g, tiny inputs in float16).
TINY_STEPS = 4

#: Safety factor between arrayattn's own rounding error and the tolerance (see
#: :func:`arrayattn.testing.compare_to_reference`).
TOLERANCE_FACTOR = 8.0


def dtype_name(x) -> str:
    """``"float32"`` for a float32 array of any library."""
    return str(x.dtype).split(".")[-1]


def is_array(x) -> bool:
    """Whether ``x`` is an array (of any library), not a scalar option or a string."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (str, bytes))


def host64(x) -> np.ndarray:
    """A host copy of ``x``: floating arrays as float64, others (masks, indices) as they are."""
    h = np.asarray(to_numpy(x))
    return h.astype(np.float64) if h.dtype.kind == "f" else h


def working_dtype(dtype: str) -> str:
    """The precision arrayattn computes a ``dtype`` result in: float64, else float32 (float16
    and bfloat16 are computed in float32, as every variant and every fused kernel does)."""
    return "float64" if dtype == "float64" else "float32"


def cast_floating(options: dict, dtype: str, convert=None) -> dict:
    """``options`` with every floating array cast to ``dtype`` (masks and indices kept), each
    passed through ``convert`` first when given (a perturbation; one with a ``named``
    method perturbs each array as its name says)."""
    def cast(key, val):
        if not (is_array(val) and val.dtype.kind == "f"):
            return val
        conv = convert.named(key) if hasattr(convert, "named") else convert
        return (val if conv is None else conv(val)).astype(dtype)
    return {key: cast(key, val) for key, val in options.items()}


def value_signs(x: np.ndarray, seed: int = 0) -> np.ndarray:
    """A pseudo-random sign for each entry of ``x``, a function of its value (its float64
    bits, mixed with ``seed``) and not of its position: like a rounding, equal values move
    alike, so the same numbers in another layout (grouped key heads repeated, a batch
    reshaped) get the same perturbation -- one verdict whatever the layout."""
    bits = np.ascontiguousarray(np.asarray(x, dtype=np.float64)).view(np.uint64)
    with np.errstate(over="ignore"):
        h = (bits ^ np.uint64((0x9E3779B97F4A7C15 * (seed + 1)) % 2**64)) * \
            np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
    return np.where((h >> np.uint64(40)) & np.uint64(1), 1.0, -1.0)


class Nudge:
    """A pseudo-random relative perturbation of one unit roundoff of ``work``: ``x (1 +-
    u)``, the sign a function of the value and a fixed seed (:func:`value_signs`), so that
    the tolerance is reproducible and the same in every layout."""

    def __init__(self, work: str, seed: int = 0):
        self.u, self.seed = EPS[work] / 2, seed

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x * (1.0 + self.u * value_signs(x, self.seed))


class HeadErrors:
    """The per-head error of an array ``(..., *event)`` against its reference: ``heads``
    (index tuples of the leading dimensions), ``max_abs``, ``worst`` (the position of the
    largest error, as ``(row, column)``) and ``scale`` (the largest finite reference entry)."""

    def __init__(self, heads, max_abs, worst, scale):
        self.heads, self.max_abs, self.worst, self.scale = heads, max_abs, worst, scale


def _blocks(a: np.ndarray, count: int) -> np.ndarray:
    return np.asarray(a).reshape(count, -1)


def error_of(theirs: np.ndarray, ref: np.ndarray, dtype: str) -> np.ndarray:
    """``|theirs - ref|``, 0 where the reference overflows ``dtype`` and ``theirs`` is the
    infinity of the same sign it rounds to (a float16 gradient past 65504 can only be
    inf)."""
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(theirs - ref)
        if dtype in EPS and dtype != "float64":
            rounded = round_to(ref, dtype)
            same_inf = np.isinf(rounded) & np.isfinite(ref) & (theirs == rounded)
            err = np.where(same_inf, 0.0, err)
    return err


def head_errors(err: np.ndarray, ref: np.ndarray, event: int = 2) -> HeadErrors:
    """Per head, from the elementwise error ``err`` (a NaN counts as infinite) of an array
    whose trailing ``event`` dimensions are one head; fewer dimensions: one head."""
    err = np.where(np.isnan(err), np.inf, err)
    lead = ref.shape[:-event] if ref.ndim >= event else ()
    shape = (1,) * (event - ref.ndim) + ref.shape[len(lead):]
    heads = [tuple(int(i) for i in idx) for idx in np.ndindex(*lead)] or [()]
    flat = _blocks(err, len(heads))
    max_abs = flat.max(axis=1, initial=0.0)
    arg = flat.argmax(axis=1) if flat.shape[1] else np.zeros(len(heads), int)
    worst = [(tuple(int(t) for t in np.unravel_index(int(a), shape)) + (0, 0))[:2]
             for a in arg]
    finite = np.where(np.isfinite(ref), np.abs(ref), 0.0)
    return HeadErrors(heads, max_abs, worst, _blocks(finite, len(heads)).max(axis=1,
                                                                                initial=0.0))


def own_head_error(own: np.ndarray, ref: np.ndarray, count: int) -> tuple[np.ndarray, bool]:
    """Per head, arrayattn's own error ``max |own - ref|`` over the positions where the
    reference is finite, and whether every head's is finite (a head whose is not gets 0: its
    tolerance then rests on the rounding floor alone)."""
    seen = np.isfinite(ref)
    with np.errstate(invalid="ignore"):
        diff = np.where(seen, np.abs(own - np.where(seen, ref, 0.0)), 0.0)
    err = _blocks(diff, count).max(axis=1, initial=0.0)
    finite = np.isfinite(err)
    return np.where(finite, err, 0.0), bool(finite.all())


def derived_tolerance(errors: HeadErrors, own_error: np.ndarray, dtype: str, *, rtol, atol,
                      factor: float = TOLERANCE_FACTOR) -> np.ndarray:
    r"""Per head ``factor * max(e_h, eps_dtype |R_h|_inf, 4 tiny_dtype) + atol`` (``rtol``
    given: ``rtol |R_h|_inf + atol``), the rule of
    :func:`arrayattn.testing.compare_to_reference`; ``tiny`` the dtype's smallest subnormal
    (:data:`TINY`: results near underflow are quantised in absolute steps)."""
    if rtol is not None:
        return rtol * errors.scale + atol
    floor = np.maximum(errors.scale * EPS[dtype], TINY_STEPS * TINY[dtype])
    return factor * np.maximum(own_error, floor) + atol


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded (to nearest, ties to even) to ``dtype`` and back to float64; bfloat16
    by its bit pattern (the top 16 bits of a float32), so no extension is needed.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import round_to
    >>> float(round_to(np.array(1.0 + 2.0 ** -9), "bfloat16"))
    1.0
    """
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    if dtype == "bfloat16":
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = bits.astype(np.uint32).view(np.float32).astype(np.float64)
        return np.where(np.isfinite(x), out, x)
    return np.asarray(x, dtype=dtype).astype(np.float64)
