"""The NumPy engine of the chunked delta rule (:mod:`arrayattn._numpy.delta`) equals the
reference form :func:`arrayattn.reference.delta_chunked` to rounding: odd lengths and
chunks, batch broadcasting, no gate (DeltaNet's shortcut), gates with ``-inf`` restarts,
initial states; and the public calls it serves agree with the reference form, non-finite
tokens included."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import reference
from arrayattn._numpy import delta as engine


def _inputs(rng, batch, n, dk, dv, gate, dtype=np.float64):
    q, k = (rng.standard_normal((*batch, n, dk)) for _ in range(2))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((*batch, n, dv))
    beta = rng.uniform(size=(*batch, n))
    if gate == "none":
        g = np.zeros((n, 1))
    else:
        g = np.log(rng.uniform(0.3, 1.0, size=(*batch, n, 1)))
        if gate == "restart":
            g[..., n // 2, :] = -np.inf
    s0 = 0.1 * rng.standard_normal((*batch, dk, dv))
    return tuple(x.astype(dtype) for x in (q, k, v, beta, g, s0))


@pytest.mark.parametrize("gate", ["none", "gated", "restart"])
@pytest.mark.parametrize("batch,n,c", [((2, 3), 37, 16), ((1,), 5, 16), ((3,), 100, 7),
                                       ((2,), 64, 16), ((), 33, 1)])
def test_equals_reference(rng, batch, n, c, gate):
    q, k, v, beta, g, s0 = _inputs(rng, batch, n, 8, 5, gate)
    want_o, want_s = reference.delta_chunked(q, k, v, beta, g, s0, c)
    got_o, got_s = engine.delta_chunked(q, k, v, beta, g, s0, c)
    assert got_o.shape == want_o.shape and got_s.shape == want_s.shape
    np.testing.assert_allclose(got_o, want_o, rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(got_s, want_s, rtol=1e-10, atol=1e-11)


def test_broadcast_batches(rng):
    """q with more heads than k, v, beta and the gates (grouped heads), and the reverse."""
    q, k, v, beta, g, s0 = _inputs(rng, (2, 3), 37, 8, 5, "gated")
    for args in [(q, k[:, :1], v[:, :1], beta[:, :1], g[:, :1], s0[:1, :1]),
                 (q[:1, :1], k, v, beta, g, s0)]:
        want = reference.delta_chunked(*args, 16)
        got = engine.delta_chunked(*args, 16)
        for x, y in zip(got, want):
            assert x.shape == y.shape
            np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-11)


def test_unit_lower_inverse(rng):
    a = np.tril(rng.standard_normal((3, 4, 16, 16)), k=-1)
    np.testing.assert_allclose(engine.unit_lower_inverse(a),
                               np.linalg.inv(np.eye(16) + a), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
@pytest.mark.parametrize("bad", [None, np.nan, np.inf])
def test_public_calls_engine_equals_reference(rng, name, bad):
    rec = arrayattn.get_variant(name)
    q, k, v = (rng.standard_normal((1, 2, 80, 8)).astype(np.float32) for _ in range(3))
    if bad is not None:
        v[0, 1, 41, 2] = bad
    outs = {}
    for choice in ("numpy", "reference"):
        with arrayattn.use_engine(choice):
            outs[choice] = np.asarray(rec(q, k, v, causal=True))
    np.testing.assert_allclose(outs["numpy"], outs["reference"], rtol=2e-5, atol=2e-6)
    if bad is not None:
        assert np.isnan(outs["numpy"][0, 1, 41:]).all()
        assert np.isfinite(outs["numpy"][0, 1, :41]).all()
        assert np.isfinite(outs["numpy"][0, 0]).all()


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
def test_public_calls_run_the_engine(monkeypatch, rng, name):
    calls = []
    real = engine.delta_chunked
    monkeypatch.setattr(engine, "delta_chunked", lambda *a: calls.append(1) or real(*a))
    q, k, v = (rng.standard_normal((1, 8, 512, 64)).astype(np.float32) for _ in range(3))
    arrayattn.get_variant(name)(q, k, v, causal=True)
    assert calls, "the NumPy engine did not run"
