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
import math
import operator
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import array_api_compat

__all__ = ["num_threads", "parallel_map", "blas_single", "split_rows", "map_rows",
           "scratch", "matmul_into", "owns_in_place", "update_", "exp_shifted_",
           "fill_where_", "zero_where_", "reduce_axis", "cumulative_sum_"]

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

_state = threading.local()   # .inside: a worker of parallel_map; .scratch: its buffers
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


def _as_worker(fn, buffers: dict):
    """``fn`` run as a worker of one :func:`parallel_map` call: nested calls run serially,
    and :func:`scratch` hands out this thread's buffers of ``buffers`` (dropped with the
    call, so no memory outlives it)."""
    def run(item):
        _state.inside = True
        _state.scratch = buffers.setdefault(threading.get_ident(), {})
        try:
            return fn(item)
        finally:
            _state.inside, _state.scratch = False, None
    return run


def _serial(fn, items, numpy: bool) -> list:
    """``[fn(item) for item in items]`` with fresh :func:`scratch` buffers on NumPy (a
    nested call must not hand out the buffers its caller is using)."""
    saved = getattr(_state, "scratch", None)
    _state.scratch = {} if numpy else None
    try:
        return [fn(item) for item in items]
    finally:
        _state.scratch = saved


def parallel_map(xp, fn, items, *, blas: bool = True) -> list:
    """``[fn(item) for item in items]``, in threads when ``xp`` is NumPy.

    ``fn`` must only read shared arrays and return new ones (no writes to anything another
    item reads).  ``blas=True`` when ``fn`` calls matmuls: the threaded path then holds the
    BLAS to one thread while it runs (and is skipped when the BLAS cannot be told, since
    oversubscribed OpenBLAS threads are slower than one stream); ``blas=False`` for
    elementwise-only work.  A call from inside a worker runs serially.  Inside ``fn``,
    :func:`scratch` gives buffers that the items run by one thread share.
    """
    items = list(items)
    workers = min(num_threads(), len(items))
    numpy = array_api_compat.is_numpy_namespace(xp)
    if workers < 2 or not numpy or getattr(_state, "inside", False):
        return _serial(fn, items, numpy)
    control = _blas_control() if blas else ()
    if blas and not control:
        return _serial(fn, items, numpy)
    with _one_blas_thread(control):
        return list(_executor(workers).map(_as_worker(fn, {}), items))


def scratch(xp, shape, dtype, slot: str):
    """A buffer of ``shape`` and ``dtype`` that every item one thread runs in the current
    :func:`parallel_map` call reuses (NumPy), or ``None`` (other libraries, or outside a
    call): then the caller makes a fresh array as usual.

    Why: a fresh block-sized temporary is fresh memory -- the allocator returns a freed
    block of this size to the system, and the next one pays a page fault per 4 KiB on
    first touch (measured: the block matmuls of a Nyström pass ran at half speed).
    ``slot`` names the buffer; a block must not return it, nor use one slot twice at once.
    """
    buffers = getattr(_state, "scratch", None)
    if buffers is None or not array_api_compat.is_numpy_namespace(xp):
        return None
    size = math.prod(shape)
    buf = buffers.get(slot)
    if buf is None or buf.size < size or buf.dtype != dtype:
        buf = buffers[slot] = xp.empty(size, dtype=dtype)
    return xp.reshape(buf[:size], shape)


