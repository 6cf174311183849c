r"""The decoding state of causal kernel attention: a frozen record of ``S``, ``z``, the tokens
seen and the feature map (the step API is :mod:`arrayattn.kernel.decoding`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["LinearAttentionState"]


@dataclass(frozen=True)
class LinearAttentionState:
    r"""The recurrent state of causal linear attention after some tokens.

    .. math:: S = \sum_j \varphi_k(k_j) v_j^\top \;(\ldots, m, d_v),\qquad
              z = \sum_j \varphi_k(k_j) \;(\ldots, m)

    over the ``num_tokens`` keys seen so far.  ``S`` and ``z`` are kept in the working
    dtype (float32 for float16/bfloat16 inputs).  The state is immutable: every update
    returns a new state (safe under JAX transformations).

    Attributes
    ----------
    S : array, shape ``(..., m, dv)``
    z : array, shape ``(..., m)``
    num_tokens : int
        Keys summed into the state.
    feature_map : FeatureMap or None
        The map the features were made with (``None`` for states of
        :func:`feature_attention`, whose caller owns the features).
    """

    S: Any
    z: Any
    num_tokens: int = 0
    feature_map: Any = None     # a FeatureMap, or None

    @property
    def m(self) -> int:
        return int(self.S.shape[-2])

    @property
    def dv(self) -> int:
        return int(self.S.shape[-1])

    @property
    def batch(self) -> tuple:
        return tuple(self.S.shape[:-2])
