"""The NumPy engine's workspace: its block temporaries kept from one call to the next.

Why: glibc's ``malloc`` (its defaults) gives a call's large temporaries back to the system
when they are freed -- allocations above its *mmap threshold* are unmapped, and the top of
the engine's worker threads' heaps is returned with ``madvise(MADV_DONTNEED)`` -- so the
next call touches fresh pages again, one page fault per 4 KiB: 20-50 % of a causal kernel,
Performer or sparse call at ``(1, 8, 4096, 64)`` (docs/conventions.rst, *Memory between
calls*).  The engine instead takes its block temporaries from a workspace that outlives
the call, so the second call of a shape runs on the first call's pages.

What it holds: per thread (each worker of the engine's pool and each calling thread) a
dict of byte buffers, one per *slot* (a temporary of a block, named by the engine) and
nesting depth, each grown to the largest size asked for -- so sized by the calls made.
Buffers that must outlive one block (a block's results read by a second pass) are held
in the calling thread's workspace, one per block.  Nothing the caller receives is ever a
workspace buffer: results are fresh arrays.

Bound: after each top-level map, where the workspaces of all threads together hold more
than :func:`workspace_limit` bytes (``ARRAYATTN_WORKSPACE_MB``, default 1 GiB;
:func:`set_workspace_limit`), they are all released, so a one-off huge call does not pin
its memory (it runs as without a workspace).
:func:`release_workspace` releases everything now.
"""
from __future__ import annotations

import math
import os
import threading
import weakref

import numpy as np

__all__ = ["release_workspace", "set_workspace_limit", "workspace_limit", "workspace_bytes",
           "Workspace", "space", "buffer", "trim", "DEFAULT_LIMIT_MB"]

#: The workspaces' bound when ``ARRAYATTN_WORKSPACE_MB`` is not set, in MiB.
DEFAULT_LIMIT_MB = 1024

_local = threading.local()
_spaces: weakref.WeakSet = weakref.WeakSet()   # every live thread's workspace
_guard = threading.Lock()                      # _spaces and _limit
_limit: int | None = None                      # set_workspace_limit's, or the env's


class Workspace(dict):
    """One thread's buffers: ``key -> 1-d uint8 array`` (a dict that can be weakly
    referenced, so a finished thread's workspace is freed with it; compared and hashed
    by identity, as :data:`_spaces` needs)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__

    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in list(self.values()))


def space() -> Workspace:
    """This thread's workspace (made on first use)."""
    ws = getattr(_local, "space", None)
    if ws is None:
        ws = _local.space = Workspace()
        with _guard:
            _spaces.add(ws)
    return ws


def buffer(ws: Workspace, key, shape, dtype) -> np.ndarray:
    """An uninitialised array of ``shape`` and ``dtype`` on the buffer ``key`` of ``ws``
    (grown when too small; any dtype: the buffer is bytes)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = ws.get(key)
    if buf is None or buf.nbytes < nbytes:
        ws.pop(key, None)      # the old buffer goes before the new one is made
        buf = ws[key] = np.empty(max(nbytes, 1), dtype=np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def workspace_bytes() -> int:
    """Bytes the engine's workspaces hold now, all threads together."""
    with _guard:
        spaces = list(_spaces)
    return sum(ws.nbytes() for ws in spaces)


def workspace_limit() -> int:
    """The bound in bytes (:func:`set_workspace_limit`, else ``ARRAYATTN_WORKSPACE_MB``
    MiB, else :data:`DEFAULT_LIMIT_MB` MiB)."""
    if _limit is not None:
        return _limit
    env = os.environ.get("ARRAYATTN_WORKSPACE_MB", "").strip()
    if not env:
        return DEFAULT_LIMIT_MB << 20
    try:
        value = float(env)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"ARRAYATTN_WORKSPACE_MB must be a non-negative number of MiB; got {env!r}")
    return int(value * (1 << 20))


def set_workspace_limit(nbytes: int | None) -> int:
    """Bound the memory the NumPy engine keeps between calls.

    The engine keeps its block temporaries in a workspace per thread, reused by the next
    call (see :func:`release_workspace`).  After each call, where the workspaces of all
    threads together hold more than the bound, they are all released: a call that needs
    more runs as the engine did before it had a workspace.

    Parameters
    ----------
    nbytes : int or None
        The bound in bytes; ``0`` keeps nothing between calls.  ``None`` goes back to the
        environment variable ``ARRAYATTN_WORKSPACE_MB`` (MiB), or 1 GiB where it is not
        set.  Applied at once: buffers over a lowered bound are released now.

    Returns
    -------
    int
        The previous bound in bytes.

    Examples
    --------
    >>> import arrayattn
    >>> previous = arrayattn.set_workspace_limit(64 << 20)   # keep at most 64 MiB
    >>> _ = arrayattn.set_workspace_limit(previous)
    """
    global _limit
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) \
                or nbytes < 0:
            raise ValueError(
                f"set_workspace_limit: nbytes must be a non-negative integer or None; "
                f"got {nbytes!r}")
        nbytes = int(nbytes)
    previous = workspace_limit()
    with _guard:
        _limit = nbytes
    trim()
    return previous


def release_workspace() -> int:
    """Release the memory the NumPy engine keeps between calls.

    With glibc's default ``malloc`` a large temporary freed at the end of a call goes
    back to the system, and the next call faults its pages in again, one per 4 KiB
    (20-50 % of a causal kernel, Performer or sparse call at ``(1, 8, 4096, 64)``).  The
    NumPy engine therefore takes its block temporaries -- per-thread scratch buffers
    (score tiles, gathered keys, features of a block) and the per-block results a
    second pass reads (a causal kernel's chunk states, a sparse chunk's output) -- from
    a workspace per thread (each worker of its pool and each calling thread) that
    outlives the call, each buffer grown to the largest size asked for.  At
    ``(1, 8, n, 64)`` float32 it holds 8-50 MiB after a kernel, sparse, Poolingformer,
    LSH or Nyström call at ``n = 4096`` (91 MiB after causal Performer, m = 256),
    20-130 MiB at ``n = 16384`` (563-585 MiB after causal Performer).  It is bounded
    (:func:`set_workspace_limit`, 1 GiB by default); this function drops it now, e.g. after a burst of large calls.  The next
    call allocates afresh.

    Results handed to the caller are never workspace memory: releasing changes no
    array the caller holds, and a later call never overwrites an earlier result.

    Returns
    -------
    int
        The bytes released.

    Examples
    --------
    >>> import arrayattn
    >>> freed = arrayattn.release_workspace()
    >>> arrayattn.release_workspace()
    0
    """
    with _guard:
        spaces = list(_spaces)
    freed = 0
    for ws in spaces:
        freed += ws.nbytes()
        ws.clear()
    return freed


def trim() -> None:
    """Where all threads' workspaces together hold more than the bound, release them
    all (called after each top-level map of the engine): a call larger than the bound
    runs as without a workspace.  Measured (causal Performer with hyperbolic features at
    n = 16384, 563 MiB of temporaries, page faults a call): keeping the scratch buffers
    and releasing the rest 73-105k, releasing all 44-76k, e6332e9 30-57k (the cause of
    the remaining gap is not found; docs/conventions.rst)."""
    if workspace_bytes() > workspace_limit():
        release_workspace()


def _after_fork_child():
    global _local, _spaces, _guard
    _local = threading.local()
    _spaces = weakref.WeakSet()
    _guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_child)
