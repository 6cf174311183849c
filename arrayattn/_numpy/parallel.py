"""Using every CPU core from NumPy: a thread map over independent row blocks.

NumPy runs its matmuls on every core (BLAS threads) but every elementwise operation
(``exp``, ``max``, a subtraction) on one, and on a small machine the elementwise passes of
an attention cost as much as its matmuls.  NumPy releases the GIL inside both, so
independent blocks of a computation (query blocks of the online softmax, row blocks of a
feature map) run in parallel in plain Python threads -- with the BLAS held to one thread
meanwhile, since two callers of a multi-threaded OpenBLAS oversubscribe the cores and run
slower than one stream.

Process-wide state and how it is kept safe:

* The BLAS thread count is process-wide.  It is changed only inside a section, and every
  public call on NumPy holds :data:`LOCK` for its whole duration
  (:func:`arrayattn.core.engine.entry`): concurrent calls are serialised (each uses every core
  already), so two identical calls give bit-identical results whatever other threads of
  arrayattn do.
* ``fork``: :data:`LOCK` is taken before a fork and released after it in the parent; the
  child gets a fresh lock, no pool (it makes its own) and no thread-local state, so a
  child forked while another thread was inside a call works.  OpenBLAS's own threads are
  OpenBLAS's business: a fork while *another* library's thread is inside a
  multi-threaded OpenBLAS call can hang the child (reproducible with NumPy alone); use
  the ``spawn`` or ``forkserver`` start methods of :mod:`multiprocessing` there.

``ARRAYATTN_NUM_THREADS`` sets the number of threads (``1``: always serial); the default
is the number of CPUs this process may run on.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import glob
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import workspace

__all__ = ["LOCK", "serialised", "num_threads", "split_everything", "per_thread", "split_rows",
           "parallel_map", "map_rows", "scratch", "held", "own", "blas_single", "reduce_rows",
           "cumsum_", "openblas_control"]

#: Below this many bytes of work (rows x bytes per row) :func:`split_rows` keeps one block:
#: a thread hand-off costs tens of microseconds.
MIN_WORK = 1 << 20
#: Target size of a block's largest temporary: a few times the L2 cache of a core, so that
#: the passes over a block (matmul, max, subtract, exp, the next matmul) mostly hit the
#: cache (a pass over an array far larger than the cache runs at memory speed, and a fresh
#: large array pays a page fault per 4 KiB on first touch).
BLOCK_BYTES = 1 << 22

#: Held by every public call on NumPy (see the module docstring).
LOCK = threading.RLock()

_state = threading.local()   # .inside: a worker; .depth: map nesting; .held, .item: held()
_pool: tuple | None = None   # (executor, workers, pid)
_blas: tuple | None = None   # (set, get) of the BLAS thread count, or () when not found
_split: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "arrayattn_split", default=None)   # (threads, min_work, block_bytes, units) while forced


@contextlib.contextmanager
def serialised():
    """Hold :data:`LOCK` for the ``with`` block: what every public call on NumPy computes
    in (:func:`arrayattn.core.engine.entry`), so the engine's BLAS thread count and pool are
    never changed under another call."""
    with LOCK:          # the module's LOCK at entry (a forked child has a fresh one)
        yield


def _before_fork():
    LOCK.acquire()


def _after_fork_parent():
    LOCK.release()


def _after_fork_child():
    global LOCK, _pool, _state
    LOCK = threading.RLock()   # (the workspaces are reset by .workspace's own hook)
    _pool = None            # the pool's threads did not survive the fork
    _state = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                        after_in_child=_after_fork_child)


def num_threads() -> int:
    """Threads :func:`parallel_map` uses (``ARRAYATTN_NUM_THREADS``, or the CPUs this
    process may run on)."""
    forced = _split.get()
    if forced is not None:
        return forced[0]
    env = os.environ.get("ARRAYATTN_NUM_THREADS", "").strip()
    if env:
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(
                f"ARRAYATTN_NUM_THREADS must be a positive integer; got {env!r}")
        return value
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def split_everything(threads: int = 2, units: int = 1):
    """Inside the block, split every problem into blocks of ``units`` rows (or chunks)
    over ``threads`` threads, whatever its size: how the tests run the split path on small
    inputs (per thread/task, no global state changed)."""
    token = _split.set((threads, 0, 1, units))
    try:
        yield
    finally:
        _split.reset(token)


def _find_openblas():
    """``(set_num_threads, get_num_threads)`` of the OpenBLAS NumPy uses, or ``()``.

    NumPy wheels bundle ``scipy-openblas`` (symbols ``scipy_openblas_*64_``); distribution
    builds link a system ``libopenblas``.  The library is found among those already loaded
    (``/proc/self/maps``) or next to NumPy; MKL, Accelerate or an unknown BLAS give ``()``.
    """
    base = os.path.dirname(np.__file__)
    # NumPy's own copy first: a second OpenBLAS (SciPy's) does not run NumPy's matmuls.
    paths = glob.glob(base + ".libs/*openblas*") + glob.glob(base + "/.dylibs/*openblas*")
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({line.split()[-1] for line in maps
                             if "openblas" in line.lower() and "/" in line})
    except OSError:  # pragma: no cover - not Linux
        pass
    for path in paths:
        # not SciPy's 32-bit interface: that library does not run NumPy's matmuls
        control = openblas_control(path, [x for x in _OPENBLAS_SYMBOLS if "64_" in x[0]
                                          or not x[0].startswith("scipy")])
        if control:
            return control
    return ()


#: OpenBLAS's thread-count functions ``(set, get)``: scipy-openblas wheels (NumPy's 64-bit
#: interface, SciPy's 32-bit one), then distribution builds.
_OPENBLAS_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"))


def openblas_control(path: str, symbols=_OPENBLAS_SYMBOLS):
    """``(set_num_threads, get_num_threads)`` of the OpenBLAS library at ``path`` (the
    first pair of ``symbols`` it has), or ``()`` (not loadable, not an OpenBLAS)."""
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return ()
    for set_name, get_name in symbols:
        setter, getter = getattr(lib, set_name, None), getattr(lib, get_name, None)
        if setter is not None and getter is not None:
            setter.argtypes, setter.restype = [ctypes.c_int], None
            getter.argtypes, getter.restype = [], ctypes.c_int
            return setter, getter
    return ()


def _blas_control():
    global _blas
    if _blas is None:
        try:
            _blas = _find_openblas()
        except Exception:  # pragma: no cover - a broken library must not break attention
            _blas = ()
    return _blas


def _executor(workers: int) -> ThreadPoolExecutor:
    """The pool (made again for a new size, and in a forked child)."""
    global _pool
    if _pool is None or _pool[1] != workers or _pool[2] != os.getpid():
        if _pool is not None and _pool[2] == os.getpid():
            _pool[0].shutdown(wait=False)
        _pool = (ThreadPoolExecutor(workers, thread_name_prefix="arrayattn"), workers,
                 os.getpid())
    return _pool[0]


def _as_worker(fn, held):
    """``fn`` run as a worker of one :func:`parallel_map` call on ``(position, item)``:
    nested calls run serially, :func:`scratch` hands out this thread's workspace buffers
    and :func:`held` the caller's (``held``: its workspace and depth)."""
    def run(numbered):
        _state.inside, _state.depth, _state.held = True, 1, held
        _state.item = numbered[0]
        try:
            return fn(numbered[1])
        finally:
            _state.inside, _state.depth, _state.held = False, 0, None
    return run


