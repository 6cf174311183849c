"""The gated family's steps of the pipeline (:mod:`arrayattn.core.pipeline`): from a checked
:class:`~arrayattn.gated.checks.GatedCall` and the working ``q, k, v`` to the
recurrence or the chunked form, with the family's rules for masked and non-finite
tokens."""
from __future__ import annotations

import math
from dataclasses import replace

from .. import reference
from .._numpy import delta as engine_delta
from .._numpy import rows as engine_rows
from .checks import GatedCall, checked_gated
from ..core.pipeline import (Spec, Working, engine_pays, finite_on_host, nan_free_on_host,
                             run)

__all__ = ["gated_reference", "gated_engine", "gated_work", "gated_empty", "prepared",
           "run_gated", "STEP_SPEC"]


def prepared(call: GatedCall, w: Working) -> tuple:
    """``(q, k, v, g, beta, bad)`` as the forms take them: ``q, k`` unit rows with
    ``normalize_qk``, ``q`` scaled, a gate outside ``(0, 1]`` (``g > 0`` or NaN) turned
    into NaN (checking it would read the device), a padded token's gate 1 and ``beta`` 0
    (it leaves the state as it is), and the tokens ``bad (..., n)`` holding a non-finite
    key, value or ``beta`` or a NaN gate taken out (``-inf`` gates are restarts, not
    faults); the rows from a bad token on are NaN.  ``bad`` is ``None`` where a cheap
    NumPy host pass (:func:`~arrayattn.core.pipeline.finite_on_host`) finds no such
    token: then nothing is taken out or poisoned."""
    xp, key_mask, beta = call.p.xp, call.key_mask, call.beta
    wq, wk, wv = w.q, w.k, w.v           # masked keys already zeroed (pipeline.working)
    if call.normalize_qk:      # fla's use_qk_l2norm: unit q and k (a zero row stays zero)
        wq, wk = (_unit_rows(xp, x) for x in (wq, wk))
    if call.scale is not None:
        wq = wq * call.scale
    g = xp.where(call.g <= 0.0, call.g, xp.nan)
    if key_mask is not None:
        g = xp.where(key_mask[..., None], g, 0.0)
        beta = None if beta is None else xp.where(key_mask, beta, 0.0)
    if finite_on_host(xp, wk, wv, beta) and nan_free_on_host(xp, g):
        return wq, wk, wv, g, beta, None         # NumPy, nothing to take out (issue #39)
    bad = reference.nonfinite_rows(wk, wv) | reference.nan_over(g, (-1,))
    if beta is not None:
        bad = bad | ~xp.isfinite(beta)
        beta = xp.where(bad, 0.0, beta)
    wk, wv = reference.drop_nonfinite(bad, wk, wv)
    return wq, wk, wv, xp.where(bad[..., None], 0.0, g), beta, bad


def _unit_rows(xp, x):
    """``x / ||x||`` row by row: the NumPy engine's (:mod:`arrayattn._numpy.rows`) where it
    may run, else the reference form's."""
    if not engine_pays(xp, None):
        return reference.unit_rows(x)[0]
    return engine_rows.unit_rows(x)


def _result(call: GatedCall, out, s):
    """``out``, or ``(out, S_n)`` with ``return_state``: the state broadcast to the batch
    in the caller's dtype (the pipeline casts ``out``)."""
    if not call.return_state:
        return out
    p = call.p
    s = p.xp.broadcast_to(s, (*p.batch, p.d, p.dv))
    return out, p.xp.astype(s, p.dtype, copy=False)


def gated_reference(call: GatedCall, w: Working):
    """The reference form: GLA's recurrence or chunked form (``beta`` None: retention,
    GLA, SSD) or the delta rule's (DeltaNet, gated DeltaNet).

    On concrete JAX arrays (not inside the caller's ``jax.jit``) it runs as one
    ``jax.jit`` program, compiled once per shapes and options (:func:`_on_jax`): run
    eagerly, JAX compiled every one of the form's few hundred operations for each new
    shape, and a prompt split in two (a call, then a call from its final state) took
    5-7 s per call on a 2-core CPU."""
    if _eager_jax(call.p.xp, w.q):
        return _on_jax(call, w)
    return _reference(call, w)


#: The :class:`GatedCall` fields that are arrays (the arguments of the JAX program; the
#: rest, hashable, are its static part).
_CALL_ARRAYS = ("key_mask", "g", "beta", "initial_state")
_JITTED = []


