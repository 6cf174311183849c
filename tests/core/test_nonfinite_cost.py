"""The non-finite guarantee costs ~nothing on finite NumPy inputs (issue #39 point 1).

On NumPy one cheap host pass (:func:`arrayattn.core.pipeline.finite_on_host`) looks at the
keys and values; where it finds every value finite, the careful path -- the per-row flags
(``nonfinite_rows`` / ``nonfinite_over``), the ``where`` copies (``drop_nonfinite``) and
the NaN rows (``poison_rows``) -- never runs.  Where a value is non-finite it runs, and the
rows that may see the bad token are NaN, the others what the finite call gives.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import reference
from arrayattn.core import pipeline
from arrayattn.core.pipeline import finite_on_host, nan_free_on_host

#: name, options, whether a bad token reaches only the rows from it on (else every row)
CASES = [("linear_elu", {"causal": True}, True),
         ("linear_relu", {"causal": True}, True),
         ("linear_cosine", {"causal": True}, True),
         ("performer_positive", {"causal": True}, True),
         ("deltanet", {"causal": True}, True),
         ("nystrom_iterative", {}, False),
         ("nystrom_svd", {}, False),
         ("softmax", {"causal": True}, True)]

#: the careful path's functions, where each caller looks them up
_CAREFUL = [(pipeline, "nonfinite_rows"), (pipeline, "drop_nonfinite"),
            (reference, "nonfinite_rows"), (reference, "nonfinite_over"),
            (reference, "nan_over"), (reference, "drop_nonfinite"),
            (reference, "poison_rows"), (reference, "seen_by_prefix")]


@pytest.fixture
def careful_calls(monkeypatch):
    """A dict counting the calls of each careful-path function."""
    counts = {}
    for module, name in _CAREFUL:
        fn = getattr(module, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **kw)
        monkeypatch.setattr(module, name, counted)
    return counts


def _qkv(n, heads=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, heads, n, d)).astype(np.float32) for _ in range(3))


def _record(name):
    names = {r.name for r in arrayattn.variants()}
    if name not in names:
        pytest.skip(f"{name} is not registered")
    return arrayattn.get_variant(name)


@pytest.mark.parametrize("n", [96, 2048], ids=["reference", "engine"])
@pytest.mark.parametrize("name,options,prefix", CASES, ids=[c[0] for c in CASES])
def test_finite_inputs_skip_the_careful_path(careful_calls, name, options, prefix, n):
    rec = _record(name)
    q, k, v = _qkv(n)
    out = np.asarray(rec(q, k, v, **options))
    assert np.isfinite(out).all()
    assert careful_calls == {}, f"the careful path ran on finite inputs: {careful_calls}"


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("n", [96, 2048], ids=["reference", "engine"])
@pytest.mark.parametrize("name,options,prefix", CASES, ids=[c[0] for c in CASES])
def test_nonfinite_inputs_take_the_careful_path(careful_calls, name, options, prefix, n,
                                                bad, where):
    rec = _record(name)
    q, k, v = _qkv(n)
    t = n // 3 + 1                          # inside a chunk, not at its start
    kz, vz = k.copy(), v.copy()
    kz[..., t, :], vz[..., t, :] = 0.0, 0.0
    want = np.asarray(rec(q, kz, vz, **options))
    careful_calls.clear()
    kb, vb = k.copy(), v.copy()
    (kb if where == "k" else vb)[..., t, 3] = bad
    got = np.asarray(rec(q, kb, vb, **options))
    assert careful_calls, "a non-finite value did not reach the careful path"
    seen = np.arange(n) >= t if prefix else np.ones(n, dtype=bool)
    assert np.isnan(got[..., seen, :]).all(), "a row that sees the bad token is not NaN"
    if name == "softmax" and n > 96:
        # the NumPy softmax engine has no NaN rows: the bad call runs the reference form,
        # the finite one the engine (float32 rounding apart), as in test_no_leak
        np.testing.assert_allclose(got[..., ~seen, :], want[..., ~seen, :], rtol=1e-5,
                                   atol=1e-6)
    else:
        np.testing.assert_array_equal(got[..., ~seen, :], want[..., ~seen, :])


def test_host_checks():
    x = np.ones((2, 3, 4), dtype=np.float32)
    assert finite_on_host(np, x, None, x[:0])
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[1, 2, 3] = bad
        assert not finite_on_host(np, x, y)
    # a sum that overflows only answers "not known": the careful path, never a wrong answer
    assert not finite_on_host(np, np.full(4, 3e38, dtype=np.float32))
    assert not finite_on_host(np, np.full(4, 1e20, dtype=np.float32))   # x . x overflows
    y = np.ones((3, 4), dtype=np.float32)[:, ::2].copy().T   # not C-contiguous: np.sum
    assert finite_on_host(np, y)
    y[0, 1] = np.nan
    assert not finite_on_host(np, y)
    g = np.zeros((2, 5, 1))
    g[0, 1] = -np.inf                       # a restart, not a fault
    assert nan_free_on_host(np, g)
    g[1, 2] = np.nan
    assert not nan_free_on_host(np, g)


def test_host_checks_read_nothing_elsewhere():
    """On other namespaces nothing is read (the careful path traces under jax.jit)."""
    strict = pytest.importorskip("array_api_strict")
    x = strict.ones((2, 3))
    assert not finite_on_host(strict, x)
    assert not nan_free_on_host(strict, x)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("n", [96, 2048], ids=["reference", "engine"])
@pytest.mark.parametrize("name", ["nystrom_iterative", "nystrom_svd"])
def test_nystrom_nonfinite_query(careful_calls, name, n, bad):
    """Nyström's engine proves ``q`` and ``k`` finite by their landmarks (a segment mean
    is finite only where every value is): a bad real query still makes its head NaN, and
    a bad *masked* query (left out of the landmarks) still takes the careful path, which
    leaves every row finite."""
    rec = _record(name)
    q, k, v = _qkv(n)
    qb = q.copy()
    qb[0, 1, n // 3, 2] = bad
    got = np.asarray(rec(qb, k, v))
    assert careful_calls, "a non-finite query did not reach the careful path"
    assert np.isnan(got[0, 1]).all() and np.isfinite(got[0, 0]).all()
    np.testing.assert_array_equal(got[0, 0], np.asarray(rec(q, k, v))[0, 0])
    careful_calls.clear()
    qm = np.ones((1, 2, n), dtype=bool)
    qm[..., n // 3] = False
    got = np.asarray(rec(qb, k, v, query_mask=qm))
    assert careful_calls, "a non-finite masked query did not reach the careful path"
    assert np.isfinite(got).all()
