"""How the report calls a variant on a backend: one prepared call per variant (``jax.jit``
on JAX, compiled ahead for every input shape), timed calls with the peak memory of one,
and the implied attention matrix of the first head read through the prepared call."""
from __future__ import annotations

import math
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._numpy.parallel import openblas_control
from ..core.xp import to_numpy
from ..registry.variant import Variant
from ..registry import attention_matrix, jit_uniform

__all__ = ["on_host", "Compiled", "Executables", "implied_matrix", "wide_v_shape", "openblas_threads",
           "compiles", "timed",
           "CPU_COMPILER_OPTIONS"]

#: XLA options of the report's programs on a CPU: LLVM at XLA's backend optimisation
#: level 1 instead of the default 2 compiles them about a quarter faster, and they give
#: the same outputs at the same speed (``benchmarks/results/report.md``); XLA's older
#: loop emitters instead of its MLIR "fusion emitters" (``xla_cpu_use_fusion_emitters``
#: off) compile them about 40% faster again at level 1, every output bit-for-bit the
#: same, the calls as fast but LSH's on the real-heads shape (2x;
#: ``benchmarks/results/report.md``); and LLVM's code generation of a
#: program in one piece instead of split for parallel threads
#: (``xla_cpu_parallel_codegen_split_count`` 1): a program alone compiles a little
#: slower, but with 22% fewer CPU seconds, and the report keeps both cores busy with
#: compiles and calls (12.4-13.1 s against 13.6-13.9 s, the same outputs).  The report
#: calls each program about a dozen times, so its compile time is most of its own.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1,
                        "xla_cpu_use_fusion_emitters": False,
                        "xla_cpu_parallel_codegen_split_count": 1}


