"""Validation of the low-rank family: Nyströmformer and landmark attention (with their
segment means and pseudo-inverse), Linformer's projections, Luna.

``checked_<variant>`` returns the frozen call record that the pipeline
(:mod:`arrayattn.core.pipeline`) and the backward adapters share (Linformer's, which draws its
projection, sits beside :func:`~arrayattn.linformer_projection`).

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.checks import (Problem, check_array, check_choice, check_flag, check_key_mask,
                           check_no_causal, check_positive_int, check_qkv,
                           check_same_array_kind, check_scale, check_seed)
from ..core.xp import compute_dtype, xp_device, xp_from_host, xp_namespace

__all__ = ["PINV_METHODS", "PINV_INITS", "check_svd_available", "checked_pinv",
           "checked_segment_means", "check_landmark_query_mask", "check_conv_kernel",
           "LandmarkCall", "NystromCall", "checked_landmark", "checked_nystrom",
           "LINFORMER_NOT_CAUSAL", "check_linformer_projection",
           "LunaCall", "check_unpack_projection", "checked_luna", "luna_uniform_draw",
           "LUNA_UNIFORM_L", "checked_luna_uniform"]

PINV_METHODS = ("svd", "iterative")
PINV_INITS = ("per_matrix", "global")


# -- pinv and segment means (not attention functions) ---------------------------------

def check_svd_available(xp) -> None:
    """``method="svd"`` needs the array API ``linalg`` extension: a clear error without it."""
    linalg = getattr(xp, "linalg", None)
    if linalg is None or not hasattr(linalg, "pinv"):
        raise ValueError(
            f"pinv(method='svd') needs the array API 'linalg' extension, which the "
            f"namespace {getattr(xp, '__name__', xp)!r} does not provide; use "
            "method='iterative' (matmuls only)"
        )


def checked_pinv(a, /, *, method, iters, init, rtol):
    """The validation of :func:`~arrayattn.pinv` (shared with its backward): ``(xp, a in
    its working dtype, iters, rtol resolved for "svd")``."""
    a = check_array("a", a)
    xp = xp_namespace(a)
    if a.ndim < 2:
        raise ValueError(f"a must have at least 2 dimensions (..., p, q); got shape "
                         f"{tuple(a.shape)}")
    if not xp.isdtype(a.dtype, "real floating"):
        raise TypeError(f"a must have a real floating dtype; got {a.dtype}")
    check_choice("method", method, PINV_METHODS)
    check_choice("init", init, PINV_INITS)
    iters = check_positive_int("iters", iters, minimum=0)
    if method == "svd" and init != "per_matrix":
        raise ValueError("init applies to method='iterative' only (the SVD needs no "
                         f"initial guess); got init={init!r}")
    if rtol is not None:
        if method != "svd":
            raise ValueError("rtol applies to method='svd' only (the iterative method has "
                             "no cutoff: choose iters)")
        if (isinstance(rtol, bool) or not isinstance(rtol, numbers.Real)
                or not rtol >= 0):
            raise ValueError(f"rtol must be a real number >= 0; got {rtol!r}")
    work = compute_dtype(xp, a.dtype)
    if method == "svd":
        check_svd_available(xp)
        if rtol is None:
            rtol = max(a.shape[-2], a.shape[-1]) * float(xp.finfo(work).eps)
    return xp, xp.astype(a, work, copy=False), iters, rtol


def checked_segment_means(x, m, key_mask, return_counts):
    """The validation of :func:`~arrayattn.segment_means`: ``(xp, m, return_counts)``."""
    x = check_array("x", x)
    xp = xp_namespace(x, key_mask, names=("x", "key_mask"))
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., n, c); got shape "
                         f"{tuple(x.shape)}")
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"x must have a real floating dtype; got {x.dtype}")
    n = x.shape[-2]
    m = check_positive_int("m", m)
    if m > n:
        raise ValueError(f"m={m} segments cannot be formed from n={n} tokens "
                         f"(x of shape {tuple(x.shape)}); need m <= n")
    if key_mask is not None:
        check_same_array_kind(xp, "x", x, "key_mask", key_mask)
        if key_mask.dtype != xp.bool:
            raise TypeError(f"key_mask must be a boolean array (True = keep); got dtype "
                            f"{key_mask.dtype}")
        if key_mask.ndim < 1 or key_mask.shape[-1] != n:
            raise ValueError(f"key_mask must have shape (..., n) with n={n} tokens; got "
                             f"shape {tuple(key_mask.shape)}")
    return xp, m, check_flag("return_counts", return_counts)


# -- Nyströmformer and landmark attention ---------------------------------------------

_LANDMARKS_NOT_CAUSAL = ("its landmarks are means over segments of the whole sequence, so "
                         "every output would depend on future tokens")


def check_landmark_query_mask(p: Problem, query_mask, q):
    """``query_mask (..., n)`` boolean, broadcastable to the batch (the key mask's rules
    on the query axis)."""
    if query_mask is None:
        return None
    if query_mask.ndim < 1 or query_mask.shape[-1] != p.n:
        raise ValueError(f"query_mask must have shape (..., n) with n={p.n} queries; got "
                         f"shape {tuple(query_mask.shape)}")
    # The same dtype, device and batch checks as a key mask, on the query axis.
    return check_key_mask(dataclasses.replace(p, s=p.n), query_mask, q, name="query_mask")


def check_conv_kernel(p: Problem, v, conv_kernel):
    """The official model's depthwise convolution skip: an odd ``(..., K)`` real array,
    returned in the working dtype."""
    if conv_kernel is None:
        return None
    xp = p.xp
    if p.n != p.s:
        raise ValueError(f"conv_kernel needs self-attention (n == s) to add a convolution "
                         f"of v to the output; got n={p.n}, s={p.s}")
    conv_kernel = check_array("conv_kernel", conv_kernel)
    check_same_array_kind(xp, "v", v, "conv_kernel", conv_kernel)
    if not xp.isdtype(conv_kernel.dtype, "real floating"):
        raise TypeError(f"conv_kernel must have a real floating dtype; got {conv_kernel.dtype}")
    if conv_kernel.ndim < 1 or conv_kernel.shape[-1] % 2 == 0:
        raise ValueError(f"conv_kernel must have shape (..., K) with an odd K (the output "
                         f"is centred); got shape {tuple(conv_kernel.shape)}")
    return xp.astype(conv_kernel, p.work_dtype, copy=False)


@dataclass(frozen=True)
class LandmarkCall:
    """A validated :func:`~arrayattn.landmark_attention` call."""

    p: Problem
    key_mask: Any
    query_mask: Any
    num_landmarks: int
    scale: float

    @property
    def options(self) -> dict:
        """The keyword options of the reference form and of the engine."""
        return dict(num_landmarks=self.num_landmarks, scale=self.scale,
                    key_mask=self.key_mask, query_mask=self.query_mask)

    @property
    def work_bytes(self) -> int:
        """The engine's largest temporaries: the ``(n, m)`` and ``(m, s)`` score blocks."""
        p = self.p
        return 4 * math.prod(p.batch) * max(p.n, p.s) * self.num_landmarks


