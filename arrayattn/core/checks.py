"""Input validation shared by every public function.

Every error names the argument and the offending shapes, dtypes, devices or
namespaces, so that a user porting a model sees at once which input is wrong.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from .xp import compute_dtype, xp_device, xp_namespace

__all__ = ["Problem", "check_array", "check_qkv", "check_key_mask", "check_mask",
           "check_positive_int", "check_scale", "check_choice", "check_no_causal",
           "check_same_array_kind", "check_flag", "check_seed", "broadcast_batch", "check_bias",
           "check_band", "check_bool_mask", "shape_of", "check_tokens"]


@dataclass(frozen=True)
class Problem:
    """What :func:`check_qkv` learned about an attention call."""

    xp: Any
    n: int
    s: int
    d: int
    dv: int
    batch: tuple
    dtype: Any          # the caller's dtype (the output dtype)
    work_dtype: Any     # the dtype arithmetic is done in (float32 for half precisions)
    device: Any

    @property
    def out_shape(self) -> tuple:
        return (*self.batch, self.n, self.dv)

    @property
    def empty(self) -> bool:
        """No key, no query or no batch element (zero heads): the output is
        :meth:`zeros` whatever the variant computes."""
        return self.n == 0 or self.s == 0 or 0 in self.batch

    def zeros(self):
        """The output of a call with no keys (``s = 0``): every query attends to nothing,
        so it returns zeros (the empty-row convention)."""
        return self.xp.zeros(self.out_shape, dtype=self.dtype, device=self.device)


def shape_of(x) -> tuple:
    return tuple(x.shape)


def broadcast_batch(named_shapes: list[tuple[str, tuple]]) -> tuple:
    try:
        return tuple(np.broadcast_shapes(*(s for _, s in named_shapes)))
    except ValueError:
        desc = ", ".join(f"{name} {shape}" for name, shape in named_shapes)
        raise ValueError(
            f"leading (batch) dimensions do not broadcast: {desc}"
        ) from None




def _check_float(xp, name: str, x) -> None:
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32 or "
            f"float64); got {x.dtype}"
        )


def check_same_array_kind(xp, ref_name: str, ref, name: str, x) -> None:
    """``x`` must live in the same namespace and on the same device as ``ref``."""
    xp_namespace(ref, x, names=(ref_name, name))
    dref, dx = xp_device(ref), xp_device(x)
    if dref is not None and dx is not None and dref != dx:
        raise ValueError(f"{name} is on device {dx} but {ref_name} is on device {dref}")


def check_array(name: str, x, *, min_ndim: int = 0):
    """``x`` must be an array of a supported library with at least ``min_ndim`` axes.

    A Python list, ``None`` or a scalar gets a ``TypeError`` naming the argument (not an
    ``AttributeError`` from deep inside), a too-small array a ``ValueError``.
    """
    try:
        xp_namespace(x)
    except TypeError:
        raise TypeError(
            f"{name} must be an array (NumPy, CuPy, PyTorch, JAX or another array API "
            f"library); got {type(x).__module__}.{type(x).__qualname__}"
        ) from None
    if x.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions; got shape {shape_of(x)}")
    return x


def check_tokens(names, *arrays) -> None:
    """One token each (the decoding step API): arrays of at least one axis (features)."""
    for name, x in zip(names, arrays):
        check_array(name, x, min_ndim=1)


def check_qkv(q, k, v, *, names=("q", "k", "v"), same_dim=True) -> Problem:
    """Validate ``q (..., n, d)``, ``k (..., s, d)``, ``v (..., s, dv)`` and describe them.

    ``same_dim=False`` skips the ``k.d == q.d`` check (for variants whose keys live in
    another space).
    """
    nq, nk, nv = names
    for name, x in zip(names, (q, k, v)):
        check_array(name, x)
    xp = xp_namespace(q, k, v, names=names)
    for name, x in ((nq, q), (nk, k), (nv, v)):
        if x.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., tokens, features); "
                f"got shape {shape_of(x)}"
            )
        _check_float(xp, name, x)
    if same_dim and k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"{nk} has d={k.shape[-1]} but {nq} has d={q.shape[-1]} "
            f"(shapes {nq} {shape_of(q)}, {nk} {shape_of(k)})"
        )
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"{nv} has s={v.shape[-2]} tokens but {nk} has s={k.shape[-2]} "
            f"(shapes {nk} {shape_of(k)}, {nv} {shape_of(v)})"
        )
    for name, x in ((nk, k), (nv, v)):
        if x.dtype != q.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {nq} has dtype {q.dtype}; "
                "cast them to one dtype"
            )
    dev = xp_device(q)
    for name, x in ((nk, k), (nv, v)):
        dx = xp_device(x)
        if dev is not None and dx is not None and dx != dev:
            raise ValueError(f"{name} is on device {dx} but {nq} is on device {dev}")
    batch = broadcast_batch(
        [(nq, shape_of(q)[:-2]), (nk, shape_of(k)[:-2]), (nv, shape_of(v)[:-2])]
    )
    return Problem(
        xp=xp, n=q.shape[-2], s=k.shape[-2], d=q.shape[-1], dv=v.shape[-1],
        batch=batch, dtype=q.dtype, work_dtype=compute_dtype(xp, q.dtype), device=dev,
    )


def check_bool_mask(p: Problem, name: str, x, ref_name: str, ref) -> None:
    check_same_array_kind(p.xp, ref_name, ref, name, x)
    if x.dtype != p.xp.bool:
        raise TypeError(f"{name} must be a boolean array (True = keep); got dtype {x.dtype}")


def check_key_mask(p: Problem, key_mask, q, *, name: str = "key_mask"):
    """``key_mask (..., s)`` boolean, broadcastable to the batch; returns it unchanged."""
    if key_mask is None:
        return None
    check_bool_mask(p, name, key_mask, "q", q)
    if key_mask.ndim < 1 or key_mask.shape[-1] != p.s:
        raise ValueError(
            f"{name} must have shape (..., s) with s={p.s} keys; got shape {shape_of(key_mask)}"
        )
    batch = broadcast_batch([("q/k/v", p.batch), (name, shape_of(key_mask)[:-1])])
    if batch != p.batch:
        raise ValueError(
            f"{name} of shape {shape_of(key_mask)} has more batch dimensions than the "
            f"inputs' batch {p.batch}"
        )
    return key_mask


def check_mask(p: Problem, mask, q, *, name: str = "mask"):
    """``mask (..., n, s)`` boolean, broadcastable to the batch; returns it unchanged."""
    if mask is None:
        return None
    check_bool_mask(p, name, mask, "q", q)
    if mask.ndim < 2 or tuple(mask.shape[-2:]) != (p.n, p.s):
        raise ValueError(
            f"{name} must have shape (..., n, s) = (..., {p.n}, {p.s}); got shape {shape_of(mask)}"
        )
    batch = broadcast_batch([("q/k/v", p.batch), (name, shape_of(mask)[:-2])])
    if batch != p.batch:
        raise ValueError(
            f"{name} of shape {shape_of(mask)} has more batch dimensions than the "
            f"inputs' batch {p.batch}"
        )
    return mask


def check_positive_int(name: str, value, *, allow_none: bool = False, minimum: int = 1):
    """``value`` must be an integer >= ``minimum`` (``None`` passes when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def check_scale(scale, d: int) -> float:
    """``None`` -> ``1/sqrt(d)`` (``d >= 1``); otherwise a finite real number."""
    if scale is None:
        if d < 1:
            raise ValueError(
                "scale=None means 1/sqrt(d), which needs d >= 1 features; got d = 0 "
                "(pass scale= explicitly, or inputs with features)")
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale}")
    return float(scale)


