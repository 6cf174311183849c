"""How the report calls a variant on a backend: one prepared call per variant (``jax.jit``
on JAX, compiled ahead for every input shape), timed calls with the peak memory of one,
and the implied attention matrix of the first head read through the prepared call."""
from __future__ import annotations

import math
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..core.xp import to_numpy
from ..registry.variant import Variant
from ..registry import attention_matrix, jit_uniform

__all__ = ["on_host", "Compiled", "Executables", "implied_matrix", "compiles", "timed",
           "CPU_COMPILER_OPTIONS"]

#: XLA options of the report's programs on a CPU: LLVM at XLA's backend optimisation
#: level 1 instead of the default 2 compiles them about a quarter faster, and they give
#: the same outputs at the same speed (``benchmarks/report_xla_level.py``).  The report
#: calls each program about a dozen times, so its compile time is most of its own.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def on_host(x):
    """``x`` as a host float64 NumPy array."""
    return np.asarray(to_numpy(x), dtype=np.float64)


class Compiled:
    """One prepared call per variant (``jax.jit`` on JAX, through
    :class:`~arrayattn.registry.jit_uniform`: what the call draws is an argument, not a
    constant), kept for the whole report: JAX compiles it once per input shape, however
    many cases and calls use it (on a CPU with :data:`CPU_COMPILER_OPTIONS`)."""

    def __init__(self, be):
        self.be, self.calls = be, {}
        #: whether each variant's heads are alike (:func:`implied_matrix`), by name
        self.alike = {}
        self.compiles = compiles(be)
        self.options = CPU_COMPILER_OPTIONS if self.compiles and be.device == "cpu" else {}

    def __call__(self, rec):
        if rec.name not in self.calls:
            call = jit_uniform(rec, self.be.compile)
            self.calls[rec.name] = Executables(call, self.options) if self.compiles else call
        return self.calls[rec.name]

    def ahead(self, recs, inputs, workers: int = 2):
        """Compile every variant of ``recs`` for every input triple of ``inputs`` before
        anything is timed, ``workers`` programs at a time (XLA compiles outside Python's
        lock, so one program traces while another compiles); the timed calls then find
        them compiled (:class:`Executables`).  A variant that fails here fails again in its row,
        where the error is reported."""
        if not self.compiles:
            return
        jobs = [(self(rec), args) for rec in recs for args in inputs]

        def compile_one(job):
            call, args = job
            try:
                call.compiled(*args)
            except Exception:  # reported by the row's own call
                pass

        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(compile_one, jobs))


class Executables:
    """A :class:`~arrayattn.registry.jit_uniform` call compiled with XLA ``options``, once
    per shapes and dtypes of ``q, k, v`` (``jax.jit``'s own cache would compile it with
    XLA's defaults); an XLA that does not know an option compiles with its defaults."""

    def __init__(self, call: jit_uniform, options: dict):
        self.call, self.options, self.programs = call, dict(options), {}

    def compiled(self, q, k, v):
        """The executable for these shapes (compiled on first use)."""
        key = tuple((tuple(x.shape), str(x.dtype)) for x in (q, k, v))
        if key not in self.programs:
            lowered = self.call.lower(q, k, v)
            try:
                program = lowered.compile(compiler_options=self.options or None)
            except Exception as exc:
                if "compile option" not in str(exc):    # not an option this XLA lacks
                    raise
                program = lowered.compile()
            self.programs[key] = program
        return self.programs[key]

    def __call__(self, q, k, v):
        return self.compiled(q, k, v)(q, k, v, self.call.drawn(q))


def implied_matrix(be, call, hq, hk, v_shape, dtype, alike=None):
    """The first head's implied matrix ``(1, 1, n, s)`` from the host ``hq, hk``, and
    whether the variant's heads are alike (``None`` where that was not needed).

    Where calls are compiled (JAX), through the variant's compiled call on ``v``'s shape
    -- no program of another shape to compile: the first head's ``q, k`` in every head
    slot, each slot carrying its own block of the identity's columns, so that one call
    gives ``slots x dv`` columns.  A variant whose heads are not alike (per-head decays,
    gates drawn per head) answers differently in its slots, and then each call gives slot
    0's ``dv`` columns.  ``alike=None`` finds out with a first call that carries block 0
    in every slot; pass what an earlier case found to save it.  Elsewhere one call on
    ``I_s``."""
    if not compiles(be):
        return on_host(attention_matrix(call, be.asarray(hq[:1, :1], dtype),
                                        be.asarray(hk[:1, :1], dtype))), None
    s, dv, n = v_shape[-2], v_shape[-1], hq.shape[-2]
    slots = math.prod(v_shape[:-2])
    q0, k0 = (be.asarray(np.broadcast_to(x[:1, :1], x.shape), dtype) for x in (hq, hk))
    eye = np.eye(s)

    def columns(starts):
        block = np.zeros((slots, s, dv))
        for slot, j0 in enumerate(starts):
            block[slot, :, :min(dv, s - j0)] = eye[:, j0:j0 + dv]
        out = call(q0, k0, be.asarray(np.reshape(block, v_shape), dtype))
        return np.reshape(on_host(out), (slots, n, dv))

    cols, rest = {}, list(range(0, s, dv))
    if alike is None:
        first = columns([0] * slots)
        alike = bool(np.allclose(first, first[:1], rtol=1e-4,
                                 atol=1e-6 * np.abs(first[0]).max()))
        cols, rest = {0: first[0]}, rest[1:]
    step = slots if alike else 1
    for c0 in range(0, len(rest), step):
        starts = rest[c0:c0 + step]
        out = columns(starts + [0] * (slots - len(starts)) if alike else starts * slots)
        cols.update({j0: out[slot] for slot, j0 in enumerate(starts)})
    a = np.concatenate([cols[j0][:, :min(dv, s - j0)] for j0 in sorted(cols)], axis=-1)
    return a[None, None], alike


def _identity(fn):
    return fn


def compiles(be) -> bool:
    """Whether the backend compiles its timed calls (``jax.jit``)."""
    return be.compile(_identity) is not _identity


def timed(be, call, q, k, v, repeats):
    """Warm-up call (peak memory measured on it; on JAX it compiles ``call`` for these
    shapes unless an earlier call did), then ``repeats`` timed calls.  ``call``: a
    prepared call, or a registry record (prepared here)."""
    if isinstance(call, Variant):
        call = Compiled(be)(call)
    traced = be.memory == "tracemalloc"
    if traced:
        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
    be.reset_peak()
    try:
        out = call(q, k, v)
        be.sync(out)
    finally:
        if traced:
            peak = tracemalloc.get_traced_memory()[1] - base
            if not was_tracing:
                tracemalloc.stop()
    if not traced:
        peak = be.peak_bytes()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = call(q, k, v)
        be.sync(res)
        times.append(time.perf_counter() - t0)
    return out, times, peak
