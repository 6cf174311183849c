"""Sparse patterns and block-sparse attention against plain definitions and the oracle.

Patterns are checked against the papers' set definitions written as loops; attention is
checked against the float64 exact oracle with the pattern's dense mask, on every backend.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import arrayattn
from arrayattn import (bigbird_layout, block_layout, fixed_layout, local_attention,
                       local_layout, longformer_layout, softmax_attention, sparse_attention,
                       strided_layout)
from arrayattn import sparse as sparse_mod
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import get_backend, make_qkv
from oracle import softmax_attention as oracle
from tolerances import attention_atol, round_to

# n = 37 is not a multiple of any block size used here (5 and 8).
N = 37
PATTERNS = {
    "local": lambda causal: local_layout(N, window=6, block_size=8, causal=causal),
    "local_asym": lambda causal: local_layout(N, window=(3, 9), block_size=5, causal=causal),
    "strided": lambda causal: strided_layout(N, stride=2, block_size=5, causal=causal),
    "fixed": lambda causal: fixed_layout(N, stride=3, summary=1, block_size=5, causal=causal),
    "longformer": lambda causal: longformer_layout(N, window=4, global_tokens=[0, 20],
                                                   block_size=8, causal=causal),
    "bigbird": lambda causal: bigbird_layout(N, block_size=5, num_random_blocks=2, seed=3,
                                             causal=causal),
    "custom": lambda causal: block_layout(np.random.default_rng(1).random((5, 5)) < 0.4,
                                          n=N, block_size=8, causal=causal),
}


def _run(backend, dtype, q, k, v, layout, **opts):
    """sparse_attention on ``backend``; the oracle on the rounded inputs; the tolerance."""
    qr, kr, vr = (round_to(x, dtype) for x in (q, k, v))
    kw = {key: (backend.asarray(val) if isinstance(val, np.ndarray) else val)
          for key, val in opts.items()}
    out = sparse_attention(*(backend.asarray(x, dtype) for x in (qr, kr, vr)), layout=layout,
                           **kw)
    ref = oracle(qr, kr, vr, mask=layout.dense_mask(), **opts)
    return out, backend.asarray(ref, dtype), attention_atol(dtype, qr, kr, vr, opts.get("scale"))


class TestPatterns:
    """Dense masks against the set definitions of the papers (loops)."""

    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("n,s", [(11, 11), (7, 12), (12, 7)])
    def test_local(self, causal, n, s):
        m = local_layout(n, s=s, window=(2, 3), block_size=4, causal=causal).dense_mask()
        for i in range(n):
            p = i + s - n
            for j in range(s):
                want = p - 2 <= j <= (p if causal else p + 3)
                assert m[i, j] == want, (i, j)

    @pytest.mark.parametrize("causal", [False, True])
    def test_strided_token_level_is_child_et_al(self, causal):
        # A(1)_i = {t..i}, t = max(0, i - l) (paper; here the l most recent, i - l < j),
        # A(2)_i = {j : (i - j) mod l = 0}; merged head = union, j <= i when causal.
        n, l = 20, 4
        m = strided_layout(n, stride=l, block_size=1, causal=causal).dense_mask()
        for i in range(n):
            for j in range(n):
                want = abs(i - j) < l or (i - j) % l == 0
                if causal:
                    want = want and j <= i
                assert m[i, j] == want, (i, j)

    @pytest.mark.parametrize("causal", [False, True])
    def test_fixed_token_level_is_child_et_al(self, causal):
        # A(1)_i = {j : floor(j/l) = floor(i/l)}, A(2)_i = {j : j mod l in {l-c, ..., l-1}}.
        n, l, c = 20, 5, 2
        m = fixed_layout(n, stride=l, summary=c, block_size=1, causal=causal).dense_mask()
        for i in range(n):
            for j in range(n):
                want = j // l == i // l or j % l >= l - c
                if causal:
                    want = want and j <= i
                assert m[i, j] == want, (i, j)

    def test_block_patterns_are_token_patterns_on_blocks(self):
        # At block size b the pattern is the token pattern applied to block indices.
        b, n = 3, 20
        for make in (lambda bs, nn: strided_layout(nn, stride=3, block_size=bs),
                     lambda bs, nn: fixed_layout(nn, stride=3, summary=1, block_size=bs,
                                                 causal=False)):
            token = make(1, 7).dense_mask()
            blocks = make(b, n)
            m = blocks.dense_mask()
            i, j = np.arange(n)[:, None], np.arange(n)[None, :]
            want = token[i // b, j // b]
            if blocks.causal:  # within a diagonal block the tokens are causal too
                want = want & (j <= i)
            np.testing.assert_array_equal(m, want)

    def test_longformer(self):
        n, g = 16, [0, 9]
        m = longformer_layout(n, window=2, global_tokens=g, block_size=4).dense_mask()
        for i in range(n):
            for j in range(n):
                assert m[i, j] == (abs(i - j) <= 2 or i in g or j in g), (i, j)

    @pytest.mark.parametrize("causal", [False, True])
    def test_bigbird(self, causal):
        nb, b, r = 12, 4, 3
        lay = bigbird_layout(nb * b - 2, block_size=b, num_window_blocks=3,
                             num_global_blocks=2, num_random_blocks=r, seed=11, causal=causal)
        blk = lay.blocks
        glob = {0, nb - 1}
        for i in range(nb):
            window = {j for j in range(nb) if (i - 2 <= j <= i if causal else abs(i - j) <= 1)}
            fixed = window | glob if i not in glob else set(range(nb))
            if causal:
                fixed = {j for j in fixed if j <= i}
            got = set(np.flatnonzero(blk[i]))
            assert fixed <= got, i
            extra = got - fixed
            cands = {j for j in range(nb) if j not in fixed and (j <= i or not causal)}
            assert len(extra) == min(r, len(cands)), (i, extra, cands)
            assert extra <= cands
        # Same seed, same layout; another seed, another one.
        again = bigbird_layout(nb * b - 2, block_size=b, num_random_blocks=r, seed=11,
                               causal=causal)
        np.testing.assert_array_equal(again.blocks, blk)
        other = bigbird_layout(nb * b - 2, block_size=b, num_random_blocks=r, seed=12,
                               causal=causal)
        assert (other.blocks != blk).any()

    def test_support_covers_mask_and_is_sparse(self):
        for name, make in PATTERNS.items():
            for causal in (False, True):
                lay = make(causal)
                b = lay.block_size
                m = lay.dense_mask()
                i, j = np.arange(N)[:, None], np.arange(N)[None, :]
                assert not (m & ~lay.support[i // b, j // b]).any(), name
                assert lay.count_allowed(causal=causal) == (m & (j <= i if causal else m)).sum()
                assert lay.count_computed() >= m.sum()
        lay = local_layout(4096, window=16, block_size=16)
        assert lay.support.sum(axis=1).max() <= 4  # (16 + 2*16) / 16 + 1 blocks

    def test_layout_is_read_only_data(self):
        blocks = np.eye(3, dtype=bool)
        lay = block_layout(blocks, n=9, block_size=3)
        blocks[0, 1] = True            # the layout keeps its own copy
        assert not lay.blocks[0, 1]
        with pytest.raises(ValueError):
            lay.blocks[0, 0] = False
        assert "custom" in repr(lay) and 0 < lay.density < 1

    def test_errors(self):
        with pytest.raises(ValueError, match=r"blocks must have shape .* = \(3, 3\)"):
            block_layout(np.eye(2, dtype=bool), n=9, block_size=3)
        with pytest.raises(ValueError, match="self-attention"):
            strided_layout(8, s=9, stride=2)
        with pytest.raises(ValueError, match="summary must be <= stride"):
            fixed_layout(8, stride=2, summary=3)
        with pytest.raises(ValueError, match="odd"):
            bigbird_layout(64, block_size=8, num_window_blocks=2)
        with pytest.raises(ValueError, match="global_tokens must be token indices"):
            longformer_layout(8, window=1, global_tokens=[8])
        with pytest.raises(ValueError, match="global_blocks must be block indices"):
            bigbird_layout(64, block_size=8, global_blocks=[8])
        with pytest.raises(TypeError, match="window must be an int or a pair"):
            local_layout(8, window=2.5)
        with pytest.raises(ValueError, match="window sizes must be >= 0"):
            local_layout(8, window=(-1, 2))
        with pytest.raises(ValueError, match="block_size must be >= 1"):
            local_layout(8, window=1, block_size=0)


class TestSparseAttention:
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("pattern", list(PATTERNS))
    def test_matches_dense_masked_oracle(self, backend, rng, pattern, causal):
        # float32 on every backend; float64 (a 1e-13 check) on NumPy and the strict
        # non-default device.
        dtypes = ["float32"] + (["float64"] if backend.name in ("numpy", "strict_device1")
                                else [])
        for dtype in dtypes:
            self._check_pattern(backend, rng, pattern, causal, dtype)

    def _check_pattern(self, backend, rng, pattern, causal, dtype):
        q, k, v = make_qkv(rng, batch=(2,), n=N, d=32, dv=5, norm=8.0)
        km = rng.random((2, N)) < 0.8
        # The pattern's own causality, and the caller's causal flag on a symmetric one.
        lay = PATTERNS[pattern](causal)
        out, ref, atol = _run(backend, dtype, q, k, v, lay, key_mask=km, causal=causal)
        assert out.dtype == backend.dtype(dtype)
        xp_assert_close(out, ref, rtol=0, atol=atol)

    def test_equals_softmax_attention_with_dense_mask(self, backend, rng):
        # The documented identity, through the library's own exact path.
        q, k, v = (backend.asarray(x) for x in make_qkv(rng, batch=(2,), n=N, d=8))
        lay = PATTERNS["bigbird"](False)
        out = sparse_attention(q, k, v, layout=lay, causal=True)
        ref = softmax_attention(q, k, v, mask=lay.dense_mask(backend.xp, device=backend.device),
                                causal=True)
        xp_assert_close(out, ref, rtol=0, atol=64 * N * 2e-16)

    @pytest.mark.parametrize("causal", [False, True])
    def test_local_cross_attention_end_aligned(self, backend, rng, causal):
        for n, s in ((9, 23), (23, 9)):
            q, k, v = make_qkv(rng, batch=(2,), n=n, s=s, d=16, dv=3, norm=6.0)
            km = rng.random((1, s)) < 0.8
            lay = local_layout(n, s=s, window=(4, 2), block_size=4, causal=causal)
            out, ref, atol = _run(backend, "float64", q, k, v, lay, key_mask=km)
            xp_assert_close(out, ref, rtol=0, atol=atol)
            o = backend.to_numpy(out)
            assert np.isfinite(o).all()
            if n > s:  # queries before the first key (and its window) see nothing: zeros
                assert (o[:, : n - s - 4] == 0).all()

    @pytest.mark.parametrize("causal", [False, True])
    def test_local_window_covering_everything_is_exact(self, backend, rng, causal):
        q, k, v = make_qkv(rng, batch=(2, 2), n=N, d=32, dv=4, norm=8.0)
        args = [backend.asarray(x) for x in (q, k, v)]
        for window in (N, 3 * N):
            out = local_attention(*args, window=window, causal=causal, block_size=8)
            xp_assert_close(out, backend.asarray(oracle(q, k, v, causal=causal)), rtol=0,
                            atol=attention_atol("float64", q, k, v))

    def test_bigbird_all_global_is_exact(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=N, d=32, dv=4, norm=8.0)
        lay = bigbird_layout(N, block_size=8, num_random_blocks=0, global_blocks=range(5))
        assert lay.dense_mask().all()
        out = sparse_attention(*(backend.asarray(x) for x in (q, k, v)), layout=lay)
        xp_assert_close(out, backend.asarray(oracle(q, k, v)), rtol=0,
                        atol=attention_atol("float64", q, k, v))
        lay = longformer_layout(N, window=0, global_tokens=range(N), block_size=8)
        out = sparse_attention(*(backend.asarray(x) for x in (q, k, v)), layout=lay)
        xp_assert_close(out, backend.asarray(oracle(q, k, v)), rtol=0,
                        atol=attention_atol("float64", q, k, v))

    def test_seed_reproduces_on_every_backend(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=64, d=16, dv=4, norm=6.0)
        rec = arrayattn.get_variant("bigbird")
        ref = rec(q, k, v, seed=5)  # numpy float64
        out = rec(*(backend.asarray(x) for x in (q, k, v)), seed=5)
        np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=0, atol=1e-13)
        lay = bigbird_layout(64, block_size=8, num_window_blocks=3, num_global_blocks=2,
                             num_random_blocks=2, seed=5)
        np.testing.assert_allclose(ref, oracle(q, k, v, mask=lay.dense_mask()), rtol=0,
                                   atol=attention_atol("float64", q, k, v))
        other = rec(*(backend.asarray(x) for x in (q, k, v)), seed=6)
        assert np.abs(backend.to_numpy(other) - ref).max() > 1e-6

    def test_empty_rows_are_zero(self, backend, rng):
        q, k, v = (backend.asarray(x) for x in make_qkv(rng, batch=(2,), n=N, d=4))
        km = np.ones((2, N), dtype=bool)
        km[1] = False
        out = local_attention(q, k, v, window=3, block_size=8, key_mask=backend.asarray(km))
        o = backend.to_numpy(out)
        assert np.isfinite(o).all() and (o[1] == 0).all() and (o[0] != 0).any()

    def test_broadcast_batch(self, backend, rng):
        q, _, _ = make_qkv(rng, batch=(2, 3), n=N, d=8)
        _, k, v = make_qkv(rng, batch=(3,), n=N, d=8)
        km = rng.random((2, 1, N)) < 0.8
        lay = PATTERNS["longformer"](False)
        out, ref, atol = _run(backend, "float64", q, k, v, lay, key_mask=km)
        assert tuple(out.shape) == (2, 3, N, 8)
        xp_assert_close(out, ref, rtol=0, atol=atol)

    def test_many_chunks_and_groups(self, backend, rng, monkeypatch):
        # A tiny chunk budget: one query block per chunk, groups processed out of order
        # and put back by the inverse permutation.
        monkeypatch.setattr(arrayattn.core.devices, "CPU_CHUNK", 1)
        monkeypatch.setattr(sparse_mod.layout, "_GROUP_OVERHEAD", 0)
        q, k, v = make_qkv(rng, batch=(2,), n=N, d=16, dv=3, norm=6.0)
        lay = PATTERNS["bigbird"](False)
        assert len(lay.plan) > 1
        out, ref, atol = _run(backend, "float64", q, k, v, lay, causal=True)
        xp_assert_close(out, ref, rtol=0, atol=atol)
        # Rows split over their key blocks are merged by log-sum-exp; an empty (future)
        # part has weight exactly 0: past outputs stay bit for bit.
        k2, v2 = k.copy(), v.copy()
        k2[:, 20:] *= 4.0
        v2[:, 20:] = 100.0
        a = sparse_attention(*(backend.asarray(x) for x in (q, k, v)), layout=lay, causal=True)
        b = sparse_attention(*(backend.asarray(x) for x in (q, k2, v2)), layout=lay,
                             causal=True)
        xp_assert_equal(a[:, :20, :], b[:, :20, :])

    def test_block_size_does_not_change_local(self, np_backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=50, d=8)
        outs = [local_attention(q, k, v, window=(5, 2), block_size=b) for b in (1, 4, 7, 64)]
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], rtol=0, atol=1e-14)

    def test_never_forms_n_by_s(self, np_backend, rng):
        # n = s = 8192: an (n, s) float32 score matrix alone is 256 MiB. The local path
        # gathers <= 4 blocks of 16 keys per query: its peak stays a few MiB.
        n, d = 8192, 8
        q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(), n=n, d=d))
        tracemalloc.start()
        try:
            local_attention(q, k, v, window=16, block_size=16)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 64 * n * 4 * 8, peak  # 16 MiB  <<  n * s * 4 = 256 MiB

    def test_errors(self, backend, rng):
        q, k, v = (backend.asarray(x) for x in make_qkv(rng, batch=(2,), n=8, d=4))
        with pytest.raises(ValueError, match=r"layout was built for n=9 .* q has n=8"):
            sparse_attention(q, k, v, layout=local_layout(9, window=1))
        with pytest.raises(TypeError, match="layout must be a BlockLayout"):
            sparse_attention(q, k, v, layout=np.ones((8, 8), dtype=bool))
        with pytest.raises(ValueError, match="key_mask must have shape"):
            local_attention(q, k, v, window=2, key_mask=backend.asarray(np.ones(5, bool)))

    @given(data=st.data())
    def test_random_block_layouts(self, data):
        # Hypothesis: any block matrix, block size, ragged n, causal and key mask.
        be = get_backend("numpy")
        n = data.draw(st.integers(1, 30), label="n")
        b = data.draw(st.integers(1, 9), label="block_size")
        nb = -(-n // b)
        bits = data.draw(st.lists(st.booleans(), min_size=nb * nb, max_size=nb * nb))
        causal = data.draw(st.booleans(), label="causal")
        window = data.draw(st.none() | st.tuples(st.integers(0, 5), st.integers(0, 5)))
        lay = block_layout(np.array(bits).reshape(nb, nb), n=n, block_size=b, causal=causal)
        if window is not None:
            lay = sparse_mod.BlockLayout(n=n, s=n, block_size=b, blocks=lay.blocks,
                                         window=window, causal=causal)
        seed = data.draw(st.integers(0, 2**16), label="seed")
        r = np.random.default_rng(seed)
        q, k, v = make_qkv(r, batch=(2,), n=n, d=4, dv=2, norm=5.0)
        km = r.random((2, n)) < 0.7
        out, ref, atol = _run(be, "float64", q, k, v, lay, key_mask=km)
        xp_assert_close(out, ref, rtol=0, atol=atol)


def test_jax_jit_traces_the_block_sparse_path(rng):
    # The layout and the gather plan are host data: the path traces under jax.jit
    # (compiled once for a shape) and gives the eager result.
    be = get_backend("jax")
    import jax

    q, k, v = (be.asarray(x) for x in make_qkv(rng, batch=(2,), n=30, d=8))
    lay = bigbird_layout(30, block_size=4, num_random_blocks=1, seed=2)
    km = be.asarray(rng.random((2, 30)) < 0.8)
    eager = sparse_attention(q, k, v, layout=lay, key_mask=km, causal=True)
    jitted = jax.jit(lambda a, b, c, m: sparse_attention(a, b, c, layout=lay, key_mask=m,
                                                         causal=True))(q, k, v, km)
    xp_assert_close(jitted, eager, rtol=0, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_block_tables_give_the_key_tables_mask(name, causal):
    # Point keys and no global key: mask_tables sends one code and index per key block,
    # mask_from makes each key's code and position from them; the mask must be the one
    # of the per-key tables, on every group of the plan (short last block included).
    from arrayattn.sparse import tiles

    lay = PATTERNS[name](causal)
    point = lay.key_start is None and not lay.global_tokens.size
    for rows, idx, valid in lay.plan + lay.scan_plan:
        t = tiles.mask_tables(np, lay, rows, idx, valid, causal=causal, device="cpu")
        assert ("bcode" in t) == point and ("code" in t) != point
        kstart, kend, code, apos, gq, rules = tiles._chunk_masks(lay, rows, idx, valid,
                                                                causal=causal)
        per_key = {"code": code}
        if rules:
            per_key.update(kend=kend, kstart=kstart, apos=apos)
            if gq is not None:
                per_key["gq"] = gq
        got = tiles.mask_from(np, lay, t, causal=causal)
        np.testing.assert_array_equal(got, tiles.mask_from(np, lay, per_key, causal=causal))
        if point:                                   # one entry per block, not per key
            assert t["bcode"].shape == t["idx"].shape == idx.shape


def test_scan_plan_cuts_a_group_only_where_it_halves_the_work():
    # The scanned form's groups are loop bodies of a compiled program: a global row that
    # reaches every block is cut off (it saves 88 % of the padded work), rows that reach
    # a few blocks fewer are not (25 % here, as Poolingformer's pooled level's edge rows).
    from arrayattn.sparse.layout import group_rows

    glob = np.eye(16, dtype=bool)
    glob[0] = True
    assert [g[0].size for g in group_rows(glob, 4, 0, max_groups=4)] == [1, 15]
    band = np.zeros((16, 16), dtype=bool)
    band[:8, :2] = band[8:, :4] = True          # two groups: 8 * 2 + 8 * 4 = 48 of 64
    cut = group_rows(band, 4, 0, max_groups=4)
    assert len(cut) == 1 and cut[0][1].shape == (16, 4)
    assert len(group_rows(band, 4, 0)) == 2     # the NumPy engine's plan does cut it


@pytest.mark.parametrize("pattern", ["longformer", "bigbird", "strided"])
def test_numpy_engine_bad_value_reaches_only_its_rows(pattern, rng, monkeypatch):
    # The NumPy engine's own guard (arrayattn._numpy.sparse): a NaN or infinite value is
    # zeroed once and its key's scores are NaN, in every span of a row walked in many
    # merged parts (a tiny budget) and with a bias and key mask: the rows that see it are
    # NaN, every other row is bit for bit the call with that value zeroed.
    monkeypatch.setattr(arrayattn.core.devices, "CPU_CHUNK", 1)
    q, k, v = make_qkv(rng, batch=(2,), n=N, d=8, dv=3, norm=4.0)
    lay = PATTERNS[pattern](False)
    bias = rng.standard_normal((2, N, N))
    km = rng.random((2, N)) < 0.9
    km[:, 21] = True
    ref_mask = lay.dense_mask() & km[:, None, :]
    for bad in (np.nan, np.inf):
        vb, vz = v.copy(), v.copy()
        vb[0, 21, 1], vz[0, 21, :] = bad, 0.0
        with arrayattn.use_engine("numpy"):
            got = sparse_attention(q, k, vb, layout=lay, bias=bias, key_mask=km)
            want = sparse_attention(q, k, vz, layout=lay, bias=bias, key_mask=km)
        seen = np.zeros((2, N), dtype=bool)
        seen[0] = ref_mask[0, :, 21]
        assert seen.any() and not np.isfinite(got[seen]).any(axis=-1).any()
        xp_assert_equal(got[~seen], want[~seen])
        with arrayattn.use_engine("reference"):
            ref = sparse_attention(q, k, vz, layout=lay, bias=bias, key_mask=km)
        xp_assert_close(got[~seen], ref[~seen], rtol=0, atol=1e-13)


def test_numpy_engine_finite_check():
    from arrayattn._numpy.sparse import finite
    x = np.ones((3, 4), dtype=np.float32)
    assert finite(x) and finite(x[:0])
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 3] = bad
        assert not finite(y)
    # large values are proved finite; a sum of squares that overflows only answers
    # "not known" (the guarded path, which is as right: tests above)
    assert finite(np.full(1000, 1e15, dtype=np.float32))
    assert not finite(np.full(1000, 3e38, dtype=np.float32))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_engine_chunks_balance_the_threads(threads):
    """The NumPy engine's chunks: every query block once, in order, each group cut into a
    multiple of ``threads`` chunks of equal size (within a block) wherever it is cut at
    all (4 chunks of 156, 156, 156, 44 gathered blocks on 2 threads took 312 blocks' time)."""
    from arrayattn.sparse.executor import cut_chunks
    from arrayattn.sparse.patterns import local_layout

    layout = local_layout(4096, window=256, block_size=16)
    per_slot, per_row = 8 * (16 * 16 + 16 * 128), 8 * 16 * 128
    budget = 40 * per_slot * 3
    whole = cut_chunks(layout.plan, per_slot, per_row, budget)
    chunks = cut_chunks(layout.plan, per_slot, per_row, budget, threads=threads)
    rows = np.concatenate([c[0] for c in chunks])
    assert np.array_equal(rows, np.concatenate([c[0] for c in whole]))
    start = 0
    for group_rows, _, _ in layout.plan:
        mine = []
        while start < len(chunks) and np.isin(chunks[start][0], group_rows).all():
            mine.append(chunks[start][0].size)
            start += 1
        assert sum(mine) == group_rows.size
        if len(mine) > 1 and threads > 1:
            assert len(mine) % threads == 0 and max(mine) - min(mine) <= 1
    assert start == len(chunks)
    if threads == 1:
        assert [c[0].size for c in chunks] == [c[0].size for c in whole]
