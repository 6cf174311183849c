"""The NumPy thread map and the in-place helpers of ``arrayattn._parallel``.

Every variant's own tests already run the split path: the ``numpy_readonly`` backend
forces it (conftest.force_threaded).  Here: the pieces themselves, and that splitting
never changes a result beyond the rounding of a reordered sum (exact attention: not at
all).
"""
from __future__ import annotations

import threading

import array_api_compat.numpy as xp
import numpy as np
import pytest
from conftest import force_threaded, make_qkv

import arrayattn
from arrayattn import _parallel


class TestSplitRows:
    @pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
    @pytest.mark.parametrize("align", [1, 3, 64])
    def test_covers_rows_aligned(self, monkeypatch, n, align):
        force_threaded(monkeypatch)
        blocks = _parallel.split_rows(xp, n, row_bytes=8, align=align)
        assert blocks[0][0] == 0 and blocks[-1][1] == n
        for (a0, a1), (b0, _) in zip(blocks, blocks[1:]):
            assert a1 == b0 and a1 > a0 and a1 % align == 0
        # BLOCK_BYTES = 1: one row (or chunk) per block
        assert len(blocks) == -(-n // align)

    def test_cache_sized_blocks(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
        blocks = _parallel.split_rows(xp, 16384, row_bytes=2048)
        sizes = {b - a for a, b in blocks}
        assert max(sizes) * 2048 <= _parallel.BLOCK_BYTES
        assert len(blocks) == 16384 * 2048 // _parallel.BLOCK_BYTES

    def test_small_work_and_other_libraries_one_block(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "2")
        assert _parallel.split_rows(xp, 100, row_bytes=64) == [(0, 100)]
        strict = pytest.importorskip("array_api_strict")
        assert _parallel.split_rows(strict, 1 << 20, row_bytes=1 << 20) == [(0, 1 << 20)]

    def test_one_thread_serial_but_cache_sized(self, monkeypatch):
        # One thread: still cache-sized blocks, run in the calling thread.
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "1")
        blocks = _parallel.split_rows(xp, 1 << 16, row_bytes=1 << 12)
        assert len(blocks) == (1 << 28) // _parallel.BLOCK_BYTES
        assert _parallel.parallel_map(xp, lambda i: threading.current_thread().name,
                                      range(3)) == [threading.current_thread().name] * 3

    def test_bad_thread_count(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "two")
        with pytest.raises(ValueError, match="ARRAYATTN_NUM_THREADS"):
            _parallel.num_threads()


class TestParallelMap:
    def test_order_and_threads(self, monkeypatch):
        force_threaded(monkeypatch)
        names = _parallel.parallel_map(
            xp, lambda i: (i, threading.current_thread().name), range(6), blas=False)
        assert [i for i, _ in names] == list(range(6))
        assert all(name.startswith("arrayattn") for _, name in names)

    @pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
    def test_forked_child_gets_its_own_pool(self, monkeypatch):
        import os
        force_threaded(monkeypatch)
        _parallel.parallel_map(xp, lambda i: i, range(2), blas=False)  # pool exists
        pid = os.fork()
        if pid == 0:  # child: the inherited pool has no threads; a hang fails by timeout
            ok = _parallel.parallel_map(xp, lambda i: i * 2, range(4), blas=False)
            os._exit(0 if ok == [0, 2, 4, 6] else 1)
        import time
        for _ in range(200):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            pytest.fail("parallel_map hung in a forked child")
        assert os.waitstatus_to_exitcode(status) == 0

    def test_nested_runs_serially(self, monkeypatch):
        force_threaded(monkeypatch)

        def outer(i):
            inner = _parallel.parallel_map(
                xp, lambda j: threading.current_thread().name, range(2), blas=False)
            return len(set(inner)) == 1 and inner[0] == threading.current_thread().name
        assert all(_parallel.parallel_map(xp, outer, range(4), blas=False))

    def test_blas_threads_restored_even_on_error(self, monkeypatch):
        force_threaded(monkeypatch)
        control = _parallel._blas_control()
        if not control:
            pytest.skip("NumPy's BLAS is not an OpenBLAS this module can steer")
        before = control[1]()
        seen = _parallel.parallel_map(xp, lambda i: control[1](), range(2))
        assert seen == [1, 1]
        assert control[1]() == before

        def boom(i):
            raise RuntimeError("boom")
        with pytest.raises(RuntimeError, match="boom"):
            _parallel.parallel_map(xp, boom, range(2))
        assert control[1]() == before
        with _parallel.blas_single(xp):
            assert control[1]() == 1
            assert _parallel.parallel_map(xp, lambda i: control[1](), range(2)) == [1, 1]
            assert control[1]() == 1
        assert control[1]() == before


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


class TestMapRows:
    @pytest.mark.parametrize("threads", ["1", "2"])
    def test_rows_back_in_order(self, monkeypatch, threads):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", threads)
        x = np.arange(2 * 10 * 3.0).reshape(2, 10, 3)
        blocks = [(0, 4), (4, 5), (5, 10)]
        out = _parallel.map_rows(xp, lambda r, out: x[:, r[0]:r[1], :] * 2, blocks,
                                 shape=x.shape, dtype=x.dtype)
        np.testing.assert_array_equal(out, 2 * x)
        one = _parallel.map_rows(xp, lambda r, out: x[:, r[0]:r[1], :], [(0, 10)],
                                 shape=x.shape, dtype=x.dtype)
        assert one.shape == x.shape

    @pytest.mark.parametrize("threads", ["1", "2"])
    def test_blocks_written_in_place(self, monkeypatch, threads):
        """A block written into its ``out`` and returned is not copied again; ``out`` is
        the block's own place in the result."""
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", threads)
        x = np.arange(2 * 10 * 3.0).reshape(2, 10, 3)
        places = []

        def block(rows, out):
            assert out.shape == (2, rows[1] - rows[0], 3)
            places.append(out)
            np.multiply(x[:, rows[0]:rows[1], :], 3, out=out)
            return out

        out = _parallel.map_rows(xp, block, [(0, 4), (4, 10)], shape=x.shape,
                                 dtype=x.dtype)
        np.testing.assert_array_equal(out, 3 * x)
        assert all(np.shares_memory(p, out) for p in places)

    def test_other_library_concatenates(self):
        strict = pytest.importorskip("array_api_strict")
        x = strict.reshape(strict.arange(12.0), (4, 3))
        out = _parallel.map_rows(strict, lambda r, out: x[r[0]:r[1], :], [(0, 1), (1, 4)],
                                 shape=(4, 3), dtype=strict.float64)
        assert type(out) is type(x) and strict.all(out == x)


class TestScratch:
    def test_none_outside_a_map_and_for_other_libraries(self):
        assert _parallel.scratch(xp, (3, 4), np.float32, "a") is None
        strict = pytest.importorskip("array_api_strict")
        assert _parallel.parallel_map(
            strict, lambda i: _parallel.scratch(strict, (2,), strict.float32, "a"),
            range(2)) == [None, None]

    @pytest.mark.parametrize("threads", ["1", "2"])
    def test_reused_within_a_thread_and_call(self, monkeypatch, threads):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", threads)
        seen = []

        def item(i):
            buf = _parallel.scratch(xp, (4, 5), np.float32, "a")
            seen.append((threading.get_ident(), buf.__array_interface__["data"][0]))
            other = _parallel.scratch(xp, (4, 5), np.float32, "b")
            assert not np.shares_memory(buf, other)
            return buf.shape

        assert _parallel.parallel_map(xp, item, range(6)) == [(4, 5)] * 6
        by_thread = {}
        for ident, address in seen:
            by_thread.setdefault(ident, set()).add(address)
        assert all(len(a) == 1 for a in by_thread.values())  # one buffer per thread
        # gone with its call: outside a call there is no buffer
        assert _parallel.scratch(xp, (1,), np.float32, "a") is None

    def test_smaller_request_reuses_larger_grows(self, monkeypatch):
        monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "1")

        def run(_):
            address = lambda b: b.__array_interface__["data"][0]  # noqa: E731
            big = address(_parallel.scratch(xp, (4, 5), np.float32, "a"))
            small = _parallel.scratch(xp, (3, 2), np.float32, "a")
            assert small.shape == (3, 2) and address(small) == big
            assert _parallel.scratch(xp, (4, 5), np.float64, "a").dtype == np.float64
            return _parallel.scratch(xp, (9, 9), np.float64, "a").shape

        assert _parallel.parallel_map(xp, run, [0]) == [(9, 9)]

    def test_nested_call_does_not_share_its_callers_buffers(self, monkeypatch):
        force_threaded(monkeypatch)

        def inner(i):
            return _parallel.scratch(xp, (8,), np.float64, "a")

        def outer(i):
            mine = _parallel.scratch(xp, (8,), np.float64, "a")
            mine[...] = i
            nested = _parallel.parallel_map(xp, inner, range(2))
            assert not any(np.shares_memory(mine, b) for b in nested)
            assert (mine == i).all()
            # the caller's buffers are back after the nested call
            assert _parallel.scratch(xp, (8,), np.float64, "a") is not None
            return np.shares_memory(mine, _parallel.scratch(xp, (8,), np.float64, "a"))

        assert all(_parallel.parallel_map(xp, outer, range(4)))

    def test_matmul_into(self, monkeypatch):
        force_threaded(monkeypatch)
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((3, 5, 4)), rng.standard_normal((4, 6))
        np.testing.assert_allclose(_parallel.matmul_into(xp, a, b), a @ b)
        out = np.empty((3, 5, 6))
        assert _parallel.matmul_into(xp, a, b, out) is out
        np.testing.assert_allclose(out, a @ b)
        res = _parallel.parallel_map(
            xp, lambda i: _parallel.matmul_into(xp, a, b, "prod").copy(), range(2))
        for r in res:
            np.testing.assert_allclose(r, a @ b)
        # outside a map, a named buffer falls back to a fresh array
        np.testing.assert_allclose(_parallel.matmul_into(xp, a, b, "prod"), a @ b)


