"""The NumPy engine's workspace (:mod:`arrayattn._numpy.workspace`): block temporaries
kept from one call to the next (so that a default glibc process does not fault them in
again every call), per thread, bounded, released on demand, never handed to the caller.

Every test here fails on the engine before the workspace (d8d730a): there the buffers
were dropped with each map (no reuse across calls), and ``release_workspace`` /
``set_workspace_limit`` did not exist."""
from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

import arrayattn
from arrayattn._numpy import parallel, workspace

from conftest import make_qkv

#: (variant, options): a causal kernel (held chunk states, features in the workspace),
#: a causal Performer, a non-causal kernel, sparse patterns (held chunk outputs) and
#: Poolingformer (its pooled rows and level-2 output in the calling thread's workspace).
CALLS = [("linear_elu", {"causal": True}), ("linear_cosine", {"causal": True}),
         ("performer_positive", {"causal": True}), ("linear_relu", {}),
         ("local", {"causal": True}), ("bigbird", {}),
         ("poolingformer", {"window": 32, "pool_window": 64})]   # own() and into=


@pytest.fixture(autouse=True)
def fresh_workspace(monkeypatch):
    # small sparse chunks: several per call, their outputs in held buffers
    monkeypatch.setattr(arrayattn.core.devices, "CPU_CHUNK", 1 << 12)
    arrayattn.release_workspace()
    previous = arrayattn.set_workspace_limit(None)
    yield
    arrayattn.set_workspace_limit(previous if previous != workspace.DEFAULT_LIMIT_MB << 20
                                  else None)
    arrayattn.release_workspace()


def _inputs(rng, n=256):
    return [x.astype(np.float32) for x in make_qkv(rng, batch=(2,), n=n, d=16, norm=4.0)]


def _call(name, opts, q, k, v):
    with parallel.split_everything(2, units=2), arrayattn.use_engine("numpy"):
        return arrayattn.get_variant(name)(q, k, v, **opts)


def _buffers(sizes: bool = False):
    """Every workspace buffer of every thread: ``{(id(space), key): address}`` (``(address,
    bytes)`` with ``sizes``)."""
    with workspace._guard:
        spaces = list(workspace._spaces)
    return {(id(ws), key): (buf.__array_interface__["data"][0], buf.nbytes) if sizes
            else buf.__array_interface__["data"][0]
            for ws in spaces for key, buf in list(ws.items())}


def _all_arrays():
    with workspace._guard:
        spaces = list(workspace._spaces)
    return [buf for ws in spaces for buf in list(ws.values())]


@pytest.mark.parametrize("name, opts", CALLS, ids=[n for n, _ in CALLS])
def test_buffers_reused_across_calls(rng, name, opts):
    """A second call of the same shape runs on the first call's buffers: every buffer
    still there at the same address (before the workspace each map's buffers were
    dropped with it, so nothing stayed between calls).  A thread that ran no item of a
    map in the first call may add its own buffers in the second, and one that runs a
    larger block than before grows its buffer (the pool hands blocks to whichever thread
    is free; seen under xdist): a buffer is the same or larger, never made again at its
    size."""
    q, k, v = _inputs(rng)
    _call(name, opts, q, k, v)
    first = _buffers(sizes=True)
    assert first and workspace.workspace_bytes() > 0
    assert any(key[0] == "held" for _, key in first) or not opts   # a pass's results
    _call(name, opts, q, k, v)
    second = _buffers(sizes=True)
    assert first.keys() <= second.keys()
    for key, (address, size) in first.items():
        assert second[key] == (address, size) or second[key][1] > size, key
    assert sum(second[key] == first[key] for key in first) >= len(first) // 2


@pytest.mark.parametrize("name, opts", CALLS, ids=[n for n, _ in CALLS])
def test_results_never_workspace_memory(rng, name, opts):
    """The result shares no memory with any workspace buffer; mutating it changes no
    later call, and a later call (other inputs) leaves it as it was."""
    q, k, v = _inputs(rng)
    first = _call(name, opts, q, k, v)
    assert not any(np.shares_memory(first, buf) for buf in _all_arrays())
    kept = first.copy()
    first[...] = np.nan                                   # the caller owns its result
    again = _call(name, opts, q, k, v)
    np.testing.assert_array_equal(again, kept)
    other = _call(name, opts, q[..., ::-1, :].copy(), k, v)
    np.testing.assert_array_equal(again, kept)            # not overwritten by the next call
    assert not np.array_equal(other, kept)
    assert not np.shares_memory(again, other)


@pytest.mark.parametrize("name, opts", CALLS, ids=[n for n, _ in CALLS])
def test_same_bits_with_and_without_workspace(rng, name, opts):
    """The workspace changes where temporaries live, not what is computed: the first
    call, a call on reused buffers and a call that keeps nothing (bound 0: fresh
    temporaries every call, as before the workspace) agree bit for bit."""
    q, k, v = _inputs(rng)
    first = _call(name, opts, q, k, v)
    reused = _call(name, opts, q, k, v)
    arrayattn.set_workspace_limit(0)
    fresh = _call(name, opts, q, k, v)
    assert workspace.workspace_bytes() == 0
    np.testing.assert_array_equal(reused, first)
    np.testing.assert_array_equal(fresh, first)


