"""Validation of the kernel-attention calls (linear, feature and efficient attention): each ``check_*`` validates one call once and returns its record, which the
pipeline (:mod:`arrayattn.core.pipeline`) and the backward adapters share.

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..core.checks import Problem, check_flag, check_key_mask, check_no_causal, check_qkv
from .checks import check_kernel_options, check_state, checked_maps
from .feature_maps import FEATURE_MAPS, get_feature_map

__all__ = ["StateProblem", "KernelCall", "check_linear", "check_features", "EfficientCall",
           "check_efficient", "EFFICIENT_NOT_CAUSAL"]

#: Why :func:`~arrayattn.efficient_attention` cannot be causal.
EFFICIENT_NOT_CAUSAL = ("its softmax over the keys normalises each feature over the whole "
                        "sequence, so every output depends on every (also future) key")


@dataclass(frozen=True)
class StateProblem(Problem):
    """A :class:`Problem` whose result carries a decoding state (``return_state``, or a
    given ``state``): never empty -- the state sums the keys even when there is no query,
    and a given state is seen by every query even when there is no key.  ``batch`` is the
    inputs' broadcast with the state's."""

    @property
    def empty(self) -> bool:
        return False


def _with_state(p: Problem, batch: tuple) -> StateProblem:
    return StateProblem(**{**{f.name: getattr(p, f.name) for f in fields(Problem)},
                           "batch": batch})


# ---------------------------------------------------------------------------------------
# Kernel attention: linear_attention, feature_attention, efficient_attention
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelCall:
    """A validated :func:`~arrayattn.linear_attention` or
    :func:`~arrayattn.feature_attention` call.  ``maps = (phi_q, phi_k)`` are applied to
    ``q`` and ``k`` (``None``: they are the features already), ``m`` is the feature width
    (sizes the engine's blocks), ``feature_map`` is stored in a returned state and
    ``state`` holds keys summed earlier."""

    p: Problem
    key_mask: Any
    causal: bool
    method: str
    chunk_size: int
    eps: float
    m: int
    return_state: bool = False
    normalize: bool = True
    maps: tuple | None = None
    feature_map: Any = None
    state: Any = None


def check_linear(q, k, v, *, feature_map="elu+1", causal=False, key_mask=None, eps=None,
                 method=None, chunk_size=64, return_state=False,
                 normalize=True) -> KernelCall:
    """Validate a :func:`~arrayattn.linear_attention` call once."""
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    return_state = check_flag("return_state", return_state)
    chunk_size, method, eps = check_kernel_options(p, q, key_mask, chunk_size, method, eps)
    fm = get_feature_map(feature_map)
    if fm.name in FEATURE_MAPS and fm is FEATURE_MAPS[fm.name]:
        maps = (fm.query, fm.key)
    else:                  # a caller's map: its outputs checked where they are made
        maps = checked_maps(fm, q)
    normalize = check_flag("normalize", normalize)
    m = fm.dim(p.d) if fm.dim is not None else p.d
    if return_state:
        p = _with_state(p, p.batch)
    return KernelCall(p, key_mask, causal, method, chunk_size, eps, m, return_state,
                      normalize, maps, fm)


def check_features(phi_q, phi_k, v, *, causal=False, key_mask=None, eps=None, method=None,
                   chunk_size=64, return_state=False, state=None) -> KernelCall:
    """Validate a :func:`~arrayattn.feature_attention` call once (``state``: a
    :class:`~arrayattn.LinearAttentionState` of the same feature width)."""
    p = check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
    causal = check_flag("causal", causal)
    return_state = check_flag("return_state", return_state)
    chunk_size, method, eps = check_kernel_options(p, phi_q, key_mask, chunk_size, method,
                                                   eps)
    if state is not None or return_state:
        p = _with_state(p, p.batch if state is None else check_state(p, state, phi_q, p.d))
    return KernelCall(p, key_mask, causal, method, chunk_size, eps, p.d, return_state,
                      feature_map=None if state is None else state.feature_map, state=state)


@dataclass(frozen=True)
class EfficientCall:
    """A validated :func:`~arrayattn.efficient_attention` call."""

    p: Problem
    key_mask: Any


def check_efficient(q, k, v, *, causal=False, key_mask=None) -> EfficientCall:
    """Validate an :func:`~arrayattn.efficient_attention` call once (it is not causal)."""
    check_no_causal(check_flag("causal", causal), "efficient_attention",
                    EFFICIENT_NOT_CAUSAL)
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    return EfficientCall(p, key_mask)