class TestReduceAxis:
    @pytest.mark.parametrize("rows", [1, 3, 64, 96, 97, 4096])
    def test_matches_plain_reduction(self, rows):
        rng = np.random.default_rng(rows)
        x = rng.standard_normal((2, rows, 64)).astype(np.float32)
        np.testing.assert_array_equal(_parallel.reduce_axis(xp, xp.max, x, -2),
                                      np.max(x, axis=-2, keepdims=True))
        got = _parallel.reduce_axis(xp, xp.sum, x, 1)
        assert got.shape == (2, 1, 64)
        # a sum in another order: within the summation bound rows * eps * sum|x|
        bound = rows * np.finfo(np.float32).eps * np.abs(x).sum(axis=-2, keepdims=True)
        assert (np.abs(got - x.astype(np.float64).sum(axis=-2, keepdims=True))
                <= bound).all()

    def test_strided_and_other_axes_fall_back(self):
        x = np.arange(2 * 64 * 8.0).reshape(2, 64, 8)
        for view, axis in ((x[:, :, ::2], -2), (x, -1), (x, 0), (np.swapaxes(x, 1, 2), -2)):
            np.testing.assert_array_equal(_parallel.reduce_axis(xp, xp.max, view, axis),
                                          np.max(view, axis=axis, keepdims=True))

    def test_rows_slice_of_a_larger_array(self):
        x = np.arange(3 * 256 * 64.0).reshape(3, 256, 64)[:, 16:208, :]
        np.testing.assert_array_equal(_parallel.reduce_axis(xp, xp.sum, x, -2),
                                      np.sum(x, axis=-2, keepdims=True))


