"""asv benchmarks: every registered variant on the NumPy engine, through public API only.

The suite runs against any revision that asv builds (``asv continuous -f 1.05 BASE HEAD``),
so it touches only what both the base ``e6332e9`` and today's tree have:
``arrayattn.variants()``, ``arrayattn.get_variant(name)``, ``rec(q, k, v, **opts)`` and
``rec.causal``; ``arrayattn.vjp`` and ``arrayattn.jit_uniform`` are used where they exist
(a revision without them reports those benchmarks as skipped, asv's ``n/a``).

The parameter lists are the registry of the revision asv discovers the suite on; a
variant that the other revision lacks is skipped there (``NotImplementedError`` in
``setup``), and so is ``causal=True`` for a variant whose record has ``causal=False``.

Inputs: ``(1, 8, n, 64)`` float32 standard normal, seed 0, made in ``setup`` (not timed).

Cost of a full run on the 2-core machine, estimated from benchmarks/README.md's table
(1 head) times 8 heads: one sweep of single forward calls at n = 16384 takes about 2.5
min plain and 2 min causal (strided, fixed, softmax and softmax_blockwise are 80% of it);
each case costs about max(2 calls, 6 s) per round and asv runs 2 rounds, so the forward
at 16384 is about 15-20 min per revision, n = 4096 about 5, peakmem 3, vjp (1 round)
5-10 and the JAX tracks (a fresh process, import and compile per variant) 8-10: about
40 min per revision, 1 h 20 min for ``asv continuous`` of the whole suite.  The forward
alone (``--bench Forward.time``), the issue's table, is about half of that.
"""
from __future__ import annotations

import os
import time

import numpy as np

import arrayattn

HEADS = 8
HEAD_DIM = 64
SEED = 0

#: every variant registered in the revision the suite is discovered on
NAMES = [rec.name for rec in arrayattn.variants()]


def _inputs(n: int, count: int = 3):
    rng = np.random.default_rng(SEED)
    return tuple(rng.standard_normal((1, HEADS, n, HEAD_DIM), dtype=np.float32)
                 for _ in range(count))


def _record(name: str, causal: bool = False):
    """The registry record, or ``NotImplementedError`` (asv: skipped) where this revision
    lacks the variant or its causal form."""
    if name not in {rec.name for rec in arrayattn.variants()}:
        raise NotImplementedError(f"{name!r} is not registered in this revision")
    rec = arrayattn.get_variant(name)
    if causal and not getattr(rec, "causal", False):
        raise NotImplementedError(f"{name!r} has no causal form")
    return rec


class _Timed:
    # One call of the biggest case takes up to ~40 s (strided at n = 16384, 8 heads):
    # number=0 lets asv calibrate (1 for any call over 10 ms; that calibration call is
    # the warm-up) and repeat=(1, 5, 6.0) takes 1 to 5 samples, none started after 6 s
    # (so a case costs about max(2 calls, 6 s), at most 6 calls, per round).
    number = 0
    repeat = (1, 5, 6.0)
    warmup_time = 0.0
    timeout = 900.0


class Forward(_Timed):
    """The uniform call ``rec(q, k, v)`` (plain) and ``rec(q, k, v, causal=True)``."""

    params = (NAMES, [4096, 16384], [False, True])
    param_names = ["variant", "n", "causal"]

    def setup(self, name, n, causal):
        self.rec = _record(name, causal)
        self.opts = {"causal": True} if causal else {}
        self.q, self.k, self.v = _inputs(n)

    def time_forward(self, name, n, causal):
        self.rec(self.q, self.k, self.v, **self.opts)


class ForwardMemory:
    """Peak resident memory of the process around one forward at n = 4096 (asv's
    ``peakmem_``: includes the interpreter, NumPy and the 25 MB of inputs)."""

    params = (NAMES, [False, True])
    param_names = ["variant", "causal"]
    timeout = 300.0

    def setup(self, name, causal):
        self.rec = _record(name, causal)
        self.opts = {"causal": True} if causal else {}
        self.q, self.k, self.v = _inputs(4096)

    def peakmem_forward_4096(self, name, causal):
        self.rec(self.q, self.k, self.v, **self.opts)


class VJP(_Timed):
    """``arrayattn.vjp(name, q, k, v, do)`` (revisions that have it): every cotangent.
    One asv round and at most 3 s of samples per case: e6332e9 has no ``vjp``, so these
    compare only between later revisions."""

    repeat = (1, 3, 3.0)
    rounds = 1

    params = (NAMES, [1024, 4096], [False, True])
    param_names = ["variant", "n", "causal"]

    def setup(self, name, n, causal):
        if not hasattr(arrayattn, "vjp"):
            raise NotImplementedError("arrayattn.vjp is not in this revision")
        _record(name, causal)
        self.name = name
        self.opts = {"causal": True} if causal else {}
        self.q, self.k, self.v, self.do = _inputs(n, 4)

    def time_vjp(self, name, n, causal):
        arrayattn.vjp(self.name, self.q, self.k, self.v, self.do, **self.opts)


class _JaxCompileBase:
    """Seconds to lower and compile the uniform call at n = 1024 with JAX on the CPU
    (a fresh process per variant, so JAX's in-memory caches are cold; the persistent
    compilation cache is off unless the environment turns it on).

    ``track_jax_compile_uniform``: ``arrayattn.jit_uniform(rec)`` (the gates drawn on the
    host, outside the program), skipped where the revision lacks it.
    ``track_jax_compile_jit``: ``jax.jit(lambda q, k, v: rec(q, k, v))``, in every
    revision (the comparable figure across e6332e9).
    """

    params = (NAMES,)
    param_names = ["variant"]
    unit = "seconds"
    timeout = 600.0
    n = 1024

    def setup(self, name):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        try:
            import jax
        except ImportError as exc:  # an environment without jax
            raise NotImplementedError(str(exc)) from exc
        self.jax = jax
        self.rec = _record(name)
        self.args = tuple(jax.device_put(x) for x in _inputs(self.n))

    def _compile_seconds(self, fn):
        t0 = time.perf_counter()
        fn.lower(*self.args).compile()
        return time.perf_counter() - t0



class JaxCompile(_JaxCompileBase):
    __doc__ = _JaxCompileBase.__doc__

    def track_jax_compile_jit(self, name):
        rec = self.rec
        return self._compile_seconds(self.jax.jit(lambda q, k, v: rec(q, k, v)))


class JaxCompileUniform(_JaxCompileBase):
    __doc__ = _JaxCompileBase.__doc__

    def setup(self, name):
        if not hasattr(arrayattn, "jit_uniform"):
            raise NotImplementedError("arrayattn.jit_uniform is not in this revision")
        super().setup(name)

    def track_jax_compile_uniform(self, name):
        return self._compile_seconds(arrayattn.jit_uniform(self.rec))