def _serial(fn, items, depth: int) -> list:
    """``[fn(item) for item in items]`` on this thread, one map level deeper: a nested
    call gets buffers of its own depth, never its caller's."""
    saved = getattr(_state, "held", None), getattr(_state, "item", None)
    _state.depth, _state.held = depth + 1, (workspace.space(), depth)
    try:
        out = []
        for position, item in enumerate(items):
            _state.item = position
            out.append(fn(item))
        return out
    finally:
        _state.depth, (_state.held, _state.item) = depth, saved


@contextlib.contextmanager
def _one_blas_thread(control):
    """Hold the BLAS of ``control`` to one thread, restored on the way out (also on
    error).  Under :data:`LOCK`, so only one section changes the count at a time."""
    with LOCK:
        previous = control[1]() if control else None
        if control:
            control[0](1)
        try:
            yield
        finally:
            if control:
                control[0](previous)


def parallel_map(fn, items, *, blas: bool = True) -> list:
    """``[fn(item) for item in items]``, in threads.

    ``fn`` must only read shared arrays and write nothing another item reads.
    ``blas=True`` when ``fn`` calls matmuls: the BLAS is then held to one thread while the
    items run (and the map runs serially when the BLAS cannot be told, since
    oversubscribed OpenBLAS threads are slower than one stream).  A call from inside a
    worker runs serially.  Inside ``fn``, :func:`scratch` gives buffers that the items run
    by one thread share (kept for the next calls: :mod:`.workspace`), :func:`held` buffers
    one per item that outlive it.
    """
    items = list(items)
    workers = min(num_threads(), len(items))
    control = _blas_control() if blas else ()
    depth = getattr(_state, "depth", 0)
    try:
        if workers < 2 or getattr(_state, "inside", False) or (blas and not control):
            return _serial(fn, items, depth)
        with _one_blas_thread(control):
            return list(_executor(workers).map(
                _as_worker(fn, (workspace.space(), depth)), enumerate(items)))
    finally:
        if depth == 0:
            workspace.trim()


