"""Validation of exact attention: the checked call record (:func:`checked_call`) and the
kernel options (windows, softcap, ALiBi, dropout keep-masks, packed sequences,
FlexAttention hooks).

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import array_api_compat
import numpy as np

from ..core.checks import (Problem, broadcast_batch, check_array, check_bias, check_bool_mask,
                           check_flag, check_key_mask, check_mask, check_positive_int,
                           check_qkv, check_same_array_kind, check_scale, shape_of)
from ..core.xp import to_numpy
from ..core.devices import default_block_size
from ..reference.logits import Logits, segment_ids

__all__ = ["check_window", "check_softcap", "check_alibi_slopes", "check_query_mask",
           "check_dropout", "check_cu_seqlens", "check_varlen", "check_callable", "Call",
           "checked_call"]


def check_window(window, causal: bool):
    """``(left, right)`` with ``None`` for an unbounded side (``-1`` and ``None`` given
    mean unbounded); ``causal`` caps ``right`` at 0, as FlashAttention."""
    if window is None:
        left = right = None
    else:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right); got {window!r}")
        sides = []
        for side, w in zip(("left", "right"), window):
            if w is None or (isinstance(w, numbers.Integral) and not isinstance(w, bool)
                             and w == -1):
                sides.append(None)
            elif isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0:
                sides.append(int(w))
            else:
                raise ValueError(f"window's {side} size must be an integer >= 0, or -1 / "
                                 f"None for unbounded; got {w!r}")
        left, right = sides
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def check_softcap(softcap):
    """``None`` or ``0`` (off, as FlashAttention's ``softcap=0.0``), else a positive
    finite number."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number; got {softcap!r}")
    if softcap == 0:
        return None
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number (0 = off); got {softcap}")
    return float(softcap)


def check_alibi_slopes(p: Problem, slopes, q):
    """``(h,)`` or ``(b, h)`` real floating (``h`` = the heads of ``q``, axis -3), cast to
    the working dtype."""
    if slopes is None:
        return None
    check_array("alibi_slopes", slopes)
    check_same_array_kind(p.xp, "q", q, "alibi_slopes", slopes)
    if not p.xp.isdtype(slopes.dtype, "real floating"):
        raise TypeError(f"alibi_slopes must have a real floating dtype; got {slopes.dtype}")
    heads = q.shape[-3] if q.ndim >= 3 else None
    if slopes.ndim < 1 or heads is None or slopes.shape[-1] != heads:
        raise ValueError(f"alibi_slopes must have shape (h,) or (b, h) with h = {heads} "
                         f"(the heads of q, shape {shape_of(q)}); got shape {shape_of(slopes)}")
    return p.xp.astype(slopes, p.work_dtype, copy=False)


def check_query_mask(p: Problem, query_mask, q):
    """``query_mask (..., n)`` boolean, broadcastable to the batch."""
    if query_mask is None:
        return None
    check_bool_mask(p, "query_mask", query_mask, "q", q)
    if query_mask.ndim < 1 or query_mask.shape[-1] != p.n:
        raise ValueError(f"query_mask must have shape (..., n) with n={p.n} queries; got "
                         f"shape {shape_of(query_mask)}")
    broadcast_batch([("q/k/v", p.batch), ("query_mask", shape_of(query_mask)[:-1])])
    return query_mask


