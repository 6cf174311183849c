"""Runs kernel attention on its inputs: checks, the working dtype, masked and non-finite
keys, the NumPy engine or the reference form (chosen once), the cast back (the gated
family's run: :mod:`._gated_run`)."""
from __future__ import annotations

import math

from . import reference
from ._engine import entry, numpy_engine
from ._linear_state import LinearAttentionState
from ._numpy import kernel as numpy_kernel
from ._validate import Problem, check_flag, check_qkv
from ._validate_linear import check_kernel_options, check_state

__all__ = ["run_kernel", "run_features"]


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
