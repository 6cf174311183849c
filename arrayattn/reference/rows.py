r"""Unit rows and their backward: the one l2 normalisation of the reference forms
(Reformer's shared-QK keys, DeltaNet's ``normalize_qk``).

.. math::

    y = x / \lVert x\rVert, \qquad
    dx = \bigl(dy - y\,(y\cdot dy)\bigr) / \lVert x\rVert

row by row (last axis).  A zero row stays zero: its norm is read as 1, so there
``dx = dy`` (torch autograd's value through the same ``where``).
"""
from __future__ import annotations

from array_api_compat import array_namespace

__all__ = ["unit_rows", "unit_rows_vjp"]


def unit_rows(x):
    """``(x / ||x||, ||x||)`` row by row (a zero row stays zero; its norm is read as 1)."""
    xp = array_namespace(x)
    norm = xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True))
    norm = xp.where(norm > 0, norm, 1.0)
    return x / norm, norm


def unit_rows_vjp(x, dy):
    """The cotangent of ``x`` from that of ``y = unit_rows(x)[0]``."""
    xp = array_namespace(x, dy)
    y, norm = unit_rows(x)
    return (dy - y * xp.sum(y * dy, axis=-1, keepdims=True)) / norm
