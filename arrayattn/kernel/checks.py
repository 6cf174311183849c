"""Validation of kernel and random-feature attention: their option values, feature maps,
decoding states and projections (the gated family's: :mod:`arrayattn.gated.checks`).

Every error names the argument and what is wrong with it, as in :mod:`arrayattn.core.checks`.
"""
from __future__ import annotations

import math

import numpy as np

from .state import LinearAttentionState
from ..core.checks import (Problem, broadcast_batch, check_array, check_choice, check_key_mask,
                           check_positive_int, check_same_array_kind, check_seed)

__all__ = ["CAUSAL_METHODS", "PROJECTIONS", "NORMS", "MAX_OMEGA_BYTES",
           "check_eps", "check_kernel_options", "checked_maps", "check_state",
           "check_draw", "check_omega", "check_gerf_a"]

#: The causal forms of kernel attention (equal to rounding).
CAUSAL_METHODS = ("recurrent", "cumsum", "chunked")
#: How a random projection is drawn, and its row lengths.
PROJECTIONS = ("iid", "orthogonal", "identity")
NORMS = ("chi", "fixed", "quasi")
#: The largest projection drawn on the host (``m * d`` float64 values): more is a typo (an
#: orthogonal draw of ``num_features=10**12`` would loop over ~1e10 QR blocks).
MAX_OMEGA_BYTES = 1 << 33


# ---------------------------------------------------------------------------------------
# Kernel attention
# ---------------------------------------------------------------------------------------

def check_eps(eps, xp, wd) -> float:
    """``eps`` as a float; ``None`` is the smallest positive normal number of ``wd``."""
    if eps is None:
        return float(xp.finfo(wd).smallest_normal)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0 or None; got {eps!r}")
    return float(eps)


def check_kernel_options(p: Problem, ref, key_mask, chunk_size, method, eps):
    """The options :func:`feature_attention` and :func:`linear_attention` share, checked:
    ``(chunk_size, method, eps)`` with ``method=None`` -> ``"chunked"`` and ``eps`` a float."""
    check_key_mask(p, key_mask, ref)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    method = "chunked" if method is None else check_choice("method", method,
                                                           CAUSAL_METHODS)
    return chunk_size, method, check_eps(eps, p.xp, p.work_dtype)


def checked_maps(fm, ref) -> tuple:
    """The query and key maps of ``fm`` with their outputs checked: arrays of ``ref``'s
    library, the rows and dtype kept, one width for both (a map returning something
    else fails here, by name, not deep inside a product)."""
    widths: dict = {}

    def checked(f, which):
        def phi(x):
            out = f(x)
            name = f"feature_map's {which} map output"
            check_array(name, out, min_ndim=1)
            check_same_array_kind(None, which + "s", ref, name, out)
            if out.ndim != x.ndim or tuple(out.shape[:-1]) != tuple(x.shape[:-1]):
                raise ValueError(
                    f"feature_map's {which} map turned {which}s of shape {tuple(x.shape)} "
                    f"into {tuple(out.shape)}; a map must act on the last axis only")
            if out.dtype != x.dtype:
                raise TypeError(f"feature_map's {which} map returned dtype {out.dtype} "
                                f"for {which}s of dtype {x.dtype}")
            widths[which] = out.shape[-1]
            if widths.get("query", out.shape[-1]) != widths.get("key", out.shape[-1]):
                raise ValueError(
                    f"phi_k has d={widths['key']} but phi_q has d={widths['query']}: the "
                    "feature map must give queries and keys the same number of features")
            return out
        return phi
    return checked(fm.query, "query"), checked(fm.key, "key")


