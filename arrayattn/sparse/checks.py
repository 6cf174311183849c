"""Validation of the sparse, pooling and hashing families' options: block layouts,
Poolingformer's level-2 arrays, LSH's bucket counts and rotations.

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
"""
from __future__ import annotations

import math

import numpy as np

from ..core.checks import (Problem, check_array, check_positive_int, check_qkv,
                           check_same_array_kind)
from .layout import BlockLayout

__all__ = ["check_layout", "check_level2", "default_num_buckets", "check_num_buckets",
           "check_rotations", "check_shared_k"]


def check_layout(p: Problem, layout, q, k) -> BlockLayout:
    """``layout`` is a :class:`~arrayattn.BlockLayout` built for ``q``'s ``n`` and
    ``k``'s ``s``."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout (see arrayattn.local_layout etc.); "
                        f"got {type(layout).__name__}")
    if (layout.n, layout.s) != (p.n, p.s):
        raise ValueError(
            f"layout was built for n={layout.n} queries and s={layout.s} keys but q has "
            f"n={p.n} (shape {tuple(q.shape)}) and k has s={p.s} (shape {tuple(k.shape)})"
        )
    return layout


def check_level2(p: Problem, q, k, v, q2, k2, v2) -> Problem:
    """Poolingformer's level-2 ``q2, k2, v2`` (``None``: ``q``, ``k``, ``v``): the same
    library as ``q``, ``q``'s ``n``, ``k``'s ``s``, ``v``'s ``dv``, dtype and batch.
    Returns their :class:`~arrayattn.core.checks.Problem`."""
    if q2 is None and k2 is None and v2 is None:
        return p                      # level 2 reads q, k, v themselves: checked already
    q2 = q if q2 is None else check_array("q2", q2)
    k2 = k if k2 is None else check_array("k2", k2)
    v2 = v if v2 is None else check_array("v2", v2)
    p2 = check_qkv(q2, k2, v2, names=("q2", "k2", "v2"))
    check_same_array_kind(p.xp, "q", q, "q2", q2)
    if (p2.n, p2.s, p2.dv) != (p.n, p.s, p.dv) or p2.dtype != p.dtype:
        raise ValueError(
            f"q2, k2, v2 must have q's n={p.n}, k's s={p.s}, v's dv={p.dv} and dtype "
            f"{p.dtype}; got shapes q2 {tuple(q2.shape)}, k2 {tuple(k2.shape)}, "
            f"v2 {tuple(v2.shape)} of dtype {p2.dtype}"
        )
    if p2.batch != p.batch:
        raise ValueError(f"q2/k2/v2 batch {p2.batch} differs from q/k/v batch {p.batch}")
    return p2


def default_num_buckets(n: int, chunk_size: int) -> int:
    """``2 ceil(n / chunk_size)``: average bucket of about half a chunk (paper: m = 2l/n_b)."""
    return 2 * max(1, math.ceil(n / chunk_size))


def check_num_buckets(num_buckets) -> int:
    """LSH's bucket count: 1 or a positive even integer."""
    nb = check_positive_int("num_buckets", num_buckets)
    if nb != 1 and nb % 2:
        raise ValueError(
            "num_buckets must be 1 or even (angular LSH takes the argmax over "
            f"[xR, -xR] with R of num_buckets/2 columns); got {nb}"
        )
    return nb


def check_rotations(p: Problem, qk, rotations, num_hashes: int, num_buckets):
    """A caller's LSH rotations ``(..., H, d, nb/2)``: in the working dtype, with the
    bucket count ``nb`` they imply (checked against ``num_buckets`` when given)."""
    xp = p.xp
    check_same_array_kind(xp, "qk", qk, "rotations", rotations)
    if not xp.isdtype(rotations.dtype, "real floating"):
        raise TypeError(f"rotations must have a real floating dtype; got {rotations.dtype}")
    shape = tuple(rotations.shape)
    if len(shape) < 3 or shape[-2] != p.d:
        raise ValueError(
            f"rotations must have shape (..., num_hashes, d, num_buckets // 2) with d={p.d}; "
            f"got shape {shape} for qk of shape {tuple(qk.shape)}"
        )
    if shape[-3] != num_hashes:
        raise ValueError(
            f"rotations of shape {shape} hold {shape[-3]} hash rounds but "
            f"num_hashes={num_hashes}; pass num_hashes={shape[-3]}"
        )
    nb = max(1, 2 * shape[-1])
    if num_buckets is not None and check_num_buckets(num_buckets) != nb:
        raise ValueError(
            f"rotations of shape {shape} give {nb} buckets but num_buckets={num_buckets}"
        )
    try:
        batch = tuple(np.broadcast_shapes(shape[:-3], p.batch))
    except ValueError:
        batch = None
    if batch != p.batch:
        raise ValueError(
            f"rotations' leading dimensions {shape[:-3]} do not broadcast to the "
            f"batch {p.batch} of qk {tuple(qk.shape)}"
        )
    return xp.astype(rotations, p.work_dtype, copy=False), nb


def check_shared_k(q, k) -> None:
    """The ``k`` of a shared-QK variant's uniform call (``q`` is ``qk``; ``k`` is ignored)
    must have ``q``'s tokens and width: a ``k`` of another shape is a call meant for
    another variant.  It must also be ``q``'s kind (library, device, dtype): a ``k`` that
    the call would silently ignore is refused, as one of another shape is."""
    check_array("k", k)
    check_same_array_kind(None, "q", q, "k", k)     # one library, one device
    if k.dtype != q.dtype:
        raise TypeError(f"lsh is shared-QK attention: the uniform call uses q as qk and "
                        f"ignores k, so k must be q's kind; k has dtype {k.dtype} but q "
                        f"has dtype {q.dtype}")
    if k.ndim < 2 or tuple(k.shape[-2:]) != tuple(q.shape[-2:]):   # (heads may group)
        raise ValueError(f"lsh is shared-QK attention: the uniform call uses q as qk and "
                         f"ignores k, so k must have q's tokens and width (..., "
                         f"{q.shape[-2]}, {q.shape[-1]}); got {tuple(k.shape)} (call "
                         f"arrayattn.lsh_attention(qk, v) directly)")
