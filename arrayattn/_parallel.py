"""Using every CPU core from NumPy: a thread map over independent blocks, and in-place
temporaries.

NumPy runs its matmuls on every core (BLAS threads) but every elementwise operation
(``exp``, ``max``, a subtraction) on one, and on this kind of machine the elementwise
passes of an attention cost as much as its matmuls.  NumPy releases the GIL inside both,
so independent blocks of a computation (query blocks of the online softmax, row blocks of
a feature map) run in parallel in plain Python threads -- with the BLAS itself held to one
thread meanwhile, since two callers of a multi-threaded OpenBLAS oversubscribe the cores
and run slower than one.

Only NumPy takes the threaded path.  torch and JAX already spread each operation over the
cores, CuPy over the GPU, and array-api-strict is for checking, not speed; for them
:func:`parallel_map` is a plain ``map`` and :func:`split_rows` gives one block.  The
blocks of one computation do not depend on how many threads run them, but how many blocks
there are can change the order of a sum (kernel attention adds per-block key states), so
NumPy results may differ from other backends' in the last bits, never by more.

``ARRAYATTN_NUM_THREADS`` sets the number of threads (``1``: always serial); the default
is the number of CPUs this process may run on.
"""
from __future__ import annotations

import contextlib
import ctypes
import glob
import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import array_api_compat

__all__ = ["num_threads", "parallel_map", "blas_single", "split_rows", "map_rows",
           "owns_in_place", "update_", "exp_shifted_", "zero_where_", "cumulative_sum_"]

#: Below this many bytes of work (rows x bytes per row) :func:`split_rows` keeps one block:
#: a thread hand-off costs tens of microseconds.
MIN_WORK = 1 << 20
#: Target size of a block's largest temporary: a few times the L2 cache of a core (smaller
#: blocks lose more to Python and small-matmul overhead than they gain), so that the passes
#: over a block (matmul, max, subtract, exp, the next matmul) mostly hit the cache rather
#: than memory (a pass over an array far larger than the cache runs at memory speed, and
#: a fresh large array pays a page fault per 4 KiB on first touch).
BLOCK_BYTES = 1 << 22
#: The tests set MIN_WORK = 0 and BLOCK_BYTES = 1 on one backend, so that small inputs run
#: the split path with many blocks.

_state = threading.local()   # .inside: this thread is a worker of parallel_map
_lock = threading.RLock()    # one section sets the BLAS thread count at a time
_pool: tuple | None = None    # (executor, workers, pid)
_blas: tuple | None = None   # (set, get) of the BLAS thread count, or () when not found


