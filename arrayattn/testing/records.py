"""The records a port profile is made of: the profile itself and what its ``prepare`` makes of
a port's problem."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["Profile", "Prepared", "take_options", "repeat_kv_heads"]


@dataclass(frozen=True, repr=False)
class Profile:
    """A port's conventions mapped onto an arrayattn variant (see ``docs/validating.rst``).

    Attributes
    ----------
    name : str
        The ``profile=`` name.
    port : str
        The implementation it describes (package and function or module).
    layout : str
        The port's axis order (one of :data:`LAYOUTS`).
    options : str
        The port-native options the profile takes (``**params``).
    deviations : str
        Where the port departs from the maths, and whether the profile reproduces it.
    prepare : callable
        ``prepare(q, k, v, params) -> Prepared``: the port's problem (host float64 arrays in
        ``"bhnd"``, the port's own option names) in arrayattn's conventions.
    """

    name: str
    port: str
    layout: str
    options: str
    deviations: str
    prepare: Callable

    def __repr__(self) -> str:
        return f"<Profile {self.name}: {self.port}, layout {self.layout}>"


@dataclass(repr=False)
class Prepared:
    """What a profile makes of a port's problem: the registry ``variant``, the inputs
    and ``options`` in arrayattn's conventions, the query ``rows`` of the reference that
    correspond to the port's output (``None``: all), ``notes`` on known deviations,
    ``lse_shift`` (added to the reference's log-sum-exp where the port's differs by a
    constant per row; broadcasts against ``(..., n)``), ``convert`` (applied to every
    array before the reference runs, e.g. onto torch for a torch-written ``score_mod``)
    and ``form_shifts`` (per-row constants, like ``lse_shift``, that the forms the port's
    authors ship add to the logits -- FlashAttention's ``attention_ref`` forms causal
    ALiBi as ``slope (j - s + 1)`` -- rounded at that size by a plain evaluation:
    :mod:`arrayattn.testing.plain`)."""

    variant: str
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict
    rows: slice | None = None
    notes: list = field(default_factory=list)
    lse_shift: np.ndarray | None = None
    convert: Callable | None = None
    form_shifts: tuple = ()


def take_options(params: dict, profile: str, allowed: dict) -> dict:
    """The port-native options of ``profile`` with their defaults; unknown keys are errors."""
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"profile {profile!r} takes the port's options "
                         f"{sorted(allowed)}; got unknown option(s) {unknown}")
    return {key: params.get(key, default) for key, default in allowed.items()}


def repeat_kv_heads(q, k, v, option: str):
    """``(k, v)`` with each key/value head repeated over ``hq // hk`` consecutive query heads
    (torch's GQA: SDPA's and FlexAttention's ``enable_gqa``)."""
    if q.ndim < 3 or k.ndim < 3 or q.shape[-3] % k.shape[-3]:
        raise ValueError(f"{option} needs q heads a multiple of k heads; got q "
                         f"{q.shape}, k {k.shape}")
    group = q.shape[-3] // k.shape[-3]
    return tuple(np.repeat(x, group, axis=-3) for x in (k, v))