def check_state(p: Problem, state, ref, m: int) -> tuple:
    """Validate a state against features of dimension ``m``; returns the batch shape."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a LinearAttentionState; got {type(state).__name__}")
    check_same_array_kind(p.xp, "phi_q", ref, "state.S", state.S)
    if tuple(state.S.shape[-2:]) != (m, p.dv) or tuple(state.z.shape) != (
            *state.S.shape[:-1],):
        raise ValueError(
            f"state has S {tuple(state.S.shape)} and z {tuple(state.z.shape)}, but the "
            f"inputs need S (..., m, dv) = (..., {m}, {p.dv}) and z (..., {m})"
        )
    if state.S.dtype != p.work_dtype or state.z.dtype != p.work_dtype:
        raise TypeError(
            f"state is in {state.S.dtype} but inputs of dtype {p.dtype} are computed in "
            f"{p.work_dtype}; make the state with that dtype"
        )
    return broadcast_batch([("inputs", p.batch), ("state", tuple(state.S.shape[:-2]))])


# ---------------------------------------------------------------------------------------
# Random features
# ---------------------------------------------------------------------------------------

def check_draw(d, m, projection, norms, seed) -> tuple:
    """The arguments of :meth:`RandomFeatures.draw`, checked: ``(d, m, seed)``."""
    d = check_positive_int("d", d)
    m = check_positive_int("m", m)
    check_choice("projection", projection, PROJECTIONS)
    check_choice("norms", norms, NORMS)
    seed = check_seed(seed)
    if m * d * 8 > MAX_OMEGA_BYTES:
        raise ValueError(
            f"num_features (m) = {m} rows of d = {d} need a {m * d * 8 / 2**30:.3g} GiB "
            f"float64 host matrix (m, d); the limit is {MAX_OMEGA_BYTES / 2**30:g} GiB "
            f"(MAX_OMEGA_BYTES): use fewer features")
    if projection == "identity" and m != d:
        raise ValueError(f"projection='identity' (no random projection) has m = d = "
                         f"{d} rows; got m={m}")
    return d, m, seed


def check_omega(host):
    """A caller's projection matrix on the host: real, 2-D ``(m, d)``, non-empty and
    finite; returned as a new float64 array."""
    if np.iscomplexobj(host) or not (np.issubdtype(host.dtype, np.floating)
                                     or np.issubdtype(host.dtype, np.integer)):
        raise TypeError(f"omega must be a real matrix; got dtype {host.dtype}")
    host = np.array(host, dtype=np.float64, copy=True)
    if host.ndim != 2 or host.shape[0] < 1 or host.shape[1] < 1:
        raise ValueError(
            f"omega must be a non-empty 2-D matrix (m, d); got shape {host.shape}")
    if not np.isfinite(host).all():
        raise ValueError("omega contains non-finite values")
    return host


def check_gerf_a(xp, kind, gerf_a, *, work_dtype, causal=False):
    """FAVOR++'s ``gerf_a``: a float ``< 1/8`` or an array ``(..., 1, 1)`` in
    ``work_dtype``; ``None`` for other kinds and for the inputs' optimal ``A*``
    (non-causal only: it depends on every key)."""
    if kind != "favor++":
        if gerf_a is not None:
            raise ValueError(f"gerf_a is only used with kind='favor++'; got kind={kind!r}")
        return None
    if gerf_a is None:
        if causal:
            raise ValueError(
                "kind='favor++' cannot be causal with the data-dependent optimal A*: it "
                "averages over every key, so a future key would change past outputs; pass "
                "a fixed gerf_a= (e.g. from gerf_parameter on a calibration batch)")
        return None
    if isinstance(gerf_a, (int, float)) and not isinstance(gerf_a, bool):
        if not gerf_a < 0.125:
            raise ValueError(f"gerf_a must be < 1/8 (finite variance); got {gerf_a}")
        return float(gerf_a)
    arr = xp.astype(gerf_a, work_dtype)
    if arr.ndim < 2 or tuple(arr.shape[-2:]) != (1, 1):
        raise ValueError(f"gerf_a must be a float or an array (..., 1, 1); got shape "
                         f"{tuple(arr.shape)}")
    return arr