def _eager_jax(xp, x) -> bool:
    """Whether ``x`` is a concrete JAX array (a tracer is inside a trace already)."""
    import array_api_compat
    if not array_api_compat.is_jax_namespace(xp):
        return False
    import jax
    return not isinstance(x, jax.core.Tracer)


def _on_jax(call: GatedCall, w: Working):
    """:func:`_reference` as one ``jax.jit`` program (cached by JAX per shapes, dtypes
    and the call's static options)."""
    if not _JITTED:
        import jax

        def traced(static, arrays, w):
            return _reference(replace(static, **arrays), w)
        _JITTED.append(jax.jit(traced, static_argnums=0))
    arrays = {name: getattr(call, name) for name in _CALL_ARRAYS}
    return _JITTED[0](replace(call, **dict.fromkeys(_CALL_ARRAYS)), arrays, w)


def _reference(call: GatedCall, w: Working):
    """:func:`gated_reference`'s maths."""
    p, xp, s0 = call.p, call.p.xp, call.initial_state
    wq, wk, wv, g, beta, bad = prepared(call, w)
    if beta is None and call.method == "recurrent":
        out, s = reference.gla_recurrent(wq, wk, wv, g, s0)
    elif beta is None:
        out, s = reference.gla_chunked(wq, wk, wv, g, s0, call.chunk_size)
    elif call.method == "recurrent":
        out, s = reference.delta_recurrent(wq, wk, wv, beta, g, s0)
    else:
        out, s = reference.delta_chunked(wq, wk, wv, beta, g, s0, call.chunk_size)
    return _poisoned(call, out, s, bad)


def _poisoned(call: GatedCall, out, s, bad):
    """The rows from a token taken out on (``bad``), and the final state after it, NaN;
    then :func:`_result`."""
    p, xp = call.p, call.p.xp
    if bad is not None:
        out = reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))
        s = xp.where(xp.any(bad, axis=-1)[..., None, None], xp.nan, s)
    return _result(call, xp.broadcast_to(out, p.out_shape), s)


def gated_engine(call: GatedCall, w: Working):
    """The NumPy engine of the chunked delta rule (:mod:`arrayattn._numpy.delta`) on the
    :func:`prepared` inputs, with the reference's rules for non-finite tokens."""
    wq, wk, wv, g, beta, bad = prepared(call, w)
    out, s = engine_delta.delta_chunked(wq, wk, wv, beta, g, call.initial_state,
                                        call.chunk_size)
    return _poisoned(call, out, s, bad)


def gated_work(call: GatedCall, w: Working):
    """Bytes of the delta engine's largest temporary (the stacked ``w`` and scaled
    queries, ``(..., n, 2 dk)``); ``None`` where it has no path: the gated (GLA) family
    and the recurrent forms run the reference form."""
    if call.beta is None or call.method == "recurrent":
        return None
    p = call.p
    return 8 * math.prod(p.batch) * p.n * p.d


def gated_empty(call: GatedCall):
    """No token (or no batch element): zeros, and ``S_0`` as the final state."""
    return _result(call, call.p.zeros(), call.initial_state)


#: One decoding step (:func:`~arrayattn.gated_attention_step`) and any caller whose gates
#: are checked already: :func:`run_gated`.
STEP_SPEC = Spec(name="gated_attention_step", check=checked_gated, reference=gated_reference,
                 engine=gated_engine, work=gated_work, empty=gated_empty,
                 none_means={"key_mask": "every token is real",
                             "scale": "no scale (q as given)",
                             "initial_state": "zeros", "gate": "no decay (g = 0)",
                             "beta": "the additive (gated) update"})


def run_gated(q, k, v, g, beta, *, causal, key_mask, method, chunk_size, scale,
              initial_state, return_state, normalize_qk=False):
    """Gated (``beta=None``) or delta-rule attention with log gates ``g (..., n, 1 | dk)``
    and writing strengths ``beta (..., n)``, both checked by the caller and in the
    working dtype: the pipeline's :data:`STEP_SPEC`."""
    return run(STEP_SPEC, q, k, v, gate=g, beta=beta, causal=causal, key_mask=key_mask,
               method=method, chunk_size=chunk_size, scale=scale,
               initial_state=initial_state, return_state=return_state,
               normalize_qk=normalize_qk)