def check_dropout(p: Problem, dropout_mask, dropout_p, q):
    """``(keep (..., n, s) bool, p)`` or ``None``: a keep-mask is required for
    ``dropout_p > 0`` (arrayattn draws no dropout of its own), ``0 <= p < 1``."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number; got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    if dropout_mask is None:
        if dropout_p > 0:
            raise ValueError("dropout_p > 0 needs dropout_mask= (the keep-mask, True = "
                             "kept): arrayattn draws no random dropout")
        return None
    check_bool_mask(p, "dropout_mask", dropout_mask, "q", q)
    if dropout_mask.ndim < 2 or tuple(dropout_mask.shape[-2:]) != (p.n, p.s):
        raise ValueError(f"dropout_mask must have shape (..., n, s) = (..., {p.n}, {p.s}); "
                         f"got shape {shape_of(dropout_mask)}")
    broadcast_batch([("q/k/v", p.batch), ("dropout_mask", shape_of(dropout_mask)[:-2])])
    return dropout_mask, float(dropout_p)


def check_cu_seqlens(p: Problem, name: str, cu, total: int, q):
    """``cu (B + 1,)`` integer offsets: 0 first, non-decreasing, ``total`` last (checked on
    the host where the values are concrete; a traced array is taken as given)."""
    check_array(name, cu)
    check_same_array_kind(p.xp, "q", q, name, cu)
    if not p.xp.isdtype(cu.dtype, "integral"):
        raise TypeError(f"{name} must have an integer dtype; got {cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must have shape (B + 1,) with B >= 1 sequences; got "
                         f"shape {shape_of(cu)}")
    if array_api_compat.is_jax_array(cu) and not _concrete(cu):
        return cu
    host = to_numpy(cu)
    if host[0] != 0 or host[-1] != total or np.any(np.diff(host) < 0):
        raise ValueError(f"{name} must start at 0, never decrease and end at the packed "
                         f"length {total}; got {host.tolist()}")
    return cu


def check_varlen(p: Problem, cu_seqlens_q, cu_seqlens_k, q):
    """Packed variable-length sequences: ``(segments, shift)`` -- the segment of every
    query and key, and each query's end alignment ``s_b - n_b`` -- or ``(None, None)``."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together (packed queries and "
                         "packed keys)")
    if cu_seqlens_q is None:
        return None, None
    cq = check_cu_seqlens(p, "cu_seqlens_q", cu_seqlens_q, p.n, q)
    ck = check_cu_seqlens(p, "cu_seqlens_k", cu_seqlens_k, p.s, q)
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cq.shape)} and cu_seqlens_k "
                         f"{tuple(ck.shape)} must describe the same number of sequences")
    seg_q, seg_k = segment_ids(cq, p.n), segment_ids(ck, p.s)
    shift = p.xp.astype(p.xp.take(ck[1:] - cq[1:], seg_q), p.xp.int64)
    return (seg_q, seg_k), shift


def _concrete(x) -> bool:
    try:
        import jax
        return not isinstance(x, jax.core.Tracer)
    except ImportError:  # pragma: no cover
        return True


def check_callable(name: str, fn):
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a callable; got {type(fn).__name__}")
    return fn


@dataclass(frozen=True)
class Call:
    """A validated :func:`softmax_attention` call: the problem, the logits pipeline, the
    dropout keep-mask, the block size (``None``: dense) and whether ``lse`` is returned."""

    p: Problem
    logits: Logits
    dropout: tuple | None
    block_size: int | None
    return_lse: bool

    @property
    def key_mask(self):
        return self.logits.key_mask


def checked_call(q, k, v, *, scale=None, causal=False, key_mask=None, mask=None, bias=None,
                 block_size=None, window=None, softcap=None, alibi_slopes=None,
                 query_mask=None, return_lse=False, dropout_mask=None, dropout_p=0.0,
                 cu_seqlens_q=None, cu_seqlens_k=None, score_mod=None, mask_mod=None,
                 shift=None) -> Call:
    """Validate a :func:`softmax_attention` call once (``shift``: a per-row alignment
    array ``(..., n)`` of a caller such as :func:`~arrayattn.paged_attention`)."""
    p = check_qkv(q, k, v)
    left, right = check_window(window, check_flag("causal", causal))
    check_key_mask(p, key_mask, q)
    check_mask(p, mask, q)
    bias = check_bias(p, bias, q)
    if isinstance(block_size, str) and block_size == "auto":
        block_size = default_block_size(q)
    block_size = check_positive_int("block_size", block_size, allow_none=True)
    if block_size is not None and block_size >= p.n and block_size >= p.s:
        block_size = None
    segments, seg_shift = check_varlen(p, cu_seqlens_q, cu_seqlens_k, q)
    heads = ()
    if q.ndim >= 3:
        grouped = q.ndim >= 5 and k.shape[-3] == 1 and q.shape[-3] > 1
        heads = (q.shape[-4], q.shape[-3]) if grouped else (q.shape[-3],)
    if seg_shift is not None:
        shift = seg_shift
    lg = Logits(scale=check_scale(scale, p.d), shift=p.s - p.n if shift is None else shift,
                left=left, right=right, softcap=check_softcap(softcap),
                score_mod=check_callable("score_mod", score_mod), bias=bias,
                alibi_slopes=check_alibi_slopes(p, alibi_slopes, q), key_mask=key_mask,
                query_mask=check_query_mask(p, query_mask, q), mask=mask,
                mask_mod=check_callable("mask_mod", mask_mod), segments=segments,
                heads=heads)
    return Call(p, lg, check_dropout(p, dropout_mask, dropout_p, q), block_size,
                check_flag("return_lse", return_lse))