@dataclass(frozen=True)
class NystromCall(LandmarkCall):
    """A validated :func:`~arrayattn.nystrom_attention` call (``conv_kernel`` in the
    working dtype, or ``None``)."""

    pinv: str = "iterative"
    pinv_iters: int = 6
    pinv_init: str = "per_matrix"
    pinv_rtol: float | None = None
    conv_kernel: Any = None

    @property
    def options(self) -> dict:
        return dict(super().options, pinv=self.pinv, pinv_iters=self.pinv_iters,
                    pinv_init=self.pinv_init, pinv_rtol=self.pinv_rtol)


def checked_landmark(q, k, v, /, *, num_landmarks, scale, key_mask, query_mask, causal,
                     variant="landmark_attention") -> LandmarkCall:
    """The validation of :func:`~arrayattn.landmark_attention` (shared with its backward
    and with :func:`checked_nystrom`)."""
    p = check_qkv(q, k, v)
    check_no_causal(check_flag("causal", causal), variant, _LANDMARKS_NOT_CAUSAL)
    check_key_mask(p, key_mask, q)
    check_landmark_query_mask(p, query_mask, q)
    m = check_positive_int("num_landmarks", num_landmarks)
    if m > min(p.n, p.s) and min(p.n, p.s) > 0:   # no tokens: zeros, whatever m
        raise ValueError(
            f"{variant}: num_landmarks={m} exceeds the number of queries n={p.n} or keys "
            f"s={p.s}; each landmark is the mean of at least one token (use m <= "
            f"{min(p.n, p.s)})")
    return LandmarkCall(p, key_mask, query_mask, m, check_scale(scale, p.d))


