"""The NumPy engine's thread map (:mod:`arrayattn._numpy.parallel`), and the two
process-level promises it carries: a call gives the same bits whatever other threads
are doing, and a process that forks while another thread is inside a call has a
working child."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import arrayattn
from arrayattn._numpy import parallel

from conftest import make_qkv


class TestSplitRows:
    @pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
    @pytest.mark.parametrize("align", [1, 3, 64])
    def test_covers_rows_aligned(self, n, align):
        with parallel.split_everything(2):
            blocks = parallel.split_rows(n, row_bytes=8, align=align)
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        for (a0, a1), (b0, _) in zip(blocks, blocks[1:]):
            assert a1 == b0 and a1 > a0 and a1 % align == 0
        assert len(blocks) == -(-n // align)   # one row (or chunk) per block

    def test_cache_sized_blocks(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
        blocks = parallel.split_rows(16384, row_bytes=2048)
        assert max(b - a for a, b in blocks) * 2048 <= parallel.BLOCK_BYTES
        assert len(blocks) == 16384 * 2048 // parallel.BLOCK_BYTES

    @pytest.mark.parametrize("threads", [2, 3, 4])
    @pytest.mark.parametrize("n,row_bytes,align", [
        (4096, 8 * 65 * 4 + 4 * 8 * 64, 64),    # the causal kernel's blocks at n = 4096
        (16384, 8 * 65 * 4, 1),                 # its non-causal blocks at n = 16384
        (1000, 5000, 7)])
    def test_whole_blocks_per_thread(self, monkeypatch, threads, n, row_bytes, align):
        """The block count is a multiple of the threads (the map hands out blocks as
        threads free up: 5 equal blocks on 2 threads take the time of 6), each block
        within BLOCK_BYTES (up to one chunk of rounding), all rows covered, aligned."""
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", str(threads))
        blocks = parallel.split_rows(n, row_bytes=row_bytes, align=align)
        assert len(blocks) % threads == 0
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        assert all(a1 == b0 and a1 % align == 0 for (_, a1), (b0, _) in
                   zip(blocks, blocks[1:]))
        assert max(b - a for a, b in blocks) * row_bytes <= parallel.BLOCK_BYTES \
            + align * row_bytes

    def test_blocks_of_units(self):
        with parallel.split_everything(2, units=3):
            blocks = parallel.split_rows(64, row_bytes=8, align=4)   # 16 chunks of 4
        assert len(blocks) % 2 == 0 and {b - a for a, b in blocks} <= {8, 12}

    def test_small_work_one_block(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
        assert parallel.split_rows(100, row_bytes=64) == [(0, 100)]

    def test_bad_thread_count(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "zero")
        with pytest.raises(ValueError, match="ARRAYATTN_NUM_THREADS"):
            parallel.num_threads()


class TestMaps:
    def test_parallel_map_in_threads_and_nested_serial(self):
        with parallel.split_everything(2):
            names = parallel.parallel_map(
                lambda i: threading.current_thread().name, range(4), blas=False)
            assert all(n.startswith("arrayattn") for n in names)
            inner = parallel.parallel_map(
                lambda i: parallel.parallel_map(
                    lambda j: threading.current_thread().name, range(2), blas=False),
                range(2), blas=False)
            assert all(len(set(x)) == 1 for x in inner)   # nested: serial in the worker

    def test_map_rows_in_place(self):
        x = np.arange(2 * 10 * 3.0).reshape(2, 10, 3)
        with parallel.split_everything(2):
            out = parallel.map_rows(lambda r, out: np.multiply(x[:, r[0]:r[1]], 3, out=out),
                                    [(0, 4), (4, 10)], shape=x.shape, dtype=x.dtype)
        np.testing.assert_array_equal(out, 3 * x)

    def test_scratch_per_thread_and_fresh_outside(self):
        assert parallel.scratch((2, 3), np.float32, "a").shape == (2, 3)

        def item(i):
            a = parallel.scratch((4, 5), np.float32, "a")
            b = parallel.scratch((4, 5), np.float32, "b")
            assert not np.shares_memory(a, b)
            return threading.get_ident(), a.__array_interface__["data"][0]

        with parallel.split_everything(2):
            seen = parallel.parallel_map(item, range(6))
        by_thread = {}
        for ident, address in seen:
            by_thread.setdefault(ident, set()).add(address)
        assert all(len(a) == 1 for a in by_thread.values())

    def test_blas_restored_after_error(self):
        control = parallel._blas_control()
        if not control:
            pytest.skip("the BLAS thread count cannot be controlled here (not OpenBLAS)")
        before = control[1]()

        def boom(i):
            raise RuntimeError("x")

        with parallel.split_everything(2), pytest.raises(RuntimeError):
            parallel.parallel_map(boom, range(2))
        assert control[1]() == before

    @pytest.mark.parametrize("reduce", [np.max, np.sum])
    def test_reduce_rows(self, reduce, rng):
        x = rng.standard_normal((3, 256, 64))
        np.testing.assert_allclose(parallel.reduce_rows(reduce, x),
                                   reduce(x, axis=-2, keepdims=True), rtol=1e-12)

    def test_cumsum(self, rng):
        x = rng.standard_normal((5, 4, 3))
        np.testing.assert_allclose(parallel.cumsum_(x.copy(), axis=0), np.cumsum(x, axis=0))


def test_svd_pinv_split_equals_whole(rng):
    """The NumPy engine's SVD pinv: groups of whole matrices in threads, each SVD the
    same call, bit for bit."""
    from arrayattn._numpy import linalg as engine
    from arrayattn._numpy.parallel import split_everything, split_rows
    a = rng.standard_normal((3, 4, 6, 5)).astype(np.float32)
    rtol = 6 * float(np.finfo(np.float32).eps)
    whole = engine.pinv_svd(a, rtol)
    with split_everything(2):
        assert len(split_rows(12, row_bytes=4 * 6 * 5 * 5)) > 1
        split = engine.pinv_svd(a, rtol)
    assert split.shape == (3, 4, 5, 6)
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(whole, np.linalg.pinv(a, rtol=rtol))


@pytest.mark.parametrize("init", ["per_matrix", "global"])
def test_razavi_pinv_split_equals_reference(rng, init):
    """The NumPy engine's iterative pinv: the start made on the whole batch (the global
    start's maxima over all heads), then groups of whole matrices in threads, each
    running the reference's products: the reference's result bit for bit."""
    from arrayattn import reference
    from arrayattn._numpy import linalg as engine
    from arrayattn._numpy.parallel import split_everything, split_rows
    # heads of very different sharpness: a global start differs from per-matrix ones
    a = rng.standard_normal((3, 4, 6, 5)) * rng.uniform(0.1, 10.0, (3, 4, 1, 1))
    a = a.astype(np.float32)
    ref = reference.pinv_razavi(a, 7, init)
    with split_everything(2):
        assert len(split_rows(12, row_bytes=4 * 6 * 5 * 6)) > 1
        split = engine.pinv_razavi(a, 7, init)
    assert split.shape == (3, 4, 5, 6)
    np.testing.assert_array_equal(split, ref)
    np.testing.assert_array_equal(engine.pinv_razavi(a, 7, init), ref)
    other = reference.pinv_razavi(a, 7, "global" if init == "per_matrix" else "per_matrix")
    assert not np.array_equal(split, other)   # the start's rule reaches the groups


@pytest.mark.parametrize("causal", [False, True])
def test_blockwise_exact_split_is_bit_identical(rng, causal):
    """Blockwise exact attention splits whole query blocks over threads: every output
    row is the same computation, bit for bit, however the blocks are spread."""
    from conftest import implementation
    q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 3), n=96, d=16,
                                                      norm=8.0, sharp=True))
    rec = arrayattn.get_variant("softmax_blockwise")
    with implementation("engine"):
        whole = rec(q, k, v, block_size=16, causal=causal)
    with implementation("engine_split"):
        split = rec(q, k, v, block_size=16, causal=causal)
    np.testing.assert_array_equal(split, whole)


RECORDS = arrayattn.variants()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rec", RECORDS, ids=[r.name for r in RECORDS])
def test_concurrent_calls_bit_identical(rec, rng, causal):
    """The same call from 4 Python threads at once gives the serial call's bits (the
    engine split over threads, BLAS thread count changed inside its sections: the
    measured cause of performer_trig's 1.5e3 differences was a full-size matmul outside
    a section while another call's section held the BLAS to one thread)."""
    if causal and not rec.causal:
        pytest.skip(f"{rec.name} cannot be causal")
    opts = {"causal": True} if causal else {}
    q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2,), n=192, d=32,
                                                      norm=6.0))
    with parallel.split_everything(2), arrayattn.use_engine("numpy"):
        serial = rec(q, k, v, **opts)
    results, errors = [None] * 4, []

    def worker(i):
        try:
            with parallel.split_everything(2), arrayattn.use_engine("numpy"):
                for _ in range(3):
                    results[i] = rec(q, k, v, **opts)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for out in results:
        assert np.array_equal(out, serial, equal_nan=True)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
@pytest.mark.parametrize("name", ["softmax_blockwise", "nystrom_iterative", "linear_elu",
                                  "performer_positive"])
def test_fork_while_another_thread_is_inside_a_call(name, rng):
    """A child forked while another thread runs arrayattn (the pool busy, the BLAS held
    to one thread) finishes its own call within seconds."""
    rec = arrayattn.get_variant(name)
    q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2,), n=1024, d=64))
    stop = threading.Event()

    def busy():
        with parallel.split_everything(2), arrayattn.use_engine("numpy"):
            while not stop.is_set():
                rec(q, k, v)

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    time.sleep(0.2)
    try:
        pid = os.fork()
        if pid == 0:  # the child: one call, split over threads, then leave
            try:
                with parallel.split_everything(2), arrayattn.use_engine("numpy"):
                    out = rec(q[:, :64], k[:, :64], v[:, :64])
                os._exit(0 if np.isfinite(out).all() else 3)
            except BaseException:  # pragma: no cover - the child reports by exit code
                os._exit(4)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child of {name} hung (> 60 s)")
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stop.set()
        thread.join()
