"""Split a sequence into chunks of ``c`` tokens and back: the one padding rule of every
chunked form (kernel, gated, delta-rule and RFA attention, forward and backward).

The sequence is zero-padded at the end to whole chunks: a zero key or feature row adds
nothing to a state, and the padded queries' outputs are dropped by :func:`unchunk`.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

__all__ = ["in_chunks", "unchunk"]


def in_chunks(x, c: int):
    """``x (..., n, f)`` zero-padded to whole chunks, as ``(..., ceil(n / c), c, f)``."""
    xp = array_namespace(x)
    pad = -x.shape[-2] % c
    if pad:
        x = xp.concat([x, xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype,
                                   device=device(x))], axis=-2)
    return xp.reshape(x, (*x.shape[:-2], x.shape[-2] // c, c, x.shape[-1]))


def unchunk(x, n: int):
    """``(..., n/c, c, f)`` back to ``(..., n, f)``, the padding dropped."""
    xp = array_namespace(x)
    return xp.reshape(x, (*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1]))[..., :n, :]