def num_threads() -> int:
    """Threads :func:`parallel_map` uses for NumPy (``ARRAYATTN_NUM_THREADS``, or the CPUs
    this process may run on)."""
    env = os.environ.get("ARRAYATTN_NUM_THREADS", "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(
                f"ARRAYATTN_NUM_THREADS must be a positive integer; got {env!r}") from None
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _find_openblas():
    """``(set_num_threads, get_num_threads)`` of the OpenBLAS NumPy uses, or ``()``.

    NumPy wheels bundle ``scipy-openblas`` (symbols ``scipy_openblas_*64_``); distribution
    builds link a system ``libopenblas``.  The library is found among those already loaded
    (``/proc/self/maps``) or next to NumPy; MKL, Accelerate or an unknown BLAS give ``()``.
    """
    import numpy as np

    base = os.path.dirname(np.__file__)
    # NumPy's own copy first: a second OpenBLAS (SciPy's) does not run NumPy's matmuls.
    paths = glob.glob(base + ".libs/*openblas*") + glob.glob(base + "/.dylibs/*openblas*")
    try:
        with open("/proc/self/maps") as maps:
            paths += sorted({line.split()[-1] for line in maps
                             if "openblas" in line.lower() and "/" in line})
    except OSError:  # pragma: no cover - not Linux
        pass
    names = [("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
             ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
             ("openblas_set_num_threads", "openblas_get_num_threads")]
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in names:
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
    """The pool (made again for a new size, and in a forked child, which inherits the
    pool object but not its threads)."""
    global _pool
    if _pool is None or _pool[1] != workers or _pool[2] != os.getpid():
        if _pool is not None and _pool[2] == os.getpid():
            _pool[0].shutdown(wait=False)
        _pool = (ThreadPoolExecutor(workers, thread_name_prefix="arrayattn"), workers,
                 os.getpid())
    return _pool[0]


def _as_worker(fn):
    def run(item):
        _state.inside = True
        try:
            return fn(item)
        finally:
            _state.inside = False
    return run


def parallel_map(xp, fn, items, *, blas: bool = True) -> list:
    """``[fn(item) for item in items]``, in threads when ``xp`` is NumPy.

    ``fn`` must only read shared arrays and return new ones (no writes to anything another
    item reads).  ``blas=True`` when ``fn`` calls matmuls: the threaded path then holds the
    BLAS to one thread while it runs (and is skipped when the BLAS cannot be told, since
    oversubscribed OpenBLAS threads are slower than one stream); ``blas=False`` for
    elementwise-only work.  A call from inside a worker runs serially.
    """
    items = list(items)
    workers = min(num_threads(), len(items))
    if (workers < 2 or not array_api_compat.is_numpy_namespace(xp)
            or getattr(_state, "inside", False)):
        return [fn(item) for item in items]
    control = _blas_control() if blas else ()
    if blas and not control:
        return [fn(item) for item in items]
    with _one_blas_thread(control):
        return list(_executor(workers).map(_as_worker(fn), items))


@contextlib.contextmanager
def _one_blas_thread(control):
    """Hold the BLAS of ``control`` (from :func:`_blas_control`; ``()``: none) to one
    thread, and restore its count on the way out, also on error.  Sections are serialised
    by the lock, which also guards the pool."""
    with _lock:
        previous = control[1]() if control else None
        if control:
            control[0](1)
        try:
            yield
        finally:
            if control:
                control[0](previous)


@contextlib.contextmanager
def blas_single(xp):
    """Hold NumPy's OpenBLAS to one thread inside the ``with`` block (other libraries:
    nothing happens).

    For the small serial linear algebra between parallel sections (an ``(m, m)``
    pseudo-inverse): waking the BLAS threads for it saves nothing, and a woken OpenBLAS
    thread then busy-waits for a while, taking a core from the next parallel section
    (measured: 35 ms of a 150 ms Nyström call after one small SVD).
    """
    control = (_blas_control() if array_api_compat.is_numpy_namespace(xp)
               and num_threads() > 1 else ())
    if not control:
        yield
        return
    with _one_blas_thread(control):
        yield


def owns_in_place(xp) -> bool:
    """Whether in-place updates of *our own* temporaries are safe and worth it.

    NumPy and CuPy have no autograd and pay a page-faulting allocation per large
    temporary; torch (autograd saves tensors), JAX (immutable) and others get the
    functional form.
    """
    return array_api_compat.is_numpy_namespace(xp) or array_api_compat.is_cupy_namespace(xp)


_IN_PLACE = {operator.add: operator.iadd, operator.sub: operator.isub,
             operator.mul: operator.imul, operator.truediv: operator.itruediv}


def update_(xp, a, op, b):
    """``op(a, b)`` (``operator.add``, ``sub``, ``mul`` or ``truediv``) for a temporary
    ``a`` that the caller owns: ``a op= b`` in place on NumPy and CuPy (no second
    ``a``-sized array), the functional form elsewhere."""
    return _IN_PLACE[op](a, b) if owns_in_place(xp) else op(a, b)


def exp_shifted_(xp, a, shift=None):
    """``exp(a - shift)`` for a temporary ``a`` that the caller owns (it may be consumed)."""
    if shift is not None:
        a = update_(xp, a, operator.sub, shift)
    return xp.exp(a, out=a) if owns_in_place(xp) else xp.exp(a)


def zero_where_(xp, a, mask):
    """``where(mask, 0, a)`` for a temporary ``a`` that the caller owns (set in place on
    NumPy and CuPy).  Not ``a * ~mask``: an inf in a masked place would give NaN."""
    if array_api_compat.is_numpy_namespace(xp):
        import numpy as np
        np.copyto(a, 0, where=mask)
        return a
    if array_api_compat.is_cupy_namespace(xp):  # pragma: no cover - needs a GPU
        import cupy
        cupy.copyto(a, 0, where=mask)
        return a
    return xp.where(mask, 0.0, a)


def split_rows(xp, n: int, *, row_bytes: int, align: int = 1) -> list[tuple[int, int]]:
    """Row ranges ``[(i0, i1), ...]`` covering ``range(n)``, for work on NumPy in
    cache-sized blocks spread over the threads; ``[(0, n)]`` for other libraries (which
    thread or fuse each operation themselves) and for small work.

    ``row_bytes`` is the size of one row of the largest temporary of a block (all batch
    elements).  Blocks hold about :data:`BLOCK_BYTES`, are at least one per thread, and
    every boundary but the last is a multiple of ``align`` (a chunk size).
    """
    threads = num_threads()
    if (not array_api_compat.is_numpy_namespace(xp) or getattr(_state, "inside", False)
            or n * row_bytes < MIN_WORK):
        return [(0, n)]
    units = -(-n // align)
    per_block = max(1, BLOCK_BYTES // max(1, row_bytes * align))   # in units of align
    blocks = min(units, max(threads, -(-units // per_block)))
    if blocks < 2:
        return [(0, n)]
    bounds = [min(n, (units * i // blocks) * align) for i in range(blocks + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def map_rows(xp, fn, blocks, *, blas: bool = True):
    """``concat([fn(rows) for rows in blocks], axis=-2)``: the row blocks ``(i0, i1)`` of
    :func:`split_rows` (or any consecutive ranges) computed by :func:`parallel_map` and put
    back together.

    On NumPy each worker copies its block into the result as soon as the block is done,
    while it is still in cache, instead of a serial concatenation afterwards (a pass over
    the whole output, and the page faults of a fresh array, on one core).
    """
    blocks = list(blocks)
    if len(blocks) == 1:
        return fn(blocks[0])
    if not array_api_compat.is_numpy_namespace(xp):
        return xp.concat(parallel_map(xp, fn, blocks, blas=blas), axis=-2)
    import numpy as np

    base, total = blocks[0][0], blocks[-1][1] - blocks[0][0]
    result: list = []
    first = threading.Lock()

    def run(rows):
        block = fn(rows)
        with first:
            if not result:
                result.append(np.empty((*block.shape[:-2], total, block.shape[-1]),
                                       dtype=block.dtype))
        result[0][..., rows[0] - base:rows[1] - base, :] = block

    parallel_map(xp, run, blocks, blas=blas)
    return result[0]


def cumulative_sum_(xp, x, *, axis: int):
    """Inclusive cumulative sum of a temporary ``x`` that the caller owns, along ``axis``.

    NumPy's ``cumsum`` along a non-last axis runs its inner loop across the strided axis
    (about 3x slower than adding whole slices); for NumPy the slices are added in place,
    one per position along ``axis`` (a loop over chunks, never over tokens).
    """
    if not array_api_compat.is_numpy_namespace(xp):
        return xp.cumulative_sum(x, axis=axis)
    moved = xp.moveaxis(x, axis, 0)
    for i in range(1, moved.shape[0]):
        moved[i] += moved[i - 1]
    return x
