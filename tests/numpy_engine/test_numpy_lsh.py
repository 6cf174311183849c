"""The NumPy engine of LSH attention (:mod:`arrayattn._numpy.lsh`) equals the reference
form :func:`arrayattn.reference.lsh_attention_chunked` to rounding: odd lengths and chunk
sizes, broadcast batches, one round and many, causal, padding, without the duplicate
count, one bucket and per-head rotations (the reference's hash), rounds split over the
threads; its hash gives the reference's buckets bit for bit (ties and zero rows
included); and the public calls it serves agree with the reference form, non-finite
tokens included."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import reference
from arrayattn._numpy import lsh as engine
from arrayattn._numpy.parallel import split_everything


def _case(rng, batch, n, d, dv, H, nb, *, rot_batch=()):
    qk = 3.0 * rng.standard_normal((*batch, n, d))     # sharp: |qk| ~ 3 sqrt(d)
    v = rng.standard_normal((*batch, n, dv))
    rot = rng.standard_normal((*rot_batch, H, d, nb // 2))
    return qk, v, rot


CASES = [  # batch, n, d, dv, H, C, nb
    ((2, 3), 100, 8, 5, 3, 16, 4),
    ((1,), 37, 8, 4, 1, 8, 2),
    ((2,), 64, 8, 4, 4, 64, 8),
    ((2,), 200, 16, 4, 2, 7, 58),
    ((), 33, 4, 3, 3, 5, 1),           # one bucket: the reference's hash
    ((3,), 1, 4, 2, 2, 4, 2),          # one token: it attends to itself
]


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,n,d,dv,H,C,nb", CASES)
def test_equals_reference(rng, batch, n, d, dv, H, C, nb, causal, dedup):
    qk, v, rot = _case(rng, batch, n, d, dv, H, nb)
    opts = dict(num_buckets=nb, chunk_size=C, scale=0.3, causal=causal, dedup=dedup)
    want = reference.lsh_attention_chunked(qk, v, rot, **opts)
    got = engine.lsh_attention_chunked(qk, v, rot, **opts)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_rounds_split_over_threads(rng, causal):
    """Fewer batch rows than threads: a (row, round) per item, merged afterwards."""
    qk, v, rot = _case(rng, (1,), 150, 8, 4, 4, 8)
    opts = dict(num_buckets=8, chunk_size=16, scale=0.5, causal=causal)
    want = reference.lsh_attention_chunked(qk, v, rot, **opts)
    with split_everything(2):
        got = engine.lsh_attention_chunked(qk, v, rot, **opts)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_broadcast_batches_and_per_head_rotations(rng):
    qk, v, rot = _case(rng, (2, 1), 60, 8, 3, 2, 6, rot_batch=(3,))
    v = np.broadcast_to(rng.standard_normal((1, 3, 60, 3)), (2, 3, 60, 3))
    opts = dict(num_buckets=6, chunk_size=8, scale=0.4)
    want = reference.lsh_attention_chunked(qk, v, rot, **opts)
    got = engine.lsh_attention_chunked(qk, v, rot, **opts)
    assert got.shape == want.shape == (2, 3, 60, 3)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("causal", [False, True])
def test_padding(rng, causal):
    qk, v, rot = _case(rng, (2,), 90, 8, 4, 3, 6)
    key_mask = rng.uniform(size=(2, 90)) < 0.7
    qk[~key_mask] = np.nan          # padding may hold anything
    opts = dict(num_buckets=6, chunk_size=16, scale=0.3, causal=causal, key_mask=key_mask)
    want = reference.lsh_attention_chunked(qk, v, rot, **opts)
    got = engine.lsh_attention_chunked(qk, v, rot, **opts)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)
    assert (got[~key_mask] == 0).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hash_bit_for_bit(rng, dtype):
    """Row blocks over the threads, ties (zero rows: every projection 0) and a NaN row
    (argmax and argmin both take its first NaN) hash as the reference does."""
    qk = rng.standard_normal((2, 3000, 16)).astype(dtype)
    qk[0, 5] = 0.0
    qk[1, 7, 3] = np.nan
    rot = rng.standard_normal((4, 16, 32)).astype(dtype)
    want = reference.lsh_hash(qk, rot, 64)
    with split_everything(2):
        got = engine.lsh_hash(qk, rot, 64)
    assert got.shape == want.shape == (2, 4, 3000)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(engine.lsh_hash(qk, rot, 64), want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_public_calls_engine_equals_reference(rng, causal, bad):
    rec = arrayattn.get_variant("lsh")
    q, v = (rng.standard_normal((1, 2, 300, 16)).astype(np.float32) for _ in range(2))
    if bad is not None:
        v[0, 1, 41, 2] = bad
    outs = {}
    for choice in ("numpy", "reference"):
        with arrayattn.use_engine(choice):
            outs[choice] = np.asarray(rec(q, q, v, causal=causal, chunk_size=32))
    np.testing.assert_allclose(outs["numpy"], outs["reference"], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(np.isnan(outs["numpy"]), np.isnan(outs["reference"]))
    if bad is not None:   # exactly the rows that see token 41 (and 41 itself, if alone)
        assert np.isnan(outs["numpy"][0, 1]).any()
        assert np.isfinite(outs["numpy"][0, 0]).all()


def test_public_calls_run_the_engine(monkeypatch, rng):
    calls = []
    real = engine.lsh_attention_chunked
    monkeypatch.setattr(engine, "lsh_attention_chunked",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    q, v = (rng.standard_normal((1, 8, 512, 64)).astype(np.float32) for _ in range(2))
    arrayattn.lsh_attention(q, v)
    assert calls, "the NumPy engine did not run"
