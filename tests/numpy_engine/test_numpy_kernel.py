"""The NumPy engine of kernel attention (:mod:`arrayattn._numpy.kernel`) equals the
reference form :func:`arrayattn.reference.kernel_attention` to rounding when its blocks hold
several chunks: the causal chunked form's running chunk sums, each block's starting state
(also a caller's state), a padded last chunk, masked keys, broadcast batches, and the
non-causal form's key blocks summed and query blocks divided into the output."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import reference
from arrayattn._numpy import kernel as engine
from arrayattn._numpy.parallel import split_everything


def _features(rng, batch, n, m, dv):
    # positive features with a realistic spread (exp of a sharp logit), as elu+1 and FAVOR+
    pq = np.exp(2.0 * rng.standard_normal((*batch, n, m)))
    pk = np.exp(2.0 * rng.standard_normal((*batch, n, m)))
    v = rng.standard_normal((*batch, n, dv))
    return pq, pk, v


def _run(pq, pk, v, *, causal, chunk, sz0=None, key_mask=None, eps=1e-300):
    n, s = pq.shape[-2], pk.shape[-2]
    batch = np.broadcast_shapes(pq.shape[:-2], pk.shape[:-2], v.shape[:-2])
    v = v if key_mask is None else np.where(key_mask[..., None], v, 0.0)
    return engine.kernel_attention(
        v, query_features=engine.rows_of(pq), key_features=engine.rows_of(pk), n=n, s=s,
        batch=batch, causal=causal, key_mask=key_mask, method="chunked", chunk=chunk,
        sz0=sz0, eps=eps, m=pq.shape[-1])


def _assert_close(got, want, pq, pk, v, *, causal, chunk, sz0=None, key_mask=None):
    """Within a sum's rounding: each output is a ratio of sums of up to ``n + 1`` terms,
    so its error is at most ``~(n + 1) eps`` times the same ratio over ``|v|`` (the scale of
    the terms, not of their possibly cancelling sum)."""
    absz = None if sz0 is None else np.abs(sz0)
    scale, _ = reference.kernel_attention(pq, pk, np.abs(v), causal=causal,
                                          method="chunked", chunk_size=chunk,
                                          key_mask=key_mask, eps=1e-300, state=absz)
    bound = 4 * (pk.shape[-2] + 1) * np.finfo(got.dtype).eps * scale
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


CASES = [  # batch, n, m, dv, chunk, units (chunks or rows a block)
    ((2, 3), 96, 6, 5, 8, 3),
    ((2,), 100, 4, 3, 8, 2),      # a padded last chunk (100 = 12 * 8 + 4)
    ((1,), 61, 5, 4, 7, 4),       # odd chunk, padded
    ((3,), 40, 3, 2, 40, 1),      # one chunk
    ((2,), 33, 4, 3, 4, 5),
]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch,n,m,dv,chunk,units", CASES)
def test_blocks_of_several_chunks_equal_reference(rng, batch, n, m, dv, chunk, units, causal,
                                                  with_state):
    pq, pk, v = _features(rng, batch, n, m, dv)
    sz0 = None
    if with_state:   # the state of earlier keys: positive key sums, value sums
        sz0 = np.concatenate([rng.standard_normal((*batch, m, dv)),
                              np.exp(rng.standard_normal((*batch, m, 1)))], axis=-1) * n
    want, want_sz = reference.kernel_attention(pq, pk, v, causal=causal, method="chunked",
                                               chunk_size=chunk, eps=1e-300, state=sz0)
    with split_everything(2, units=units):
        got, got_sz = _run(pq, pk, v, causal=causal, chunk=chunk, sz0=sz0)
    _assert_close(got, want, pq, pk, v, causal=causal, chunk=chunk, sz0=sz0)
    # the state's key sums are positive: relative; its value sums cancel: against |v|
    _, scale = reference.kernel_attention(pq, pk, np.abs(v), chunk_size=chunk, eps=1e-300,
                                          state=None if sz0 is None else np.abs(sz0))
    np.testing.assert_array_less(np.abs(np.broadcast_to(got_sz, want_sz.shape) - want_sz),
                                 4 * (n + 1) * np.finfo(float).eps * scale + 1e-300)


@pytest.mark.parametrize("causal", [False, True])
def test_masked_keys_and_broadcast_batches(rng, causal):
    pq, _, _ = _features(rng, (2, 1), 50, 4, 3)
    _, pk, v = _features(rng, (1, 3), 50, 4, 3)
    key_mask = rng.random((2, 3, 50)) < 0.7
    want, _ = reference.kernel_attention(pq, pk, v, causal=causal, method="chunked",
                                         chunk_size=6, key_mask=key_mask, eps=1e-300)
    with split_everything(2, units=3):
        got, _ = _run(pq, pk, v, causal=causal, chunk=6, key_mask=key_mask)
    _assert_close(got, want, pq, pk, v, causal=causal, chunk=6, key_mask=key_mask)


@pytest.mark.parametrize("feature_map", ["elu+1", "relu", "cosine"])
def test_public_call_split_equals_reference(rng, feature_map):
    """The public causal call on the engine, its blocks several chunks long, against the
    reference form; float32 (the benchmarks' dtype) to float32 rounding."""
    q, k, v = (3.0 * rng.standard_normal((2, 4, 200, 16)).astype(np.float32)
               for _ in range(3))
    with arrayattn.use_engine("reference"):
        want = arrayattn.linear_attention(q, k, v, feature_map=feature_map, causal=True,
                                          chunk_size=16)
    for units in (1, 2, 3, 13):
        with arrayattn.use_engine("numpy"), split_everything(2, units=units):
            got = arrayattn.linear_attention(q, k, v, feature_map=feature_map, causal=True,
                                             chunk_size=16)
        assert got.dtype == np.float32
        # the running sums add up to n = 200 float32 terms in another order
        np.testing.assert_allclose(got, want, rtol=200 * np.finfo(np.float32).eps,
                                   atol=1e-5)