class TestInPlaceHelpers:
    def test_cumulative_sum(self):
        x = np.arange(60.0).reshape(3, 4, 5)
        for axis in (0, 1, -1):
            np.testing.assert_array_equal(
                _parallel.cumulative_sum_(xp, x.copy(), axis=axis), np.cumsum(x, axis=axis))

    def test_zero_where_keeps_no_nan(self):
        a = np.array([[1.0, np.inf], [np.nan, 2.0]])
        mask = np.array([[False, True], [True, False]])
        np.testing.assert_array_equal(_parallel.zero_where_(xp, a, mask),
                                      [[1.0, 0.0], [0.0, 2.0]])

    def test_fill_where(self):
        a = np.array([[1.0, np.nan], [3.0, 2.0]])
        mask = np.array([[False, True]])
        np.testing.assert_array_equal(_parallel.fill_where_(xp, a, mask, -np.inf),
                                      [[1.0, -np.inf], [3.0, -np.inf]])

    def test_fill_where_whole_rows(self):
        a = np.arange(24.0).reshape(2, 3, 4)
        rows = np.array([[True], [False], [True]])                 # broadcasts over batch
        expect = np.where(rows, -np.inf, a)
        np.testing.assert_array_equal(_parallel.fill_where_(xp, a, rows[None], -np.inf),
                                      expect)
        b = np.arange(6.0).reshape(2, 3, 1)                         # one column: no row path
        np.testing.assert_array_equal(
            _parallel.fill_where_(xp, b, np.array([True, False, True])[:, None], 0.0),
            np.where(np.array([True, False, True])[:, None], 0.0, b))

    def test_exp_shifted(self):
        a = np.array([[1.0, 2.0]])
        np.testing.assert_allclose(_parallel.exp_shifted_(xp, a.copy(), 2.0),
                                   np.exp([[-1.0, 0.0]]))


