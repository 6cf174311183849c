"""Runs kernel and gated attention on their inputs: checks, the working dtype, masked and
non-finite keys, the NumPy engine or the reference form (chosen once), the cast back."""
from __future__ import annotations

import math

from . import reference
from ._engine import entry, numpy_engine
from ._linear_state import LinearAttentionState
from ._numpy import kernel as numpy_kernel
from ._validate import Problem, check_flag, check_qkv
from ._validate_linear import check_kernel_options, check_state, checked_gated

__all__ = ["run_kernel", "run_features", "run_gated"]


def run_kernel(p: Problem, q, k, v, *, batch, causal, key_mask, method, chunk_size, eps,
               sz0=None, maps=None, engine_maps=None, m=None, normalize=True):
    """Kernel attention on validated inputs in the working dtype, NumPy engine or
    reference form (chosen once): ``(out in p.dtype, Sz (*batch, m, dv + 1))``.

    ``maps = (phi_q, phi_k)`` are applied to ``q`` and ``k`` (features when ``None``);
    ``engine_maps`` the same maps for the NumPy engine (default ``maps``); ``m`` is the
    feature width when known (sizes the engine's blocks).  Masked keys and
    values are zeroed once here (padding may hold NaN or inf).  ``s = 0``: zeros.
    ``normalize=False`` (the numerator alone) runs the reference form: the engine has no
    such path.
    """
    xp = p.xp
    query_map, key_map = (None, None) if maps is None else maps
    engine_q, engine_k = (query_map, key_map) if engine_maps is None else engine_maps
    m = q.shape[-1] if m is None else m
    with entry(xp):
        k, v = reference.zero_masked_keys(key_mask, k, v)
        # causal: a non-finite key or value reaches only the rows that see it
        bad = reference.nonfinite_rows(k, v) if causal else None
        k, v = (k, v) if bad is None else reference.drop_nonfinite(bad, k, v)
        if normalize and numpy_engine(xp, math.prod(batch) * (p.n + p.s) * max(m, p.dv + 1)
                                      * 4):
            out, sz = numpy_kernel.kernel_attention(
                v, query_features=numpy_kernel.rows_of(q, engine_q),
                key_features=numpy_kernel.rows_of(k, engine_k), n=p.n, s=p.s, batch=batch,
                causal=causal, key_mask=key_mask, method=method, chunk=chunk_size,
                sz0=sz0, eps=eps, m=m)
        else:
            pq = q if query_map is None else query_map(q)
            pk = k if key_map is None else key_map(k)
            out, sz = reference.kernel_attention(
                pq, pk, v, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, eps=eps, state=sz0, normalize=normalize)
    if bad is not None:
        out = reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))
        sz = xp.where(xp.any(bad, axis=-1)[..., None, None], xp.nan, sz)
    sz = xp.broadcast_to(sz, (*batch, *sz.shape[-2:]))
    return xp.astype(out, p.dtype, copy=False), sz


def run_features(phi_q, phi_k, v, *, causal, key_mask, eps, method, chunk_size,
                 return_state, state):
    """:func:`~arrayattn.feature_attention`: checked, continued from ``state``, run."""
    p = check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
    causal = check_flag("causal", causal)
    return_state = check_flag("return_state", return_state)
    chunk_size, method, eps = check_kernel_options(p, phi_q, key_mask, chunk_size, method,
                                                   eps)
    xp, wd, m = p.xp, p.work_dtype, p.d
    batch = p.batch if state is None else check_state(p, state, phi_q, m)
    sz0 = None
    if state is not None:
        sz0 = xp.concat([state.S, state.z[..., None]], axis=-1)
    pq, pk, wv = (xp.astype(x, wd, copy=False) for x in (phi_q, phi_k, v))
    out, sz = run_kernel(
        p, pq, pk, wv, batch=batch, causal=causal, key_mask=key_mask, method=method,
        chunk_size=chunk_size, eps=eps, sz0=sz0)
    if not return_state:
        return out
    num_tokens = p.s + (0 if state is None else state.num_tokens)
    return out, LinearAttentionState(sz[..., :-1], sz[..., -1], num_tokens,
                                     None if state is None else state.feature_map)


def run_gated(q, k, v, g, beta, *, causal, key_mask, method, chunk_size, scale,
              initial_state, return_state, normalize_qk=False):
    """Gated (``beta=None``) or delta-rule attention with log gates ``g`` and writing
    strengths ``beta`` (both checked by the caller): validate, mask, dispatch once to the
    recurrence or the chunked form, cast back."""
    p, method, chunk_size, return_state, s0, _ = checked_gated(
        q, k, v, causal=causal, key_mask=key_mask, method=method, chunk_size=chunk_size,
        scale=scale, initial_state=initial_state, return_state=return_state)
    xp, wd = p.xp, p.work_dtype
    wq, wk, wv = (xp.astype(x, wd, copy=False) for x in (q, k, v))
    if normalize_qk:      # fla's use_qk_l2norm: unit q and k (a zero row stays zero)
        wq, wk = (reference.unit_rows(x)[0] for x in (wq, wk))
    if scale is not None:
        wq = wq * float(scale)
    # A gate outside (0, 1] (g > 0, or NaN) makes the outputs from there on NaN:
    # checking it would read the device.
    g = xp.where(g <= 0.0, g, xp.nan)
    if key_mask is not None:   # a padded token leaves the state as it is
        wk, wv = reference.zero_masked_keys(key_mask, wk, wv)
        g = xp.where(key_mask[..., None], g, 0.0)
        beta = None if beta is None else xp.where(key_mask, beta, 0.0)
    # a non-finite key, value or beta, or a NaN gate, reaches only the rows from its
    # token on (-inf gates are restarts, not faults)
    bad = reference.nonfinite_rows(wk, wv) | xp.any(xp.isnan(g), axis=-1)
    if beta is not None:
        bad = bad | ~xp.isfinite(beta)
        beta = xp.where(bad, 0.0, beta)
    wk, wv = reference.drop_nonfinite(bad, wk, wv)
    g = xp.where(bad[..., None], 0.0, g)
    if p.n == 0:
        out, s = p.zeros(), s0
    else:
        with entry(xp):
            if beta is None and method == "recurrent":
                out, s = reference.gla_recurrent(wq, wk, wv, g, s0)
            elif beta is None:
                out, s = reference.gla_chunked(wq, wk, wv, g, s0, chunk_size)
            elif method == "recurrent":
                out, s = reference.delta_recurrent(wq, wk, wv, beta, g, s0)
            else:
                out, s = reference.delta_chunked(wq, wk, wv, beta, g, s0, chunk_size)
        out = reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))
        out = xp.astype(xp.broadcast_to(out, p.out_shape), p.dtype, copy=False)
        s = xp.where(xp.any(bad, axis=-1)[..., None, None], xp.nan, s)
    s = xp.broadcast_to(s, (*p.batch, p.d, p.dv))
    return (out, xp.astype(s, p.dtype, copy=False)) if return_state else out