def test_release_drops_everything(rng):
    q, k, v = _inputs(rng)
    _call("linear_elu", {"causal": True}, q, k, v)
    held = workspace.workspace_bytes()
    assert held > 0
    assert arrayattn.release_workspace() == held
    assert workspace.workspace_bytes() == 0 and not _buffers()
    assert arrayattn.release_workspace() == 0
    _call("linear_elu", {"causal": True}, q, k, v)      # and the engine works on
    assert workspace.workspace_bytes() > 0


def test_bound_respected(rng):
    """After a call the workspaces hold at most the bound (a call over it releases them
    all: it runs as without a workspace); lowering the bound applies at once; 0 keeps
    nothing."""
    q, k, v = _inputs(rng, n=512)
    _call("performer_positive", {"causal": True}, q, k, v)
    unbounded = workspace.workspace_bytes()
    limit = unbounded - 1
    arrayattn.set_workspace_limit(limit)
    assert workspace.workspace_bytes() == 0              # over the lowered bound: released
    _call("performer_positive", {"causal": True}, q, k, v)
    assert workspace.workspace_bytes() <= limit
    arrayattn.set_workspace_limit(2 * unbounded)   # (another thread may add its own)
    _call("performer_positive", {"causal": True}, q, k, v)
    assert 0 < workspace.workspace_bytes() <= 2 * unbounded
    assert arrayattn.set_workspace_limit(0) == 2 * unbounded
    assert workspace.workspace_bytes() == 0
    _call("performer_positive", {"causal": True}, q, k, v)
    assert workspace.workspace_bytes() == 0


def test_limit_from_environment(monkeypatch):
    monkeypatch.setenv("ARRAYATTN_WORKSPACE_MB", "1.5")
    assert workspace.workspace_limit() == 3 << 19
    monkeypatch.setenv("ARRAYATTN_WORKSPACE_MB", "lots")
    with pytest.raises(ValueError, match="ARRAYATTN_WORKSPACE_MB"):
        workspace.workspace_limit()
    monkeypatch.delenv("ARRAYATTN_WORKSPACE_MB")
    assert workspace.workspace_limit() == workspace.DEFAULT_LIMIT_MB << 20
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="nbytes"):
            arrayattn.set_workspace_limit(bad)


def test_threads_never_share_buffers():
    """The pool's workers and two user threads mapping at once each get their own
    buffers (one item runs on one thread at a time: a thread's buffer is never used by
    two items at once)."""
    def item(i):
        buf = parallel.scratch((64,), np.float32, "x")
        buf[...] = i
        return threading.get_ident(), buf.__array_interface__["data"][0], buf.sum() == 64 * i

    with parallel.split_everything(2):
        seen = parallel.parallel_map(item, range(8))
    assert all(ok for _, _, ok in seen)
    addresses = {}
    for ident, address, _ in seen:
        addresses.setdefault(ident, set()).add(address)
    assert all(len(a) == 1 for a in addresses.values())   # one buffer per thread ...
    assert len({a for s in addresses.values() for a in s}) == len(addresses)  # ... its own

    barrier, found = threading.Barrier(2), {}

    def user(name):
        def serial(i):
            buf = parallel.scratch((1024,), np.float64, "x")
            buf[...] = hash(name) % 1000
            barrier.wait(timeout=10)
            return buf.__array_interface__["data"][0], bool((buf == hash(name) % 1000).all())
        with parallel.split_everything(1):                # serial: the user thread's own
            found[name] = parallel.parallel_map(serial, [0], blas=False)[0]

    threads = [threading.Thread(target=user, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found["a"][1] and found["b"][1]
    assert found["a"][0] != found["b"][0]


def test_nested_map_and_held_outside_a_map():
    """A nested map's buffers are not its caller's; outside a map scratch and held
    buffers are fresh arrays."""
    def outer(i):
        mine = parallel.scratch((16,), np.float32, "x")
        inner = parallel.parallel_map(
            lambda j: np.shares_memory(parallel.scratch((16,), np.float32, "x"), mine),
            range(2), blas=False)
        return any(inner)

    with parallel.split_everything(2):
        assert not any(parallel.parallel_map(outer, range(2), blas=False))
    a, b = (parallel.held((8,), np.float32, "x") for _ in range(2))
    assert not np.shares_memory(a, b)
    assert not np.shares_memory(parallel.scratch((8,), np.float32, "x"),
                                parallel.scratch((8,), np.float32, "x"))


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin",
                    reason="fork: Linux only here")
def test_forked_child_starts_empty(rng):
    q, k, v = _inputs(rng)
    expected = _call("linear_elu", {"causal": True}, q, k, v)
    assert workspace.workspace_bytes() > 0
    pid = os.fork()
    if pid == 0:   # the child: an empty workspace, and the engine works (same bits)
        ok = workspace.workspace_bytes() == 0
        ok = ok and np.array_equal(_call("linear_elu", {"causal": True}, q, k, v), expected)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
