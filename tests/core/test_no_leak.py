"""Excluded positions never leak (issue #25 point 1): a NaN or an infinity at one token
changes exactly the outputs of the queries that may see that token.

The oracle is the variant itself: the rows that see token ``t`` are the rows that change
when ``k_t, v_t`` change to other *finite* values.  With a non-finite ``k_t`` or ``v_t``,
every other row must equal, bit for bit, the output with ``k_t = v_t = 0`` (what the
forms compute for a dropped token), and every row that sees ``t`` must not be finite (no
silent answer).  Every registered variant (causal where it can be), every backend and
NumPy implementation; exact attention with windows, masks and packed sequences; the
gated families with a bad ``beta`` or gate; the backward's ``dq`` of earlier rows.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn

from conftest import get_backend, make_qkv, skip_jax_compile

RECORDS = arrayattn.variants()
N, T = 40, 23
#: One record per kind of form run on JAX too (eager JAX compiles every op per shape).
_JAX_RECORDS = ("softmax_blockwise", "linear_elu", "performer_positive", "gla", "deltanet",
                "local", "poolingformer")          # the bad token sits inside a chunk, not at its start


def _seen_rows(call, q, k, v, rng, prefix, move_k=True):
    """Rows that may see token ``T``: every row from ``T`` on for a causal kernel or gated
    variant (a ReLU feature map can give a visible key weight 0), else the rows whose
    output changes when token ``T``'s key and value change (finitely; softmax weights are
    never 0 where a key is visible)."""
    if prefix:
        return np.broadcast_to(np.arange(q.shape[-2]) >= T, q.shape[:-1])
    base = call(q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[..., T, :] += rng.standard_normal(k.shape[-1]) if move_k else 0.0
    v2[..., T, :] += 1.0 + rng.standard_normal(v.shape[-1])
    moved = call(q, k2, v2)
    return np.any(base != moved, axis=-1)                       # (..., n)


def _check(call, q, k, v, rng, which, bad, *, bit_exact=True, prefix=False, move_k=True):
    seen = _seen_rows(call, q, k, v, rng, prefix, move_k)
    assert seen.any()
    kz, vz, kb, vb = k.copy(), v.copy(), k.copy(), v.copy()
    kz[..., T, :], vz[..., T, :] = 0.0, 0.0
    (kb if which == "k" else vb)[..., T, :] = bad
    want, got = call(q, kz, vz), call(q, kb, vb)
    if bit_exact:
        np.testing.assert_array_equal(got[~seen], want[~seen])
    else:   # the dirty call takes another implementation (the NumPy engine has no NaN rows)
        np.testing.assert_allclose(got[~seen], want[~seen], rtol=1e-12, atol=1e-14)
    assert not np.isfinite(got[seen]).all(axis=-1).any(), "a row that sees it is finite"
    return seen


def _on(backend, fn):
    def call(q, k, v):
        return backend.to_numpy(fn(*(backend.asarray(x) for x in (q, k, v))))
    return call


# an infinite key times a zero query entry is NaN in the scores' matmul (inf - inf in a
# max shift, in a reduction): fed on purpose, the test checks where it goes
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("which, bad", [("v", np.nan), ("k", np.inf)])
@pytest.mark.parametrize("rec", RECORDS, ids=[r.name for r in RECORDS])
def test_a_bad_token_reaches_only_the_rows_that_see_it(rec, backend, which, bad, rng):
    if backend.name == "jax" and rec.name not in _JAX_RECORDS:
        skip_jax_compile(backend, f"test_a_bad_token...[jax-{{{', '.join(_JAX_RECORDS)}}}]")
    q, k, v = make_qkv(rng, batch=(2,), n=N, d=8, dv=5, norm=3.0)
    opts = {"causal": True} if rec.causal else {}
    if rec.parameter == "num_landmarks":
        opts["num_landmarks"] = 8
    call = _on(backend, lambda a, b, c: rec(a, b, c, **opts))
    if rec.name == "lsh":
        if which == "k":
            pytest.skip("lsh: a key's hash decides every token's chunk (shared-QK); only "
                        "values can be judged row by row")
        _check(call, q, q, v, rng, which, bad, move_k=False)
        return
    seen = _check(call, q, k, v, rng, which, bad, bit_exact=not (
        rec.family == "exact" and backend.name in ("numpy", "numpy_readonly")),
        prefix=rec.causal and rec.family in ("kernel", "random_features", "gated"))
    if rec.causal:
        assert not seen[..., :T].any()      # no earlier row sees a later token


def _zero_row(x):
    x = x.copy()
    x[..., T, :] = 0.0
    return x


_EXACT_OPTIONS = {
    "window": {"window": (5, 2)},
    "causal+window": {"causal": True, "window": (6, 0)},
    "mask": {"mask": np.random.default_rng(3).random((N, N)) > 0.5},
    "varlen": {"cu_seqlens_q": np.array([0, 11, 30, N]),
               "cu_seqlens_k": np.array([0, 11, 30, N]), "causal": True},
    "blockwise": {"causal": True, "block_size": 8},
    "softcap+alibi": {"causal": True, "softcap": 3.0, "alibi_slopes": np.array([0.5, 0.25])},
}


@pytest.mark.parametrize("case", list(_EXACT_OPTIONS))
@pytest.mark.parametrize("name", ["numpy_reference", "strict", "torch", "jax"])
def test_exact_options_never_leak(case, name, rng):
    backend = get_backend(name)
    q, k, v = make_qkv(rng, batch=(1, 2), n=N, d=8, dv=5, norm=3.0)
    opts = {key: (backend.asarray(val) if hasattr(val, "shape") else val)
            for key, val in _EXACT_OPTIONS[case].items()}
    call = _on(backend, lambda a, b, c: arrayattn.softmax_attention(a, b, c, **opts))
    for which, bad in (("v", np.nan), ("k", -np.inf), ("v", np.inf)):
        _check(call, q, k, v, rng, which, bad)


def test_paged_cache_slots_past_the_length_never_matter(rng):
    """Cache slots past ``cache_seqlens`` hold NaN: the outputs equal those with zeros."""
    b, h, d, bs = 2, 2, 8, 4
    q = rng.standard_normal((b, h, 3, d))
    k_cache = rng.standard_normal((6, bs, h, d))
    v_cache = rng.standard_normal((6, bs, h, d))
    table = np.array([[0, 1, 2], [3, 4, 5]])
    lens = np.array([9, 5])
    dirty_k, dirty_v = k_cache.copy(), v_cache.copy()
    for row, n_real in zip(table, lens):
        flat = [(blk, off) for blk in row for off in range(bs)][n_real:]
        for blk, off in flat:
            dirty_k[blk, off], dirty_v[blk, off] = np.nan, np.inf
    clean = arrayattn.paged_attention(q, k_cache, v_cache, table, lens, causal=True)
    dirty = arrayattn.paged_attention(q, dirty_k, dirty_v, table, lens, causal=True)
    np.testing.assert_array_equal(dirty, clean)


@pytest.mark.parametrize("method", ["chunked", "recurrent"])
@pytest.mark.parametrize("fn, arg", [("gla", "g"), ("ssd", "a"), ("delta", "beta"),
                                     ("gated_delta", "beta"), ("gated_delta", "g")])
@pytest.mark.parametrize("bad", [np.nan, 0.5])       # 0.5: a positive log gate
def test_gated_bad_gate_or_beta_reaches_only_later_rows(fn, arg, bad, method, rng):
    if arg == "beta" and bad == 0.5:
        pytest.skip("beta = 0.5 is a valid step size")
    q, k, v = make_qkv(rng, batch=(2,), n=N, d=8, dv=5)
    args = {"g": np.log(rng.uniform(0.8, 1.0, (2, N, 8))),
            "a": -np.exp(rng.standard_normal((2, N)) - 2.5),
            "beta": rng.uniform(0.1, 0.9, (2, N))}
    fns = {"gla": (arrayattn.gla_attention, ("g",)), "ssd": (arrayattn.ssd_attention, ("a",)),
           "delta": (arrayattn.delta_attention, ("beta",)),
           "gated_delta": (arrayattn.gated_delta_attention, ("beta", "g"))}
    f, names = fns[fn]
    pos = [args[name][..., 0] if name == "g" and fn == "gated_delta" else args[name]
           for name in names]
    i = names.index(arg)
    dirty_arg = pos[i].copy()
    dirty_arg[:, T] = bad
    dirty = f(q, k, v, *pos[:i], dirty_arg, *pos[i + 1:], method=method)
    # the oracle: token T dropped (k = v = beta = g = 0 there), what the forms compute
    dropped = [x.copy() for x in pos]
    for x in dropped:
        x[:, T] = 0.0
    clean = f(q, _zero_row(k), _zero_row(v), *dropped, method=method)
    np.testing.assert_array_equal(dirty[:, :T], clean[:, :T])
    assert np.isnan(dirty[:, T:]).all()


@pytest.mark.parametrize("which", ["k", "v"])
def test_rfa_gate_or_token_reaches_only_later_rows(which, rng):
    q, k, v = make_qkv(rng, batch=(2,), n=N, d=8, dv=5)
    gate = rng.uniform(0.5, 0.99, (2, N))
    clean_k, clean_v = _zero_row(k), _zero_row(v)
    bad_k, bad_v = k.copy(), v.copy()
    (bad_k if which == "k" else bad_v)[..., T, :] = np.nan
    clean = arrayattn.rfa_attention(q, clean_k, clean_v, causal=True, gate=gate)
    dirty = arrayattn.rfa_attention(q, bad_k, bad_v, causal=True, gate=gate)
    np.testing.assert_array_equal(dirty[:, :T], clean[:, :T])
    assert np.isnan(dirty[:, T:]).all()
    gate_bad = gate.copy()
    gate_bad[:, T] = np.nan
    dirty = arrayattn.rfa_attention(q, k, v, causal=True, gate=gate_bad)
    np.testing.assert_array_equal(dirty[:, :T], arrayattn.rfa_attention(
        q, k, v, causal=True, gate=gate)[:, :T])
    assert np.isnan(dirty[:, T:]).all()


@pytest.mark.parametrize("rec", [r for r in RECORDS if r.causal], ids=lambda r: r.name)
def test_backward_earlier_rows_never_see_a_bad_future_token(rec, rng):
    """``dq`` of the rows before a bad token equals that of the token dropped, bit for
    bit; the rows that see it are NaN (as autodiff through a NaN output gives)."""
    from arrayattn.backward import has_backward
    if not has_backward(rec):
        pytest.skip(f"{rec.name}: no backward yet")
    q, k, v = make_qkv(rng, batch=(2,), n=N, d=8, dv=5, norm=3.0)
    if rec.name == "lsh":
        pytest.skip("lsh: a key's hash decides every token's chunk (shared-QK)")
    do = rng.standard_normal((2, N, 5))
    opts = {"causal": True}
    clean = arrayattn.vjp(rec.name, q, _zero_row(k), _zero_row(v), do, **opts)
    vb = v.copy()
    vb[:, T] = np.nan
    dirty = arrayattn.vjp(rec.name, q, k, vb, do, **opts)
    seen = _seen_rows(lambda a, b, c: rec(a, b, c, **opts), q, k, v, rng,
                      rec.family in ("kernel", "random_features", "gated"))
    np.testing.assert_array_equal(dirty["q"][~seen], clean["q"][~seen])
    assert np.isnan(dirty["q"][seen]).any(axis=-1).all()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nonfinite_rows(backend, dtype):
    """``nonfinite_rows`` flags exactly the rows that hold a NaN, +inf or -inf in any of
    its arrays: not a row of finite values near the dtype's largest (whose sum would
    overflow), and no row of an array with no columns; ``nonfinite_over`` the same over
    other axes, ``nan_over`` for NaNs alone."""
    from arrayattn.reference import nan_over, nonfinite_over, nonfinite_rows

    big = float(np.finfo(dtype).max)
    x = np.zeros((2, 6, 3))
    x[0, 1, 2], x[0, 2, 0], x[1, 3, 1] = np.nan, np.inf, -np.inf
    x[1, 4, :] = big                                   # finite: sums overflow, |x| does not
    y = np.zeros((2, 6, 4))
    y[1, 5, 3] = np.nan
    want = np.zeros((2, 6), dtype=bool)
    want[0, 1] = want[0, 2] = want[1, 3] = want[1, 5] = True
    bx, by = backend.asarray(x, dtype), backend.asarray(y, dtype)
    np.testing.assert_array_equal(backend.to_numpy(nonfinite_rows(bx, by)), want)
    np.testing.assert_array_equal(backend.to_numpy(nonfinite_rows(bx)), want & (
        np.arange(6) != 5))
    empty = backend.to_numpy(nonfinite_rows(backend.asarray(np.zeros((2, 6, 0)), dtype)))
    assert empty.shape == (2, 6) and not empty.any()
    whole = backend.to_numpy(nonfinite_over(by, (-2, -1)))        # per batch element
    np.testing.assert_array_equal(whole, [False, True])
    np.testing.assert_array_equal(backend.to_numpy(nonfinite_over(bx, (0, -1))),
                                  want.any(axis=0) & (np.arange(6) != 5))
    # nan_over: NaNs only (a gate of -inf is a full decay, not an error)
    np.testing.assert_array_equal(backend.to_numpy(nan_over(bx, (-1,))),
                                  np.isnan(x).any(axis=-1))
    assert not backend.to_numpy(nan_over(backend.asarray(np.zeros((3, 0)), dtype), (-1,))).any()


@pytest.mark.parametrize("n, s", [(6, 6), (4, 7), (7, 4), (3, 0)])
def test_seen_by_prefix(backend, n, s):
    """``seen_by_prefix``: query ``i`` sees a bad key ``j <= i + s - n`` (end-aligned), as
    a loop over the keys says."""
    from arrayattn.reference import seen_by_prefix

    bad = np.zeros((3, s), dtype=bool)
    if s:
        bad[0, s - 1], bad[1, s // 2], bad[1, s - 1] = True, True, True
    want = np.array([[any(bad[b, j] for j in range(s) if j <= i + s - n) for i in range(n)]
                     for b in range(3)], dtype=bool).reshape(3, n)
    got = backend.to_numpy(seen_by_prefix(backend.asarray(bad, "bool"), n))
    np.testing.assert_array_equal(got, want)
