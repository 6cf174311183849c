"""``arrayattn report``: every registered variant on a default workload, one row each.

The default workload (documented in the README and ``docs/report.rst``): batch 1, 2 heads,
n = s = 1024 tokens, d = dv = 64, float32, seed 0, on NumPy, in two cases --

* ``gaussian``: q, k, v with i.i.d. N(0, 1) entries (logits q.k/sqrt(d) ~ N(0, 1):
  diffuse attention);
* ``sharp``: every q and k row of l2 norm 8 (the norms of trained BERT heads) *and* each
  query aligned with one random key (cosine ~0.9), so that its logit there is ~7 against
  an N(0, 1) background: peaked attention, where approximations are put to the test.
  (Norm alone does not make attention sharp: random directions at d = 64 give
  ``8 * 8 * cos / 8`` with ``cos ~ N(0, 1/64)``, logits ~ N(0, 1) again.)

and a third, ``real``: q, k, v of 36 real attention heads (layers 0, 2, 5 of
all-MiniLM-L6-v2 on 256 tokens of *Pride and Prejudice*; :func:`arrayattn.data.real_heads`,
shipped with the package), whatever the workload's n, heads and d.  On them the baseline
"mean of v for every query" is 0.80 from exact attention.

Every variant runs through its registry record with its default options, so a newly
registered variant appears without any change here.  Columns:

``rel. error``  ``||O - O*||_F / ||O*||_F``, O* exact softmax attention in float64 on the
                same (rounded) inputs;
``matrix err``  ``max_i ||a_i - a*_i||_1`` over the rows of the implied attention matrix of
                the first head (``A = f(q, k, I)``), for n <= 2048: it bounds the error of
                every output as ``|o_i - o*_i| <= ||a_i - a*_i||_1 max|v|``;
``row-sum dev`` ``max_i |sum_j a_ij - 1|``, from one call with ``v = 1``;
                (both matrix columns are ``-`` for a record with ``linear_in_v=False``,
                whose weights depend on ``v``);
``median ms``   median wall time of ``repeats`` calls after a warm-up call;
``peak MiB``    peak memory of one call, measured by :mod:`tracemalloc` (NumPy and
                array-api-strict) or the CUDA allocator (torch on a GPU); ``-`` where
                it cannot be measured from Python;
``parameter``   the approximation parameter and its default value.
"""
from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field

import numpy as np

from .backends import get_array_backend
from .calls import (Compiled, compiles, implied_matrix, on_host, openblas_threads, timed,
                    wide_v_shape)
from .json_file import machine_info, rows_as_dicts, write_json
from ..registry import get_variant, variants
from .plot import plot_report
from .table import format_table
from .kinds import kind_of

__all__ = ["BASELINE", "Workload", "Row", "Progress", "kind_of", "baseline_row", "make_inputs", "reference", "run_report",
           "format_table", "rows_as_dicts", "parameter_default", "sweep_values", "run_sweeps",
           "sweep_steps", "plot_report", "machine_info", "write_json"]

CASES = {"gaussian": None, "sharp": 8.0, "real": "real_heads"}
#: Sharp case: query i = normalise(k_j + SHARP_NOISE * g) * norm for a random key j.
SHARP_NOISE = 0.5
#: Above this n the implied matrix (n x s per head) is not formed.
MATRIX_MAX_N = 2048


@dataclass(frozen=True)
class Workload:
    """What the report runs: shapes, dtype, seed, backend and repetitions."""

    batch: int = 1
    heads: int = 2
    n: int = 1024
    d: int = 64
    dtype: str = "float32"
    seed: int = 0
    repeats: int = 3
    backend: str = "numpy"