def scratch(shape, dtype, slot: str) -> np.ndarray:
    """A buffer of ``shape`` and ``dtype`` from this thread's workspace
    (:mod:`.workspace`), reused by every item the thread runs in a :func:`parallel_map`
    call and by the next calls (a fresh array outside a map).

    Why: a fresh block-sized temporary is fresh memory -- the allocator returns a freed
    block of this size to the system, and the next one pays a page fault per 4 KiB on
    first touch (measured: the block matmuls of a Nyström pass ran at half speed).
    ``slot`` names the buffer; a block must not return it (nor a view of it), nor use
    one slot twice at once.
    """
    depth = getattr(_state, "depth", 0)
    if not depth:
        return np.empty(shape, dtype=dtype)
    return workspace.buffer(workspace.space(), (depth, slot), shape, dtype)


def held(shape, dtype, slot: str) -> np.ndarray:
    """A buffer of ``shape`` and ``dtype`` for a result of the current item of a
    :func:`parallel_map` call that a later map of the same call reads (the first pass's
    block results of a two-pass form): from the calling thread's workspace, one per
    ``slot`` and item position, reused by the next calls (a fresh array outside a map).
    It must not reach the caller of the public function: the next call overwrites it."""
    where = getattr(_state, "held", None)
    if where is None:
        return np.empty(shape, dtype=dtype)
    ws, depth = where
    return workspace.buffer(ws, ("held", depth, slot, _state.item), shape, dtype)


def own(shape, dtype, slot: str) -> np.ndarray:
    """A buffer of ``shape`` and ``dtype`` from this thread's workspace for a temporary
    of the serial code between maps (keyed by ``slot`` and the map depth): reused by the
    next calls.  Consumed before the public call returns, never returned, and one slot
    used by one computation at a time (the caller's serial code, which no other thread
    runs).  A fresh array where the buffer would take the workspaces over their bound
    (no map after it would trim them)."""
    ws, key = workspace.space(), ("own", getattr(_state, "depth", 0), slot)
    buf, need = ws.get(key), math.prod(shape) * np.dtype(dtype).itemsize
    if buf is None or buf.nbytes < need:
        held_now = workspace.workspace_bytes() - (0 if buf is None else buf.nbytes)
        if held_now + need > workspace.workspace_limit():
            return np.empty(shape, dtype=dtype)
    return workspace.buffer(ws, key, shape, dtype)


@contextlib.contextmanager
def blas_single():
    """Hold NumPy's OpenBLAS to one thread inside the ``with`` block.

    For the small serial linear algebra between parallel sections (an ``(m, m)``
    pseudo-inverse): waking the BLAS threads for it saves nothing, and a woken OpenBLAS
    thread then busy-waits for a while, taking a core from the next parallel section
    (measured: 35 ms of a 150 ms Nyström call after one small SVD).
    """
    # inside a worker the enclosing map holds the lock (and the BLAS): nothing to do
    inside = getattr(_state, "inside", False)
    control = _blas_control() if num_threads() > 1 and not inside else ()
    if not control:
        yield
        return
    with _one_blas_thread(control):
        yield


