"""The NumPy engine of unit rows (``x / ||x||``, DeltaNet's ``normalize_qk``).

The reference (:func:`arrayattn.reference.unit_rows`) scales each row before its norm so
that no square over- or underflows: six passes and their temporaries, 18 ms per
``(1, 8, 4096, 64)`` float32 array.  Here the squared norms come from one ``einsum`` and a
host check: rows whose squared norm is finite and far from underflow (``>= tiny / eps``:
every underflowed square is below the rounding error) divide by it at once, 0.7 ms; only
the others (zero, huge, tiny or non-finite rows) take the reference's scaled norm
(issue #39).
"""
from __future__ import annotations

import numpy as np

from .. import reference

__all__ = ["unit_rows"]


def unit_rows(x: np.ndarray) -> np.ndarray:
    """``x / ||x||`` row by row, :func:`~arrayattn.reference.unit_rows`'s value."""
    info = np.finfo(x.dtype)
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        sq = np.einsum("...i,...i->...", x, x)
    ok = np.isfinite(sq) & (sq >= info.tiny / info.eps)
    if ok.all():
        return x / np.sqrt(sq)[..., None]
    norm = np.sqrt(np.where(ok, sq, 1.0))
    norm[~ok] = reference.unit_rows(x[~ok])[1][..., 0]
    return x / norm[..., None]