def make_inputs(w: Workload, case: str, n: int | None = None):
    """Host float64 ``q, k, v (batch, heads, n, d)`` for ``case`` (see module docstring)."""
    if CASES[case] == "real_heads":        # fixed data: (1, 36, 256, 32)
        from ..data import real_heads
        return tuple(x[None] for x in real_heads())
    n = w.n if n is None else n
    rng = np.random.default_rng(w.seed)
    shape = (w.batch, w.heads, n, w.d)
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    norm = CASES[case]
    if norm is not None:
        def unit(x):
            return x / np.linalg.norm(x, axis=-1, keepdims=True)
        k = unit(k)
        match = rng.integers(0, n, size=shape[:-1])           # the key each query finds
        aligned = np.take_along_axis(k, match[..., None], axis=-2)
        q = unit(aligned + SHARP_NOISE * unit(q)) * norm
        k = k * norm
    return q, k, v


def reference(q, k, v):
    """Exact softmax attention in float64 on the host (the report's yardstick)."""
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def _round(x, dtype):
    """``x`` as the backend will see it, back in float64 (bfloat16 via float32 bits)."""
    if dtype == "bfloat16":
        bits = np.asarray(x, np.float32).view(np.uint32)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).astype(np.uint32)
        return bits.view(np.float32).astype(np.float64)
    return np.asarray(x).astype(dtype).astype(np.float64)


@dataclass
class Row:
    """One variant on one case."""

    variant: str
    case: str
    family: str = ""
    parameter: str = ""
    rel_error: float | None = None
    matrix_error: float | None = None
    row_sum_dev: float | None = None
    median_ms: float | None = None
    peak_mib: float | None = None
    error: str = ""
    times_ms: list = field(default_factory=list)
    kind: str = ""
    min_ms: float | None = None


BASELINE = "baseline (mean of v)"


def baseline_row(case: str, v, ref, exact_a) -> Row:
    """The trivial answer "the mean of v for every query" (uniform attention): an
    approximation that does worse than this is worse than useless (on real transformer
    heads it scores about 0.8)."""
    out = np.broadcast_to(v.mean(axis=-2, keepdims=True), ref.shape)
    row = Row(BASELINE, case, "", "", kind="baseline")
    row.rel_error = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    row.row_sum_dev = 0.0
    if exact_a is not None:
        uniform = np.full_like(exact_a, 1.0 / exact_a.shape[-1])
        row.matrix_error = float(np.abs(uniform - exact_a).sum(axis=-1).max())
    return row


class Progress:
    """A progress bar on stderr (redrawn in place on a terminal, sparse lines otherwise)."""

    def __init__(self, total: int, stream=None, width: int = 30, enabled: bool = True):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_decile = -1

    def step(self, label: str):
        self.done += 1
        if not self.enabled:
            return
        frac = self.done / self.total
        bar = "#" * int(frac * self.width)
        line = f"[{bar:<{self.width}}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write("\r\x1b[K" + line[:120])
            if self.done >= self.total:
                self.stream.write("\n")
        elif int(frac * 10) > self._last_decile or self.done >= self.total:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, text: str):
        """One line of its own (before the bar starts)."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()


def _select(names):
    if names is None:
        return list(variants())
    return [get_variant(n) for n in names]


def parameter_default(rec):
    """The value of ``rec.parameter`` in a uniform call: the record's default, else the
    function's signature default (``None`` when neither says)."""
    if rec.parameter is None:
        return None
    if rec.parameter_value is not None:
        return rec.parameter_value
    import inspect
    try:
        par = inspect.signature(rec.fn).parameters.get(rec.parameter)
    except (TypeError, ValueError):
        return None
    if par is None or par.default is inspect.Parameter.empty:
        return None
    return par.default


def _param_label(rec, value=None):
    if rec.parameter is None:
        return ""
    value = parameter_default(rec) if value is None else value
    return f"{rec.parameter}={value}"