def openblas_threads(n: int | None, packages=("scipy", "numpy")) -> dict:
    """Set the threads of the OpenBLAS libraries that SciPy and NumPy wheels ship to
    ``n`` (``None``: only read them); returns ``{path: threads before}`` of each one
    found (none for other builds: nothing changes).  jaxlib's CPU LAPACK kernels (a JAX
    program's SVD, eigh, QR) call SciPy's; NumPy's serves the host's float64 matmuls and
    norms.  ``openblas_threads(None)`` and a dict from an earlier call restore.

    The JAX report sets both to 1 while it runs on a CPU: OpenBLAS's threads wait for
    work by spinning, and beside XLA's compiles and calls (and on a loaded machine) they
    slowed Nyström's ``m x m`` SVD 100x (1.4 ms -> 0.2-0.5 s a call) and took CPU from
    every program (``benchmarks/results/report.md``)."""
    import glob
    import importlib
    import os
    found = {}
    for name in packages:
        try:
            pkg = importlib.import_module(name)
            if name == "scipy":
                importlib.import_module("scipy.linalg.cython_lapack")  # loads it
        except ImportError:
            continue
        libs = os.path.join(os.path.dirname(os.path.dirname(pkg.__file__)), name + ".libs")
        for path in sorted(glob.glob(os.path.join(libs, "lib*openblas*.so*"))):
            control = openblas_control(path)
            if control:
                found[path] = int(control[1]())
                want = n.get(path) if isinstance(n, dict) else n
                if want is not None:
                    control[0](int(want))
    return found


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

    def ahead(self, recs, inputs, workers: int = 2, wide=()):
        """Compile every variant of ``recs`` for every input triple of ``inputs``, and for
        each ``v`` shape of ``wide`` (the one-call implied matrix's programs,
        :func:`wide_v_shape`: ``(q, k, v shape)``, for the records linear in ``v``),
        ``workers`` programs at a time, and wait until all are compiled
        (:meth:`start`, then :meth:`wait`)."""
        self.start(recs, inputs, workers, wide)
        self.wait()

    def start(self, recs, inputs, workers: int = 2, wide=()):
        """Begin compiling what :meth:`ahead` compiles, in the background, ``workers``
        programs at a time (XLA compiles outside Python's lock, so one program traces
        while another compiles), every variant for the first input triple first, then for
        the next: a call of a program not compiled yet waits for it
        (:meth:`Executables.compiled`), so the first case's calls run while the other
        shapes' programs compile.  A variant that fails here fails in its row, with this
        error."""
        if not self.compiles:
            return
        import jax

        jobs = [(self(rec), args) for args in inputs for rec in recs]
        jobs += [(self(rec), (q, k, jax.ShapeDtypeStruct(shape, q.dtype)))
                 for q, k, shape in wide
                 for rec in recs if getattr(rec, "linear_in_v", True)]
        self._pool = ThreadPoolExecutor(max_workers=workers)
        for call, args in jobs:
            call.submit(self._pool, *args)

    def wait(self, cancel: bool = False):
        """Wait until every program :meth:`start` began is compiled (or failed);
        ``cancel=True``: those not begun yet are not compiled."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=cancel)


class Executables:
    """A :class:`~arrayattn.registry.jit_uniform` call compiled with XLA ``options``, once
    per shapes and dtypes of ``q, k, v`` (``jax.jit``'s own cache would compile it with
    XLA's defaults); an XLA that does not know an option compiles without that one."""

    def __init__(self, call: jit_uniform, options: dict):
        self.call, self.options, self.programs = call, dict(options), {}
        #: programs being compiled by :meth:`submit`'s workers, by shapes
        self.pending = {}
        #: the shapes whose program has run (:meth:`has_run`)
        self.ran = set()

    @staticmethod
    def _key(q, k, v):
        return tuple((tuple(x.shape), str(x.dtype)) for x in (q, k, v))

    def has_run(self, q, k, v) -> bool:
        """Whether the program for these shapes has run already (warm)."""
        return self._key(q, k, v) in self.ran

    def compiled(self, q, k, v):
        """The executable for these shapes (compiled on first use; one that a worker
        of :meth:`submit` compiles is waited for, and its error raised here)."""
        key = self._key(q, k, v)
        if key not in self.programs:
            job = self.pending.get(key)
            if job is not None:
                return job.result()
            self._compile(key, q, k, v)
        return self.programs[key]

    def submit(self, pool, q, k, v):
        """Compile the program for these shapes on the executor ``pool``."""
        key = self._key(q, k, v)
        if key not in self.programs and key not in self.pending:
            self.pending[key] = pool.submit(self._compile, key, q, k, v)

    def _compile(self, key, q, k, v):
        lowered = self.call.lower(q, k, v)
        while True:
            try:
                program = lowered.compile(compiler_options=dict(self.options) or None)
                break
            except Exception as exc:
                if "option" not in str(exc) or not self.options:
                    raise                    # not an option this XLA lacks
                # leave out the option the message names (else all of them)
                named = [o for o in self.options if repr(o) in str(exc) or o in str(exc)]
                for o in named or list(self.options):
                    self.options.pop(o, None)
        self.programs[key] = program
        return program

    def __call__(self, q, k, v):
        out = self.compiled(q, k, v)(q, k, v, self.call.drawn(q))
        self.ran.add(self._key(q, k, v))
        return out


def wide_v_shape(v_shape) -> tuple | None:
    """The shape ``(..., s, s)`` of a ``v`` that carries the whole identity ``I_s`` in
    every head slot, where ``v``'s own shape cannot carry every block of its ``dv``
    columns twice (``slots < 2 ceil(s / dv)``); else ``None`` (the case's own program
    reads the matrix in one call: :func:`implied_matrix`)."""
    s, dv = v_shape[-2], v_shape[-1]
    if math.prod(v_shape[:-2]) >= 2 * -(-s // dv):
        return None
    return (*v_shape[:-1], s)


def implied_matrix(be, call, hq, hk, v_shape, dtype, alike=None, wide=False):
    """The first head's implied matrix ``(1, 1, n, s)`` from the host ``hq, hk``, and
    whether the variant's heads are alike (``None`` where that was not needed).

    Where calls are compiled (JAX), through the variant's compiled call, the first head's
    ``q, k`` in every head slot, the identity's columns in blocks of ``dv``:

    * where ``v``'s shape carries every block twice (``slots >= 2 ceil(s / dv)``: the
      ``real`` case, 36 heads), in **one call** of the case's own program: slot ``i``
      carries block ``i mod blocks``, and the copies of a block agree where the
      variant's heads are alike.  A variant whose heads are not alike (per-head decays,
      gates drawn per head) answers differently in its slots; its slot 0 is the first
      head's, and each further block takes one call;
    * elsewhere (2 heads of ``dv = 64`` for ``s = 1024``), ``wide=True``: in one call of
      a program whose ``v (..., s, s)`` carries the whole identity in every slot
      (:func:`wide_v_shape`; one more program per variant and shape, compiled ahead:
      dearer than the calls it saves on a CPU, ``docs/report.rst``); ``wide=False``
      (the report's default), through the case's own program, ``slots x dv`` columns a
      call -- a first call with block 0 in every slot finds out whether the heads are
      alike (``alike=None``; pass what an earlier case found to save it) -- or ``dv``
      columns a call where they are not.

    Every form gives the column-block form's matrix (one call per block), to float32
    rounding (``tests/report/test_report.py``).  Elsewhere one call on ``I_s``."""
    if not compiles(be):
        return on_host(attention_matrix(call, be.asarray(hq[:1, :1], dtype),
                                        be.asarray(hk[:1, :1], dtype))), None
    s, dv, n = v_shape[-2], v_shape[-1], hq.shape[-2]
    slots = math.prod(v_shape[:-2])
    q0, k0 = (be.asarray(np.broadcast_to(x[:1, :1], x.shape), dtype) for x in (hq, hk))
    if wide and wide_v_shape(v_shape) is not None:
        eye = np.broadcast_to(np.eye(s), wide_v_shape(v_shape))
        out = on_host(call(q0, k0, be.asarray(eye, dtype)))
        return np.reshape(out, (slots, n, s))[0][None, None], alike
    eye, starts = np.eye(s), list(range(0, s, dv))

    def columns(layout):
        block = np.zeros((slots, s, dv))
        for slot, j0 in enumerate(layout):
            block[slot, :, :min(dv, s - j0)] = eye[:, j0:j0 + dv]
        out = call(q0, k0, be.asarray(np.reshape(block, v_shape), dtype))
        return np.reshape(on_host(out), (slots, n, dv))

    def agree(out, copies):
        tol = 1e-6 * np.abs(out[:len(copies)]).max()
        return all(np.allclose(out[i], out[j], rtol=1e-4, atol=tol) for i, j in copies)

    cols = {}
    if alike is None:             # a first call finds out whether the heads are alike
        if slots >= 2 * len(starts):      # every block, each twice or more: all in it
            layout = [starts[i % len(starts)] for i in range(slots)]
            copies = [(i, i % len(starts)) for i in range(len(starts), slots)]
        else:                             # block 0 in every slot
            layout, copies = [0] * slots, [(i, 0) for i in range(1, slots)]
        first = columns(layout)
        alike = agree(first, copies)
        cols = {0: first[0]}
        if alike and len(copies) >= len(starts):        # the cyclic layout: every block
            cols = dict(zip(starts, first[:len(starts)]))
    rest = [j0 for j0 in starts if j0 not in cols]
    step = slots if alike else 1
    for c0 in range(0, len(rest), step):
        part = rest[c0:c0 + step]
        out = columns(part + [0] * (slots - len(part)) if alike else part * slots)
        cols.update({j0: out[slot] for slot, j0 in enumerate(part)})
    a = np.concatenate([cols[j0][:, :min(dv, s - j0)] for j0 in sorted(cols)], axis=-1)
    return a[None, None], alike


def _identity(fn):
    return fn


def compiles(be) -> bool:
    """Whether the backend compiles its timed calls (``jax.jit``)."""
    return be.compile(_identity) is not _identity


def timed(be, call, q, k, v, repeats):
    """Warm-up call (peak memory measured on it; on JAX it compiles ``call`` for these
    shapes unless an earlier call did), then ``repeats`` timed calls; the output is the
    warm-up's.  No warm-up where the program ran already (:meth:`Executables.has_run`:
    an earlier case of the same shapes ran it -- the ``sharp`` case after the
    ``gaussian`` one) and nothing measures peak memory: the output is then the first
    timed call's (the same program on the same inputs, the same numbers).  ``call``: a
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
    out = peak = None
    if not (repeats > 0 and be.memory is None and not traced
            and getattr(call, "has_run", lambda *a: False)(q, k, v)):
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
        out = res if out is None else out
    return out, times, peak