#: (variant, options, exact splitting): the functions whose NumPy path is split.
SPLIT = [
    ("softmax_blockwise", {"block_size": 16}, True),
    ("softmax_blockwise", {"block_size": 16, "causal": True}, True),
    # The kernel family, Nystrom and landmark run on arrayattn._numpy.parallel: their
    # split engines are tested against the reference forms in tests/test_reference.py.
]


@pytest.mark.parametrize("name, options, exact", SPLIT)
def test_split_equals_whole(monkeypatch, rng, name, options, exact):
    """Many blocks in two threads against one block, on sharp inputs with a key mask.

    Blockwise exact attention splits whole query blocks: bit for bit.  The others add
    the same ``s`` per-key terms in another order, which moves a sum of ``s`` terms by at
    most ``s eps`` of its magnitude (the standard summation bound); numerator and
    denominator both move, hence ``atol = 4 s eps max|v|``.
    """
    var = arrayattn.get_variant(name)
    q, k, v = make_qkv(rng, batch=(2, 3), n=96, d=16, norm=8.0, sharp=True)
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    opts = dict(options)
    if var.key_mask and not opts.get("causal"):
        km = rng.random((2, 3, 96)) < 0.8
        km[..., 0] = True
        opts["key_mask"] = km
    monkeypatch.setenv("ARRAYATTN_NUM_THREADS", "1")
    whole = var(q, k, v, **opts)
    force_threaded(monkeypatch)
    threaded = []
    as_worker = _parallel._as_worker
    monkeypatch.setattr(_parallel, "_as_worker",
                        lambda *a: threaded.append(1) or as_worker(*a))
    split = var(q, k, v, **opts)
    assert threaded, "the split, threaded path was not taken"
    if exact:
        np.testing.assert_array_equal(split, whole)
    else:
        eps = np.finfo(np.float32).eps
        atol = 4 * k.shape[-2] * eps * np.abs(v).max()
        np.testing.assert_allclose(split, whole, rtol=0, atol=atol)
        assert not np.array_equal(split, np.zeros_like(split))
