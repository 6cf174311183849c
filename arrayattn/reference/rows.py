r"""Unit rows and their backward: the one l2 normalisation of the reference forms
(Reformer's shared-QK keys, DeltaNet's ``normalize_qk``).

.. math::

    y = x / \lVert x\rVert, \qquad
    dx = \bigl(dy - y\,(y\cdot dy)\bigr) / \lVert x\rVert

row by row (last axis).  A zero row stays zero: its norm is read as 1, so there
``dx = dy`` (torch autograd's value through the same ``where``); a non-finite row stays
non-finite for the caller's non-finite rule to drop.
"""
from __future__ import annotations

from array_api_compat import array_namespace

__all__ = ["unit_rows", "unit_rows_vjp"]


def unit_rows(x):
    """``(x / ||x||, ||x||)`` row by row.  A zero row stays zero and a non-finite row
    non-finite (their norm is read as 1: never ``0 / 0`` or ``inf / inf``); the norm of
    a finite row whose squared norm would overflow is taken after dividing by its
    largest entry."""
    xp = array_namespace(x)
    big = xp.max(xp.abs(x), axis=-1, keepdims=True)
    big = xp.where(xp.isfinite(big) & (big > 0), big, 1.0)
    norm = big * xp.sqrt(xp.sum((x / big) ** 2, axis=-1, keepdims=True))
    norm = xp.where(xp.isfinite(norm) & (norm > 0), norm, 1.0)
    return x / norm, norm


def unit_rows_vjp(x, dy):
    """The cotangent of ``x`` from that of ``y = unit_rows(x)[0]``."""
    xp = array_namespace(x, dy)
    y, norm = unit_rows(x)
    return (dy - y * xp.sum(y * dy, axis=-1, keepdims=True)) / norm