def run_report(w: Workload = Workload(), names=None, *, progress=None,
               one_call_matrix=False):
    """Run every registered variant (or ``names``) on the workload; a list of :class:`Row`.

    ``one_call_matrix=True`` (JAX): the implied matrix of a case whose ``v`` cannot carry
    the identity's column blocks twice in one call of its own program through one more
    program per variant and shape, whose ``v`` is ``I_s`` (:func:`implied_matrix`): one
    call a case, the same numbers to float32 rounding, but on a 2-core CPU its 30 more
    compiles cost more than the calls they save (``docs/report.rst``), so it is off.

    A variant that raises on the workload gets a row with the error message instead of
    numbers; the report goes on.
    """
    be = get_array_backend(w.backend, w.dtype)
    recs = _select(names)
    prog = progress or Progress(len(CASES) * len(recs), enabled=False)
    compiled = Compiled(be)
    hosts = {case: [_round(x, w.dtype) for x in make_inputs(w, case)] for case in CASES}
    shapes = {tuple(x.shape for x in host): host for host in hosts.values()}
    if compiles(be):
        prog.note(f"compiling {len(recs)} variant(s) x {len(shapes)} input shape(s), "
                  f"the first case running meanwhile")
    inputs = [[be.asarray(x, w.dtype) for x in host] for host in shapes.values()]
    # one_call_matrix: the implied matrix's own programs, for the shapes that need one
    wide = [(q, k, wide_v_shape(v.shape)) for q, k, v in inputs if one_call_matrix
            and q.shape[-2] <= MATRIX_MAX_N and wide_v_shape(v.shape) is not None]
    # compiled (JAX): the programs compile in the background, the first shape's first,
    # while the calls that give the error columns run; the timed calls come last, once
    # nothing compiles beside them (each program has run by then: no warm-up call)
    # JAX on a CPU: SciPy's and NumPy's OpenBLAS (jaxlib's LAPACK, the host's float64
    # work) on one thread while the report runs (openblas_threads)
    threads = openblas_threads(1) if compiled.compiles and be.device == "cpu" else None
    try:
        compiled.start(recs, inputs, wide=wide)
        later = []
        rows = []
        try:
            for case in CASES:
                rows += _case_rows(w, be, compiled, recs, case, hosts[case], later, prog,
                                   one_call_matrix)
        except BaseException:
            compiled.wait(cancel=True)
            raise
        compiled.wait()
        for row, call, q, k, v, ref in later:
            try:
                out, times, peak = timed(be, call, q, k, v, w.repeats)
                _set_times(row, times, peak)
                if ref is not None:
                    row.rel_error = _rel_error(out, ref)
            except Exception as exc:  # keep going: one broken variant must not hide the rest
                row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    finally:
        if threads:
            openblas_threads(threads)
    return rows


def _set_times(row, times, peak):
    row.times_ms = [t * 1e3 for t in times]
    row.median_ms = statistics.median(row.times_ms)
    row.min_ms = min(row.times_ms)
    row.peak_mib = None if peak is None else peak / 2**20


def _rel_error(out, ref):
    o = on_host(out)
    return float(np.linalg.norm(o - ref) / np.linalg.norm(ref))


def _case_rows(w, be, compiled, recs, case, host, later, prog, one_call_matrix):
    """The rows of one case.  Where calls are compiled (JAX) the timed calls are left
    for later (appended to ``later``), and the output comes from one plain call of the
    program before the row sums and the implied matrix -- or, where the program has run
    already (the sharp case after the gaussian one), from the first timed call, later:
    the same program on the same inputs gives the same numbers; elsewhere the output is
    the timed calls' warm-up's."""
    ref = reference(*host)
    q, k, v = (be.asarray(x, w.dtype) for x in host)
    # compiled (JAX): ones of v's shape, the program already compiled (the row sums
    # are the max over dv identical columns); elsewhere one column
    ones = be.asarray(np.ones(host[2].shape if compiles(be) else
                              (*host[2].shape[:-1], 1)), w.dtype)
    exact_a = None
    if host[0].shape[-2] <= MATRIX_MAX_N:
        qa, ka = host[0][:1, :1, ...], host[1][:1, :1, ...]
        exact_a = reference(qa, ka, np.eye(ka.shape[-2]))
    rows = [baseline_row(case, host[2], ref, exact_a)]
    for rec in recs:
        row = Row(rec.name, case, rec.family, _param_label(rec), kind=kind_of(rec))
        try:
            call = compiled(rec)
            if not compiled.compiles:
                out, times, peak = timed(be, call, q, k, v, w.repeats)
                _set_times(row, times, peak)
                row.rel_error = _rel_error(out, ref)
            elif w.repeats > 0 and call.has_run(q, k, v):
                later.append((row, call, q, k, v, ref))     # the output from the timing
            else:
                row.rel_error = _rel_error(call(q, k, v), ref)
                later.append((row, call, q, k, v, None))
            if not getattr(rec, "linear_in_v", True):
                pass  # no implied matrix: the weights depend on v
            else:
                row.row_sum_dev = float(np.abs(on_host(call(q, k, ones)) - 1.0).max())
            if exact_a is not None and getattr(rec, "linear_in_v", True):
                a, compiled.alike[rec.name] = implied_matrix(
                    be, call, host[0], host[1], host[2].shape, w.dtype,
                    compiled.alike.get(rec.name), wide=one_call_matrix)
                row.matrix_error = float(np.abs(a - exact_a).sum(axis=-1).max())
        except Exception as exc:  # keep going: one broken variant must not hide the rest
            row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            if later and later[-1][0] is row:
                later.pop()
        rows.append(row)
        prog.step(f"{rec.name} ({case})")
    return rows