def checked_nystrom(q, k, v, /, *, num_landmarks, pinv, pinv_iters, pinv_init, pinv_rtol,
                    scale, key_mask, query_mask, conv_kernel, causal) -> NystromCall:
    """The validation of :func:`~arrayattn.nystrom_attention` (shared with its backward)."""
    call = checked_landmark(q, k, v, num_landmarks=num_landmarks, scale=scale,
                            key_mask=key_mask, query_mask=query_mask, causal=causal,
                            variant="nystrom_attention")
    p = call.p
    check_choice("pinv", pinv, PINV_METHODS)
    check_choice("pinv_init", pinv_init, PINV_INITS)
    iters = check_positive_int("pinv_iters", pinv_iters, minimum=0)
    if pinv_rtol is not None and pinv != "svd":
        raise ValueError("pinv_rtol applies to pinv='svd' only")
    if pinv == "svd":
        check_svd_available(p.xp)
    kernel = check_conv_kernel(p, v, conv_kernel)
    return NystromCall(**{f.name: getattr(call, f.name)
                          for f in dataclasses.fields(LandmarkCall)},
                       pinv=pinv, pinv_iters=iters, pinv_init=pinv_init,
                       pinv_rtol=pinv_rtol, conv_kernel=kernel)


# -- Linformer ------------------------------------------------------------------------

LINFORMER_NOT_CAUSAL = (
    "every compressed key (E k)_r and value (F v)_r is a mix of all s positions, past "
    "and future, so no query can be restricted to its past; use a causal variant "
    "(softmax, local, linear) instead"
)


def check_linformer_projection(p: Problem, name: str, x, q):
    """A Linformer projection ``(..., m, s)``: real floating, ``q``'s kind, its leading
    dimensions broadcasting with the batch."""
    x = check_array(name, x)
    check_same_array_kind(p.xp, "q", q, name, x)
    if not p.xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype; got {x.dtype}")
    if x.ndim < 2 or x.shape[-1] != p.s:
        raise ValueError(
            f"{name} must have shape (..., m, s) with s={p.s} keys; got shape {tuple(x.shape)}"
        )
    try:
        np.broadcast_shapes(tuple(x.shape[:-2]), p.batch)
    except ValueError:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} has leading dimensions that do not broadcast "
            f"with the inputs' batch {p.batch}"
        ) from None


# -- Luna -----------------------------------------------------------------------------

_LUNA_NOT_CAUSAL = (
    "every packed token P' attends to all s keys, and every output attends to every "
    "packed token, so each output depends on every key and value; the paper's causal "
    "Luna needs a different (cumulative, per-position) packing that is not implemented"
)


#: The number of packed tokens ``l`` the uniform call draws by default.
LUNA_UNIFORM_L = 16


@dataclass(frozen=True)
class LunaCall:
    """A validated :func:`~arrayattn.luna_attention` call: ``pack`` the problem of the
    pack step (``p, k, v``); ``packed_queries`` (``P``) and the unpack projections in the
    working dtype (``None`` where absent); ``qkv`` the caller's arrays (an empty problem
    still packs the keys)."""

    p: Problem
    pack: Problem
    key_mask: Any
    scale: float
    packed_queries: Any
    unpack_key_proj: Any
    unpack_value_proj: Any
    return_packed: bool
    qkv: tuple


