"""The pipeline specs of kernel attention (:func:`~arrayattn.linear_attention`,
:func:`~arrayattn.feature_attention`, :func:`~arrayattn.efficient_attention`): their
reference forms, NumPy engine and work estimates; and the runner of gated attention."""
from __future__ import annotations

import math

from . import reference
from ._engine import entry
from ._linear_state import LinearAttentionState
from ._numpy import kernel as numpy_kernel
from ._validate_kernel import KernelCall, check_efficient, check_features, check_linear
from ._validate_linear import checked_gated
from .feature_maps import FEATURE_MAPS
from .pipeline import Spec, Working, run

__all__ = ["LINEAR_SPEC", "FEATURES_SPEC", "EFFICIENT_SPEC", "kernel_reference",
           "kernel_engine", "kernel_work", "efficient_reference", "run_features", "run_gated"]


def _state_in(call: KernelCall):
    """``Sz = [S, z] (..., m, dv + 1)`` of the keys summed earlier, or ``None``."""
    st = call.state
    return None if st is None else call.p.xp.concat([st.S, st.z[..., None]], axis=-1)


def _finish(call: KernelCall, w: Working, out, sz):
    """Causal: the rows that see a key taken out for holding a non-finite value, and the
    state after it, become NaN; then the output, or ``(out, state)``."""
    p, xp = call.p, call.p.xp
    if w.bad is not None:
        out = reference.poison_rows(out, reference.seen_by_prefix(w.bad, p.n))
        sz = xp.where(xp.any(w.bad, axis=-1)[..., None, None], xp.nan, sz)
    if not call.return_state:
        return out
    sz = xp.broadcast_to(sz, (*p.batch, *sz.shape[-2:]))
    tokens = p.s + (0 if call.state is None else call.state.num_tokens)
    return out, LinearAttentionState(sz[..., :-1], sz[..., -1], tokens, call.feature_map)


def kernel_reference(call: KernelCall, w: Working):
    """The reference form: ``phi_q(Q) (phi_k(K)^T [V, 1])``, the causal form chosen by
    ``call.method`` (:func:`arrayattn.reference.kernel_attention`)."""
    query_map, key_map = call.maps or (None, None)
    phi_q = w.q if query_map is None else query_map(w.q)
    phi_k = w.k if key_map is None else key_map(w.k)
    out, sz = reference.kernel_attention(
        phi_q, phi_k, w.v, causal=call.causal, key_mask=call.key_mask, method=call.method,
        chunk_size=call.chunk_size, eps=call.eps, state=_state_in(call),
        normalize=call.normalize)
    return _finish(call, w, out, sz)


def kernel_engine(call: KernelCall, w: Working):
    """The NumPy engine (:func:`arrayattn._numpy.kernel.kernel_attention`): the maps
    applied per row block (elu+1 in place: one temporary less)."""
    p = call.p
    maps = call.maps or (None, None)
    if call.maps is not None and call.feature_map is FEATURE_MAPS["elu+1"]:
        maps = (numpy_kernel.elu_plus_one_,) * 2
    out, sz = numpy_kernel.kernel_attention(
        w.v, query_features=numpy_kernel.rows_of(w.q, maps[0]),
        key_features=numpy_kernel.rows_of(w.k, maps[1]), n=p.n, s=p.s, batch=p.batch,
        causal=call.causal, key_mask=call.key_mask, method=call.method,
        chunk=call.chunk_size, sz0=_state_in(call), eps=call.eps, m=call.m)
    return _finish(call, w, out, sz)


def kernel_work(call: KernelCall, w: Working):
    """Bytes of the engine's largest temporary (features and values of every token);
    ``None`` for the numerator alone (``normalize=False``: no engine path)."""
    p = call.p
    if not call.normalize:
        return None
    return math.prod(p.batch) * (p.n + p.s) * max(call.m, p.dv + 1) * 4


_KERNEL_NONE = {"key_mask": "every key is real",
                "eps": "the smallest normal number of the working dtype",
                "method": "chunked"}

#: The pipeline of :func:`~arrayattn.linear_attention`.
LINEAR_SPEC = Spec(name="linear_attention", check=check_linear, reference=kernel_reference,
                   engine=kernel_engine, work=kernel_work, poison=lambda call: call.causal,
                   none_means=_KERNEL_NONE)

#: The pipeline of :func:`~arrayattn.feature_attention` (and its decoding step).
FEATURES_SPEC = Spec(name="feature_attention", check=check_features,
                     reference=kernel_reference, engine=kernel_engine, work=kernel_work,
                     poison=lambda call: call.causal,
                     none_means={**_KERNEL_NONE, "state": "no earlier keys"})

def efficient_reference(call, w: Working):
    """Efficient attention's reference form ``softmax_d(Q) (softmax_s(K)^T V)``: on every
    backend (it is three products)."""
    return reference.efficient_attention(w.q, w.k, w.v, key_mask=call.key_mask)


#: The pipeline of :func:`~arrayattn.efficient_attention`.
EFFICIENT_SPEC = Spec(name="efficient_attention", check=check_efficient,
                      reference=efficient_reference, none_means={"key_mask": "every key is real"})


def run_features(phi_q, phi_k, v, /, **options):
    """:func:`~arrayattn.feature_attention`'s pipeline (its decoding step runs it)."""
    return run(FEATURES_SPEC, phi_q, phi_k, v, **options)


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