# ---------------------------------------------------------------------------------------
# Sweeps for the plot: error vs approximation size, time vs n
# ---------------------------------------------------------------------------------------

SWEEP_FACTORS = (0.25, 0.5, 1.0, 2.0)
SCALING_FACTORS = (0.25, 0.5, 1.0, 2.0)


def sweep_values(rec, n: int):
    """Values of ``rec.parameter`` around its default (x1/4 ... x2, within 1..n)."""
    p0 = parameter_default(rec)
    if rec.exact or not isinstance(p0, int) or isinstance(p0, bool) or p0 <= 0:
        return []
    return sorted({min(n, max(1, int(round(p0 * f)))) for f in SWEEP_FACTORS})


def run_sweeps(w: Workload = Workload(), names=None, *, progress=None,
               max_seconds: float = 5.0):
    """Error vs approximation size (every approximate variant with an integer
    ``parameter``) and time vs n (every variant, n = w.n x 1/4 ... x 2; a variant is not
    run at larger n once a call took longer than ``max_seconds``)."""
    be = get_array_backend(w.backend, w.dtype)
    recs = _select(names)
    prog = progress or Progress(1, enabled=False)
    compiled = Compiled(be)
    errors, scaling = [], []
    for case in CASES:
        host = [_round(x, w.dtype) for x in make_inputs(w, case)]
        ref = reference(*host)
        q, k, v = (be.asarray(x, w.dtype) for x in host)
        for rec in recs:
            for value in sweep_values(rec, q.shape[-2]):
                point = {"variant": rec.name, "case": case, "parameter": rec.parameter,
                         "value": value}
                try:
                    o = on_host(rec(q, k, v, **{rec.parameter: value}))
                    point["rel_error"] = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
                except Exception as exc:
                    point["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                errors.append(point)
                prog.step(f"{rec.name} {rec.parameter}={value} ({case})")
    ns = sorted({max(16, int(w.n * f)) for f in SCALING_FACTORS})
    for rec in recs:
        for n in ns:
            host = make_inputs(w, "gaussian", n=n)
            q, k, v = (be.asarray(x, w.dtype) for x in host)
            point = {"variant": rec.name, "n": n}
            try:
                _, times, _ = timed(be, compiled(rec), q, k, v, max(1, w.repeats))
                point["median_ms"] = statistics.median(times) * 1e3
                point["best_ms"] = min(times) * 1e3  # robust to a loaded machine
            except Exception as exc:
                point["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            scaling.append(point)
            prog.step(f"{rec.name} n={n}")
            if point.get("best_ms", 0.0) > max_seconds * 1e3:
                break
    return {"errors": errors, "scaling": scaling}


def sweep_steps(w: Workload, names=None) -> int:
    recs = _select(names)
    ns = {max(16, int(w.n * f)) for f in SCALING_FACTORS}
    n_of = {case: make_inputs(w, case)[0].shape[-2] if CASES[case] == "real_heads" else w.n
            for case in CASES}
    return (sum(len(sweep_values(r, n_of[c])) for r in recs for c in CASES)
            + len(recs) * len(ns))