def check_choice(name: str, value, choices) -> str:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {sorted(choices)!r}; got {value!r}")
    return value


def check_no_causal(causal, variant: str, why: str) -> None:
    """Raise the explanatory ``ValueError`` of a variant that cannot be causal."""
    if causal:
        raise ValueError(f"{variant} cannot be causal: {why}")


def check_flag(name: str, value) -> bool:
    """``value`` must be a ``bool`` (or a NumPy bool): ``causal="False"`` is a string,
    and a non-empty string is true -- a silent wrong answer."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be True or False; got {value!r}")


def check_seed(seed) -> int:
    """The one rule for every random variant: ``seed`` is a non-negative integer.

    Random matrices are drawn on the host with ``numpy.random.default_rng(seed)``, so the
    same seed gives the same matrix on every backend.  ``None`` (fresh entropy, a
    different result on every call) is refused: pass the matrix itself (``omega=``,
    ``e=``/``f=``, ``rotations=`` ...) to use your own draw.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"seed must be a non-negative integer; got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed}")
    return int(seed)


def check_bias(p: Problem, bias, q, *, name: str = "bias"):
    """``bias (..., n, s)`` real floating, broadcastable to the batch; returned cast to
    the working dtype (``None`` passes)."""
    if bias is None:
        return None
    check_array(name, bias)
    check_same_array_kind(p.xp, "q", q, name, bias)
    if not p.xp.isdtype(bias.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype (an additive logit bias; "
                        f"use mask= for a boolean mask); got {bias.dtype}")
    if bias.ndim < 2 or tuple(bias.shape[-2:]) != (p.n, p.s):
        raise ValueError(
            f"{name} must have shape (..., n, s) = (..., {p.n}, {p.s}); got shape {shape_of(bias)}")
    batch = broadcast_batch([("q/k/v", p.batch), (name, shape_of(bias)[:-2])])
    if batch != p.batch:
        raise ValueError(
            f"{name} of shape {shape_of(bias)} has more batch dimensions than the "
            f"inputs' batch {p.batch}")
    return p.xp.astype(bias, p.work_dtype, copy=False)


def check_band(name: str, window) -> tuple[int, int]:
    """A token band: an int ``w`` (``(w, w)``) or a pair ``(left, right)`` of ints >= 0
    (the sparse patterns' and Poolingformer's windows)."""
    if isinstance(window, numbers.Integral) and not isinstance(window, bool):
        window = (int(window), int(window))
    if (not isinstance(window, tuple) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                       for w in window)):
        raise TypeError(f"{name} must be an int or a pair (left, right) of ints; got "
                        f"{window!r}")
    if min(window) < 0:
        raise ValueError(f"{name} sizes must be >= 0; got {window!r}")
    return tuple(int(w) for w in window)
