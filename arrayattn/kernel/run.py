"""The pipeline specs of kernel attention (:func:`~arrayattn.linear_attention`,
:func:`~arrayattn.feature_attention`, :func:`~arrayattn.efficient_attention`): their
reference forms, NumPy engine and work estimates (the gated family's: :mod:`arrayattn.gated.run`)."""
from __future__ import annotations

import math

from .. import reference
from .state import LinearAttentionState
from .._numpy import kernel as numpy_kernel
from .calls import KernelCall, check_efficient, check_features, check_linear
from .feature_maps import FEATURE_MAPS
from ..core.pipeline import Spec, Working, run

__all__ = ["LINEAR_SPEC", "FEATURES_SPEC", "EFFICIENT_SPEC", "kernel_reference",
           "kernel_engine", "kernel_work", "efficient_reference", "run_features"]


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


#: The built-in maps' engine forms: the same values, written into the engine's workspace
#: (elu+1 with one temporary less).
_ENGINE_MAPS = {"elu+1": numpy_kernel.elu_plus_one_, "relu": numpy_kernel.relu_,
                "cosine": numpy_kernel.cosine_}


def kernel_engine(call: KernelCall, w: Working):
    """The NumPy engine (:func:`arrayattn._numpy.kernel.kernel_attention`): the maps
    applied per row block (the built-in ones into the engine's workspace)."""
    p = call.p
    maps, into = call.maps or (None, None), False
    for name, engine_map in _ENGINE_MAPS.items():
        if call.maps is not None and call.feature_map is FEATURE_MAPS[name]:
            maps, into = (engine_map,) * 2, True
    out, sz = numpy_kernel.kernel_attention(
        w.v, query_features=numpy_kernel.rows_of(w.q, maps[0], into=into),
        key_features=numpy_kernel.rows_of(w.k, maps[1], into=into), n=p.n, s=p.s,
        batch=p.batch,
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
