"""A comparison's problem in arrayattn's conventions (host copies, layout, the profile's
mapping, a paged cache) and its reference, evaluated in float64 or a working precision."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..core.xp import to_numpy
from .measures import EPS, cast_floating, dtype_name, host64, is_array
from .profiles import get_profile
from .records import Prepared

__all__ = ["LAYOUTS", "PAGED", "Problem", "to_bhnd", "prepare", "paged_reference",
           "floating_dtype"]

#: Axis orders of ``q``, ``k``, ``v`` and ``out`` that :func:`compare_to_reference` reads:
#: ``"bhnd"`` ``(..., heads, tokens, dim)`` (arrayattn, torch SDPA, performer-pytorch,
#: nystrom-attention) and ``"bnhd"`` ``(batch, tokens, heads, dim)`` (fla, flash-attn,
#: fast-transformers, HF before its head split).
LAYOUTS = ("bhnd", "bnhd")

#: The options of a paged KV cache: a problem with them is judged against
#: :func:`arrayattn.paged_attention`, ``k`` and ``v`` being the caches
#: ``(num_blocks, page, h_kv, d)`` (in either layout).
PAGED = ("block_table", "cache_seqlens")


def floating_dtype(x, name: str) -> str:
    """The dtype name of the array under test ``name``; TypeError unless floating."""
    dtype = dtype_name(x)
    if dtype not in EPS:
        raise TypeError(f"{name} must have a floating dtype ({', '.join(EPS)}); got {dtype}")
    return dtype


def to_bhnd(arrays: dict, layout: str, names=("q", "k", "v", "out")) -> dict:
    """Host arrays in ``layout`` -> ``"bhnd"``.  In ``"bnhd"`` the tokens axis is -3: the
    arrays ``names`` swap axes -3 and -2; a ``key_mask (batch, s)`` gains a heads axis,
    ``(batch, 1, s)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if layout == "bhnd":
        return arrays
    res = dict(arrays)
    for name in (n for n in names if is_array(res.get(n))):
        if res[name].ndim < 3:
            raise ValueError(f"layout 'bnhd' needs {name} of shape (..., tokens, heads, dim); "
                             f"got {name} of shape {res[name].shape}")
        res[name] = np.swapaxes(res[name], -3, -2)
    km = res.get("key_mask")
    if is_array(km) and km.ndim >= 1:
        res["key_mask"] = np.expand_dims(km, -2)
    return res


def paged_reference(q, k, v, /, *, block_table, cache_seqlens, **options):
    """:func:`arrayattn.paged_attention` by its reference form, ``k`` and ``v`` the caches."""
    from ..core.engine import use_engine
    from ..exact.paged import paged_attention
    with use_engine("reference"):
        return paged_attention(q, k, v, block_table, cache_seqlens, **options)


@dataclass(repr=False)
class Problem:
    """What is compared: ``reference(q, k, v, **options)`` (host arrays in ``"bhnd"``) under
    the report name ``name``; ``rows``, ``lse_shift``, ``convert``, ``form_shifts`` and
    ``notes`` as the
    profile's :class:`~arrayattn.testing.Prepared` has them."""

    name: str
    reference: Callable
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict
    layout: str = "bhnd"
    profile: str | None = None
    rows: slice | None = None
    notes: list = field(default_factory=list)
    lse_shift: np.ndarray | None = None
    convert: Callable | None = None
    form_shifts: tuple = ()

    def evaluate(self, dtype: str = "float64", nudge=None, *, lse: bool = False,
                 options_too: bool = False) -> np.ndarray:
        """The reference's output (or ``lse``) computed in ``dtype`` from the inputs, ``q``,
        ``k``, ``v`` perturbed by ``nudge`` when given (with ``options_too``, the floating
        option arrays too: biases, slopes, gates), as host float64 rows of the port."""
        args = cast_floating({"q": self.q, "k": self.k, "v": self.v}, dtype, nudge)
        options = cast_floating(self.options, dtype, nudge if options_too else None)
        if self.convert is not None:
            args, options = ({key: self.convert(val) if is_array(val) else val
                              for key, val in d.items()} for d in (args, options))
        if lse:
            options["return_lse"] = True
        res = self.reference(args["q"], args["k"], args["v"], **options)
        res = np.asarray(to_numpy(res[1] if lse else res), dtype=np.float64)
        if self.rows is not None:
            res = res[..., self.rows] if lse else res[..., self.rows, :]
        return res + self.lse_shift if lse and self.lse_shift is not None else res

    def shapes(self) -> str:
        """``q (..), k (..), v (..)`` as the reference sees them (layout ``"bhnd"``)."""
        return (f"q {self.q.shape}, k {self.k.shape}, v {self.v.shape}" + (
            f" (layout {self.layout!r}; shapes shown as (..., heads, tokens, dim))"
            if self.layout != "bhnd" else ""))


def _profile_prepared(prof, variant, q, k, v, options) -> Prepared:
    """The profile's mapping, checked against an explicit ``variant``."""
    from ..registry import get_variant

    prep = prof.prepare(q, k, v, options)
    if variant is not None and get_variant(variant).name != prep.variant:
        raise ValueError(f"profile {prof.name!r} validates {prep.variant!r} for these "
                         f"options; got variant {get_variant(variant).name!r}")
    return prep


def _reference_of(name: str, options: dict) -> tuple[str, Callable]:
    """``(report name, reference)``: the registry record's, or the paged cache's."""
    from ..registry import get_variant

    rec = get_variant(name)
    given = [key for key in PAGED if options.get(key) is not None]
    if not given:
        return rec.name, rec.reference
    if len(given) < len(PAGED):
        raise ValueError(f"a paged KV cache needs both {' and '.join(PAGED)}; got only "
                         f"{given[0]}")
    if rec.family != "exact":
        raise ValueError(f"a paged KV cache (block_table, cache_seqlens) is judged against "
                         f"paged_attention, exact softmax attention; got variant {rec.name!r}")
    return "paged_attention", paged_reference


def prepare(variant, q, k, v, *, layout=None, profile=None, params=None) -> Problem:
    """The problem of ``variant(q, k, v, **params)`` (or of the port ``profile``) as host
    arrays in arrayattn's layout: floating arrays in float64, masks and indices as they
    are; ``k``, ``v`` stay as they are when they are a paged cache."""
    params = dict(params or {})
    prof = None if profile is None else get_profile(profile)
    layout = (prof.layout if prof is not None else "bhnd") if layout is None else layout
    host = {"q": host64(q), "k": host64(k), "v": host64(v)}
    host.update({key: host64(val) if is_array(val) else val for key, val in params.items()})
    host = to_bhnd(host, layout, ("q",) if any(key in params for key in PAGED)
                   else ("q", "k", "v"))
    q64, k64, v64 = (host.pop(name) for name in ("q", "k", "v"))
    if prof is not None:
        prep = _profile_prepared(prof, variant, q64, k64, v64, host)
    elif variant is None:
        raise ValueError("variant is required unless a profile names it")
    else:
        prep = Prepared(variant, q64, k64, v64, host)
    name, reference = _reference_of(prep.variant, prep.options)
    return Problem(name, reference, prep.q, prep.k, prep.v, prep.options, layout,
                   None if prof is None else prof.name, prep.rows, list(prep.notes),
                   prep.lse_shift, prep.convert, tuple(prep.form_shifts))
