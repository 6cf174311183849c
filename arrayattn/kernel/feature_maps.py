r"""Feature maps of kernel (linear) attention: :math:`\kappa(q, k) = \varphi_q(q)\cdot\varphi_k(k)`.

A :class:`FeatureMap` is a small record: a name, the query map, the key map (they may
differ) and the output dimension ``m`` for a given input dimension ``d``.  The maps take
and return arrays of any array-API library, ``(..., d) -> (..., m)``, and work on the
last axis only.

Built-in maps (:func:`get_feature_map` by name):

========== ============================================= ============ ====================
name       :math:`\varphi(x)`                            ``m``        kernel
========== ============================================= ============ ====================
``elu+1``  :math:`\operatorname{elu}(x) + 1`             ``d``        Katharopoulos et al.
``relu``   :math:`\max(x, 0)`                            ``d``        ``relu(q).relu(k)``
``cosine`` :math:`[1, x/\lVert x\rVert]`                 ``d + 1``    ``1 + cos(q, k)``
``taylor`` :math:`[1, a x, a^2\,\mathrm{vec}(x x^\top)/\sqrt2]` ``1+d+d^2`` ``1 + t + t^2/2``
========== ============================================= ============ ====================

with :math:`t = a^2\, q\cdot k` for the Taylor map (second-order Taylor expansion of
:math:`e^t`, positive for every ``t`` since its discriminant is negative).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import array_api_compat

from ..core.xp import xp_device, xp_namespace
from ..reference.kernel_vjp import (cosine_features_vjp, elu_plus_one_vjp, relu_vjp,
                                    taylor_features_vjp)

__all__ = ["FeatureMap", "get_feature_map", "taylor_feature_map", "FEATURE_MAPS",
           "elu_plus_one", "relu", "cosine_features"]


@dataclass(frozen=True)
class FeatureMap:
    r"""A kernel feature map :math:`\kappa(q, k) = \varphi_q(q)\cdot\varphi_k(k)`.

    Attributes
    ----------
    name : str
        For reprs, reports and the registry.
    query, key : callable
        ``(..., d) -> (..., m)`` maps applied to queries and to keys.  Each takes and
        returns an array of one array-API library, on the input's device and dtype.
    dim : callable or None
        ``dim(d) -> m``; ``None`` when unknown (user maps), then :meth:`output_dim`
        probes the map on a zero row.
    nonnegative : bool
        Every feature value is ``>= 0`` (``elu+1``, ``relu``).  ``cosine`` and ``taylor``
        have negative features but a non-negative kernel.
    kernel : str
        The kernel in words, for docs and reprs.
    query_vjp, key_vjp : callable or None
        ``(x, dphi) -> dx``: the cotangent of the map's input from that of its output
        (the built-in maps have them; a user map needs them for :func:`arrayattn.vjp`).
    """

    name: str
    query: Callable
    key: Callable
    dim: Callable[[int], int] | None = None
    nonnegative: bool = False
    kernel: str = ""
    query_vjp: Callable | None = None
    key_vjp: Callable | None = None

    def output_dim(self, d: int, *, xp=None, dtype=None, device=None) -> int:
        """The feature dimension ``m`` for inputs of dimension ``d``.

        For a map without ``dim`` this applies the query map to one zero row of the
        given namespace (``xp``, default NumPy), dtype and device.
        """
        if self.dim is not None:
            return int(self.dim(d))
        if xp is None:
            import array_api_compat.numpy as xp
        if dtype is None:
            dtype = xp.float64
        probe = self.query(xp.zeros((1, d), dtype=dtype, device=device))
        if not array_api_compat.is_array_api_obj(probe) or probe.ndim < 1:
            raise TypeError(f"feature_map's query map output must be an array with a "
                            f"feature axis; got {type(probe).__name__}")
        return int(probe.shape[-1])


def _ones_column(xp, x):
    return xp.ones((*x.shape[:-1], 1), dtype=x.dtype, device=xp_device(x))


def elu_plus_one(x):
    r""":math:`\operatorname{elu}(x) + 1 = x + 1` for :math:`x > 0`, :math:`e^x` otherwise (> 0)."""
    xp = xp_namespace(x)
    # exp(min(x, 0)) + max(x, 0): one branch is exactly 0 (x > 0: 1 + x; else e^x + 0),
    # nothing overflows, and no boolean temporary is needed.
    return xp.exp(xp.clip(x, max=0.0)) + xp.clip(x, min=0.0)


def relu(x):
    r""":math:`\max(x, 0)`."""
    xp = xp_namespace(x)
    return xp.clip(x, min=0.0)


def cosine_features(x):
    r""":math:`[1, x/\lVert x\rVert]`, so that :math:`\varphi(q)\cdot\varphi(k) = 1 + \cos(q, k)`.

    A zero row maps to ``[1, 0, ..., 0]`` (its cosine with anything is taken as 0), not
    ``NaN``.
    """
    xp = xp_namespace(x)
    nrm = xp.linalg.vector_norm(x, axis=-1, keepdims=True)
    unit = x / xp.where(nrm > 0, nrm, xp.ones_like(nrm))
    return xp.concat([_ones_column(xp, x), unit], axis=-1)


def _taylor(x, a: float):
    xp = xp_namespace(x)
    d = x.shape[-1]
    y = x * a if a != 1.0 else x
    outer = y[..., :, None] * y[..., None, :] * (1.0 / math.sqrt(2.0))
    return xp.concat(
        [_ones_column(xp, x), y, xp.reshape(outer, (*x.shape[:-1], d * d))], axis=-1
    )


def taylor_feature_map(input_scale: float = 1.0) -> FeatureMap:
    r"""The second-order Taylor feature map with inputs scaled by ``input_scale`` (``a``).

    .. math::

        \varphi(x) = \left[1,\; a x,\; a^2\,\mathrm{vec}(x x^\top)/\sqrt{2}\right],\qquad
        \varphi(q)\cdot\varphi(k) = 1 + t + t^2/2,\quad t = a^2\, q\cdot k,

    the second-order Taylor expansion of :math:`e^{t}` (as in Zhang et al. 2024,
    *The Hedgehog & the Porcupine*, and Arora et al. 2024, *Based*, which use
    ``a = d**-0.25`` so that ``t = q.k/sqrt(d)``).  The kernel is ``> 0`` for every
    ``t``; ``m = 1 + d + d^2``.

    Examples
    --------
    >>> import numpy as np
    >>> fm = taylor_feature_map(0.5)
    >>> q, k = np.array([1.0, 2.0]), np.array([3.0, -1.0])
    >>> t = 0.25 * q @ k
    >>> bool(np.isclose(fm.query(q) @ fm.key(k), 1 + t + t * t / 2))
    True
    >>> fm.output_dim(2)
    7
    """
    if isinstance(input_scale, bool) or not isinstance(input_scale, (int, float)):
        raise TypeError(f"input_scale must be a real number; got {input_scale!r}")
    a = float(input_scale)
    if not (math.isfinite(a) and a > 0.0):
        raise ValueError(f"input_scale must be a finite number > 0 (the kernel depends on "
                         f"a^2 only); got {input_scale}")

    def phi(x):
        return _taylor(x, a)

    def phi_vjp(x, dphi):
        return taylor_features_vjp(x, dphi, a)

    name = "taylor" if a == 1.0 else f"taylor(input_scale={a:g})"
    return FeatureMap(name, phi, phi, dim=lambda d: 1 + d + d * d,
                      kernel="1 + t + t^2/2 with t = a^2 q.k (a = input_scale)",
                      query_vjp=phi_vjp, key_vjp=phi_vjp)


FEATURE_MAPS = {
    "elu+1": FeatureMap("elu+1", elu_plus_one, elu_plus_one, dim=lambda d: d,
                        nonnegative=True, kernel="(elu(q)+1).(elu(k)+1)",
                        query_vjp=elu_plus_one_vjp, key_vjp=elu_plus_one_vjp),
    "relu": FeatureMap("relu", relu, relu, dim=lambda d: d, nonnegative=True,
                       kernel="relu(q).relu(k)", query_vjp=relu_vjp, key_vjp=relu_vjp),
    "cosine": FeatureMap("cosine", cosine_features, cosine_features, dim=lambda d: d + 1,
                         kernel="1 + cos(q, k)", query_vjp=cosine_features_vjp,
                         key_vjp=cosine_features_vjp),
    "taylor": taylor_feature_map(1.0),
}


def get_feature_map(spec) -> FeatureMap:
    """A :class:`FeatureMap` from a name, a map, one callable or a pair of callables.

    ``spec`` is one of the names ``"elu+1"``, ``"relu"``, ``"cosine"``, ``"taylor"``; a
    :class:`FeatureMap`; a callable ``phi`` used for queries and keys; or a pair
    ``(phi_q, phi_k)``.

    Examples
    --------
    >>> get_feature_map("elu+1").name
    'elu+1'
    >>> get_feature_map((abs, abs)).name
    'user'
    """
    if isinstance(spec, FeatureMap):
        return spec
    if isinstance(spec, str):
        try:
            return FEATURE_MAPS[spec]
        except KeyError:
            raise ValueError(
                f"feature_map must be one of {sorted(FEATURE_MAPS)!r}, a FeatureMap, a "
                f"callable or a pair (phi_q, phi_k) of callables; got {spec!r}"
            ) from None
    if callable(spec):
        return FeatureMap(getattr(spec, "__name__", "user"), spec, spec)
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and all(map(callable, spec)):
        return FeatureMap("user", spec[0], spec[1])
    raise TypeError(
        "feature_map must be a name, a FeatureMap, a callable or a pair (phi_q, phi_k) "
        f"of callables; got {spec!r}"
    )