def check_unpack_projection(p: Problem, name: str, w, ref, rows: int, cols_name: str):
    """A Luna unpack projection ``(..., dv, cols)`` (``None`` passes)."""
    if w is None:
        return None
    w = check_array(name, w)
    check_same_array_kind(p.xp, "q", ref, name, w)
    if not p.xp.isdtype(w.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype; got {w.dtype}")
    if w.ndim < 2 or w.shape[-2] != rows:
        raise ValueError(
            f"{name} must have shape (..., dv, {cols_name}) with dv={rows} (the value "
            f"dimension of the packed sequence); got shape {tuple(w.shape)}"
        )
    return w


def _check_luna(prob: Problem, q, k, v, p, *, scale=None, causal=False, key_mask=None,
                unpack_key_proj=None, unpack_value_proj=None,
                return_packed=False) -> LunaCall:
    """Everything of a Luna call but ``q, k, v`` (checked into ``prob``)."""
    check_no_causal(check_flag("causal", causal), "luna_attention", _LUNA_NOT_CAUSAL)
    check_key_mask(prob, key_mask, q)
    p = check_array("p", p)
    pack = check_qkv(p, k, v, names=("p", "k", "v"))
    check_same_array_kind(prob.xp, "q", q, "p", p)
    wk = check_unpack_projection(prob, "unpack_key_proj", unpack_key_proj, q, prob.dv, "d")
    wv = check_unpack_projection(prob, "unpack_value_proj", unpack_value_proj, q, prob.dv,
                                 "dv2")
    if wk is None and prob.dv != prob.d:
        raise ValueError(
            f"the unpack step attends with keys P' of dimension dv={prob.dv} but q has "
            f"d={prob.d}; pass unpack_key_proj of shape (dv, d) = ({prob.dv}, {prob.d})"
        )
    if wk is not None and wk.shape[-1] != prob.d:
        raise ValueError(
            f"unpack_key_proj must map dv={prob.dv} to d={prob.d}; got shape "
            f"{tuple(wk.shape)}"
        )
    scale = check_scale(scale, prob.d)
    xp, wd = prob.xp, prob.work_dtype
    wp, wk, wv = (None if x is None else xp.astype(x, wd, copy=False) for x in (p, wk, wv))
    return LunaCall(prob, pack, key_mask, scale, wp, wk, wv,
                    check_flag("return_packed", return_packed), (q, k, v))


def checked_luna(q, k, v, p, **options) -> LunaCall:
    """The validation of :func:`~arrayattn.luna_attention` (shared with its backward);
    ``options`` those of the public function."""
    return _check_luna(check_qkv(q, k, v), q, k, v, p, **options)


def luna_uniform_draw(prob: Problem, q, *, num_packed, seed, options: dict):
    """``(P, options)`` of Luna's uniform call: ``P (num_packed, d)`` drawn i.i.d.
    ``N(0, 1)`` with ``numpy.random.default_rng(seed)`` in ``q``'s dtype, and ``W_K (dv,
    d)``, ``N(0, 1/dv)`` from the same generator, added to ``options`` when ``dv != d``
    and none is given."""
    xp = prob.xp
    num_packed = check_positive_int("num_packed", num_packed)
    d, dv = prob.d, prob.dv
    rng = np.random.default_rng(check_seed(seed))
    p = xp_from_host(xp, rng.standard_normal((num_packed, d)), dtype=q.dtype,
                     device=xp_device(q))
    if dv != d and options.get("unpack_key_proj") is None:
        wk = rng.standard_normal((dv, d)) / np.sqrt(dv)
        options = {**options, "unpack_key_proj": xp_from_host(xp, wk, dtype=q.dtype,
                                                              device=xp_device(q))}
    return p, options


def checked_luna_uniform(q, k, v, /, *, num_packed=LUNA_UNIFORM_L, seed=0,
                         **options) -> LunaCall:
    """The validation of Luna's uniform call: ``q, k, v`` checked once, ``P`` (and
    ``W_K``) drawn (:func:`luna_uniform_draw`), then the rest of the call."""
    prob = check_qkv(q, k, v)
    p, options = luna_uniform_draw(prob, q, num_packed=num_packed, seed=seed,
                                   options=options)
    return _check_luna(prob, q, k, v, p, **options)