def per_thread(count: int, threads: int, most: int) -> int:
    """``count`` pieces rounded up to a whole number per thread (at most ``most``): a
    map hands pieces out as threads free up, so 5 equal blocks on 2 threads take as long
    as 6 (measured: the causal kernel's passes at n = 4096 ran 1.2x their balanced time)."""
    return min(most, -(-count // threads) * threads)


def split_rows(n: int, *, row_bytes: int, align: int = 1) -> list[tuple[int, int]]:
    """Row ranges ``[(i0, i1), ...]`` covering ``range(n)`` in cache-sized blocks spread
    over the threads (one block for small work and inside a worker).

    ``row_bytes`` is the size of one row of the largest temporary of a block (all batch
    elements).  Blocks hold about :data:`BLOCK_BYTES` (less, to make their number a
    multiple of the threads), are at least one per thread, and every boundary but the
    last is a multiple of ``align`` (a chunk size).
    """
    forced = _split.get()
    min_work, block_bytes, per_block = ((MIN_WORK, BLOCK_BYTES, None) if forced is None
                                        else forced[1:])
    threads = num_threads()
    if getattr(_state, "inside", False) or n * row_bytes < min_work:
        return [(0, n)]
    units = -(-n // align)
    if per_block is None:   # in units of align
        per_block = max(1, block_bytes // max(1, row_bytes * align))
    blocks = per_thread(max(threads, -(-units // per_block)), threads, units)
    if blocks < 2:
        return [(0, n)]
    bounds = [min(n, (units * i // blocks) * align) for i in range(blocks + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def map_rows(fn, blocks, *, shape, dtype, blas: bool = True) -> np.ndarray:
    """The row blocks ``(i0, i1)`` of :func:`split_rows` of a result of ``shape`` and
    ``dtype`` (rows on axis -2), computed by :func:`parallel_map`.

    Each call ``fn(rows, out)`` gets ``out``, the block's place in the result: ``fn`` may
    write its block there (``np.matmul(..., out=out)``, then in-place updates) and return
    ``out``; a block it returns otherwise is copied in while it is still in cache (not in
    a serial concatenation afterwards, a pass over the whole output on one core).
    """
    blocks = list(blocks)
    result = np.empty(tuple(shape), dtype=dtype)
    base = blocks[0][0]

    def run(rows):
        place = result[..., rows[0] - base:rows[1] - base, :]
        block = fn(rows, place)
        if block is not place:
            place[...] = block

    parallel_map(run, blocks, blas=blas)
    return result


#: Row length :func:`reduce_rows` aims at when it views rows of an array as one.
REDUCE_ROW = 2048


def reduce_rows(reduce, x: np.ndarray) -> np.ndarray:
    """``reduce(x, axis=-2, keepdims=True)`` for ``reduce`` = ``np.max`` or ``np.sum``.

    NumPy reduces over the second-last axis of a C-contiguous array one short row at a
    time (~2.5x slower than a long row at 64 columns).  The array ``(..., r, c)`` is
    viewed as ``(..., r/g, g c)`` -- ``g`` consecutive rows as one long row, a free
    reshape -- reduced over its rows, and the ``g`` partial results then reduced: the
    same maximum, and a sum in another order.
    """
    if (x.ndim < 2 or x.strides[-1] != x.itemsize
            or x.strides[-2] != x.shape[-1] * x.itemsize):
        return reduce(x, axis=-2, keepdims=True)
    r, c = x.shape[-2], x.shape[-1]
    g = max(1, min(r, REDUCE_ROW // max(1, c)))
    while r % g:  # the largest group size up to the target that divides the rows
        g -= 1
    if g < 4:
        return reduce(x, axis=-2, keepdims=True)
    lead = x.shape[:-2]
    partial = reduce(x.reshape(*lead, r // g, g * c), axis=-2, keepdims=True)
    return reduce(partial.reshape(*lead, g, c), axis=-2, keepdims=True)


def cumsum_(x: np.ndarray, *, axis: int) -> np.ndarray:
    """Inclusive cumulative sum of ``x`` along ``axis``, in place.

    NumPy's ``cumsum`` along a non-last axis runs its inner loop across the strided axis
    (about 3x slower than adding whole slices); here the slices are added one per
    position along ``axis`` (a loop over chunks, never over tokens).
    """
    moved = np.moveaxis(x, axis, 0)
    for i in range(1, moved.shape[0]):
        moved[i] += moved[i - 1]
    return x