def matmul_into(xp, a, b, out=None):
    """``a @ b``, written into ``out`` when it is an array (NumPy: ``matmul(out=)``, no
    fresh result), or into the :func:`scratch` buffer named ``out`` when it is a string;
    a fresh array when neither is available."""
    if isinstance(out, str):
        shape = (*broadcast_shape(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
        out = scratch(xp, shape, a.dtype, out)
    if out is None:
        return a @ b
    import numpy as np
    return np.matmul(a, b, out=out)


def broadcast_shape(s1, s2) -> tuple:
    """The broadcast of two shapes (shapes only: no arrays of any library)."""
    import numpy as np
    return tuple(np.broadcast_shapes(tuple(s1), tuple(s2)))


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


def fill_where_(xp, a, mask, value: float):
    """``where(mask, value, a)`` for a temporary ``a`` that the caller owns (set in place on
    NumPy and CuPy; ``mask`` broadcasts against ``a``)."""
    if array_api_compat.is_numpy_namespace(xp):
        import numpy as np
        if mask.ndim == a.ndim and mask.shape[-1] == 1 < a.shape[-1]:
            # Whole rows: indexing by the row mask touches only the masked rows (7x
            # faster than copyto, which tests every element, at 10% masked).
            a[np.broadcast_to(mask[..., 0], a.shape[:-1])] = value
        else:
            np.copyto(a, value, where=mask)
        return a
    if array_api_compat.is_cupy_namespace(xp):  # pragma: no cover - needs a GPU
        import cupy
        cupy.copyto(a, value, where=mask)
        return a
    return xp.where(mask, value, a)


def zero_where_(xp, a, mask):
    """``where(mask, 0, a)`` for a temporary ``a`` that the caller owns.  Not
    ``a * ~mask``: an inf in a masked place would give NaN."""
    return fill_where_(xp, a, mask, 0.0)


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


def map_rows(xp, fn, blocks, *, shape, dtype, blas: bool = True):
    """``concat([fn(rows, None) for rows in blocks], axis=-2)``: the row blocks ``(i0, i1)``
    of :func:`split_rows` (or any consecutive ranges) of a result of ``shape`` and
    ``dtype``, computed by :func:`parallel_map` and put together.

    On NumPy each call gets ``out``, the block's place in the result: ``fn`` may write
    its block there (a ``matmul_into``, then in-place updates) and return ``out``, with no
    block-sized temporary at all; a block it returns otherwise is copied in while it is
    still in cache (not in a serial concatenation afterwards, a pass over the whole
    output on one core).  Elsewhere ``out`` is ``None``.
    """
    blocks = list(blocks)
    if len(blocks) == 1:
        return fn(blocks[0], None)
    if not array_api_compat.is_numpy_namespace(xp):
        return xp.concat(parallel_map(xp, lambda rows: fn(rows, None), blocks, blas=blas),
                         axis=-2)
    result = xp.empty(tuple(shape), dtype=dtype)
    base = blocks[0][0]

    def run(rows):
        place = result[..., rows[0] - base:rows[1] - base, :]
        block = fn(rows, place)
        if block is not place:
            place[...] = block

    parallel_map(xp, run, blocks, blas=blas)
    return result


#: Row length :func:`reduce_axis` aims at when it views rows of a NumPy array as one.
REDUCE_ROW = 2048


def reduce_axis(xp, reduce, x, axis: int):
    """``reduce(x, axis=axis, keepdims=True)`` for ``reduce`` = ``xp.max`` or ``xp.sum``.

    NumPy reduces over the second-last axis of a C-contiguous array one short row at a
    time (a loop call per row of ``c`` elements: ~2.5x slower than a long row, measured
    at ``c = 64``).  There the array ``(..., r, c)`` is viewed as ``(..., r/g, g c)`` --
    ``g`` consecutive rows as one long row, a free reshape when the last two axes are
    contiguous -- reduced over its rows, and
    the ``g`` partial results then reduced: the same maximum, and a sum in another order.
    """
    if (x.ndim < 2 or axis not in (-2, x.ndim - 2)
            or not array_api_compat.is_numpy_namespace(xp)
            or x.strides[-1] != x.itemsize or x.strides[-2] != x.shape[-1] * x.itemsize):
        return reduce(x, axis=axis, keepdims=True)
    r, c = x.shape[-2], x.shape[-1]
    g = max(1, min(r, REDUCE_ROW // max(1, c)))
    while r % g:  # the largest group size up to the target that divides the rows
        g -= 1
    if g < 4:
        return reduce(x, axis=-2, keepdims=True)
    lead = x.shape[:-2]
    partial = reduce(xp.reshape(x, (*lead, r // g, g * c)), axis=-2, keepdims=True)
    return reduce(xp.reshape(partial, (*lead, g, c)), axis=-2, keepdims=True)


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
