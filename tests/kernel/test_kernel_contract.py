"""The contract holes of issue #15 for the kernel family (linear_*, efficient,
performer_*, rfa): padded keys and values holding NaN/inf, s = 0, concurrent calls,
string flags, seeds, bad options and non-array feature maps -- each a clear answer."""
from __future__ import annotations


import numpy as np
import pytest

import arrayattn
from arrayattn import (RandomFeatures, linear_attention, linear_attention_state,
                       performer_attention, rfa_attention, taylor_feature_map)
from arrayattn.testing import xp_assert_equal

from conftest import make_qkv, skip_jax_compile

FAMILY = [r.name for r in arrayattn.variants()
          if r.name.startswith(("linear_", "performer_", "rfa", "efficient"))]


def _record(name):
    return next(r for r in arrayattn.variants() if r.name == name)


@pytest.mark.parametrize("name", FAMILY)
def test_padded_keys_and_values_never_leak(backend, rng, name):
    """NaN and inf in the masked rows of k and v: the output equals the output with those
    rows zero, bit for bit (they are replaced once, not multiplied by 0), causal too."""
    if backend.name == "jax" and name not in ("linear_elu", "performer_favorpp", "rfa"):
        skip_jax_compile(backend, "linear_elu, performer_favorpp and rfa on jax")
    rec = _record(name)
    q, k, v = make_qkv(rng, batch=(2,), n=12, s=12, d=8, dv=3, norm=2.0)
    km = np.ones((2, 12), dtype=bool)
    km[:, -3:] = False
    km[1, 4] = False
    for causal in (False, True) if rec.causal else (False,):
        outs = []
        for fill in (0.0, np.nan, np.inf):
            kk, vv = k.copy(), v.copy()
            kk[~km], vv[~km] = fill, -fill
            args = [backend.asarray(x, "float64") for x in (q, kk, vv)]
            outs.append(rec(*args, causal=causal, key_mask=backend.asarray(km)))
        assert np.isfinite(backend.to_numpy(outs[0])).all()
        for out in outs[1:]:
            xp_assert_equal(out, outs[0])


@pytest.mark.parametrize("name", FAMILY)
def test_no_keys_gives_zeros(backend, name):
    """s = 0: every query attends to nothing, so the output is zeros (n = 0 too)."""
    skip_jax_compile(backend, "the numpy backends (a shape check, no arithmetic)")
    rec = _record(name)
    for n in (3, 0):
        q = backend.asarray(np.ones((2, n, 4)), "float32")
        k = backend.asarray(np.ones((2, 0, 4)), "float32")
        v = backend.asarray(np.ones((2, 0, 5)), "float32")
        out = rec(q, k, v)
        assert tuple(out.shape) == (2, n, 5) and out.dtype == q.dtype
        assert not np.asarray(backend.to_numpy(out)).any()


@pytest.mark.parametrize("causal", [False, True])
def test_relu_query_with_all_zero_kernel_values_returns_zeros(backend, causal, rng):
    """The relu map, a query with no positive coordinate: every kernel value is 0 and the
    normalised output is 0 / 0.  It returns zeros (documented in linear_attention's
    docstring and docs/variants/kernel.rst), not the mean of v and not NaN; the other rows
    are untouched; its implied attention row is all zeros (row sum 0, not 1)."""
    from arrayattn import attention_matrix, linear_attention
    q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
    q = np.abs(q)
    q[:, 2] = -q[:, 2]                         # query 2 alone: no positive coordinate
    k = np.abs(k)                              # every key has positive features
    on = backend.asarray
    out = backend.to_numpy(linear_attention(on(q), on(k), on(v), feature_map="relu",
                                            causal=causal))
    np.testing.assert_array_equal(out[:, 2], 0.0)
    assert np.isfinite(out).all()
    mean_v = v[:, :3].mean(axis=-2) if causal else v.mean(axis=-2)
    assert not np.allclose(out[:, 2], mean_v)
    others = [0, 1, 3, 4, 5]
    want = linear_attention(q, k, v, feature_map="relu", causal=causal)
    np.testing.assert_allclose(out[:, others], want[:, others], rtol=1e-12, atol=1e-12)
    a = attention_matrix("linear_relu", q, k, causal=causal)
    np.testing.assert_array_equal(a[:, 2], 0.0)
    np.testing.assert_allclose(np.delete(a, 2, axis=1).sum(axis=-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("name", FAMILY)
def test_flags_are_bools(name):
    rec = _record(name)
    q = k = v = np.ones((4, 8))
    for bad in ("False", 1, None):
        with pytest.raises(TypeError, match="causal must be True or False"):
            rec(q, k, v, causal=bad)
    if name.startswith("linear_"):
        with pytest.raises(TypeError, match="return_state must be True or False"):
            linear_attention(q, k, v, return_state="yes")


@pytest.mark.parametrize("fn", [performer_attention, rfa_attention])
@pytest.mark.parametrize("seed, exc", [(None, TypeError), (-1, ValueError),
                                       (2.5, TypeError), ("x", TypeError)])
def test_seed_rule(fn, seed, exc):
    with pytest.raises(exc, match="seed must be a non-negative integer"):
        fn(np.ones((4, 8)), np.ones((4, 8)), np.ones((4, 8)), seed=seed)


class TestBadOptions:
    def test_taylor_scale(self):
        with pytest.raises(ValueError, match="input_scale"):
            taylor_feature_map(-1)

    def test_complex_omega(self):
        with pytest.raises(TypeError, match="omega must be a real matrix"):
            RandomFeatures.from_matrix(np.ones((4, 8), dtype=complex))

    def test_identity_projection_needs_m_equal_d(self):
        q = np.ones((4, 8))
        with pytest.raises(ValueError, match=r"projection='identity'.*num_features=16"):
            performer_attention(q, q, q, kind="relu", projection="identity",
                                num_features=16)
        out = performer_attention(q, q, q, kind="relu", projection="identity")
        assert out.shape == (4, 8)

    @pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trig", "favor++", "relu"])
    def test_absurd_num_features_fails_fast(self, kind):
        q = np.ones((4, 64))
        with pytest.raises(ValueError, match=r"num_features \(m\) = 1000000000000"):
            performer_attention(q, q, q, kind=kind, num_features=10**12)
        with pytest.raises(ValueError, match="num_features"):
            rfa_attention(q, q, q, num_features=10**12)

    def test_state_namespace(self):
        torch = pytest.importorskip("torch")
        for bad in ("numpy", np.ones(3), torch.ones(3)):
            with pytest.raises(TypeError, match="xp must be an array namespace"):
                linear_attention_state(bad, (2,), 4, 5)

    def test_feature_map_must_return_an_array(self):
        q = np.ones((4, 8))
        with pytest.raises(TypeError, match="feature_map's query map output must be an "
                                            "array"):
            linear_attention(q, q, q, feature_map=lambda x: x.tolist())
        with pytest.raises(TypeError, match="feature_map's key map output"):
            linear_attention(q, q, q, feature_map=(lambda x: x, lambda x: None))
        with pytest.raises(TypeError, match="feature_map's query map output"):
            linear_attention_state(np, (), 8, 8, feature_map=lambda x: "no")
        st = linear_attention_state(np, (), 8, 8, feature_map="relu")
        bad = arrayattn.FeatureMap("bad", lambda x: "no", lambda x: "no", dim=lambda d: d)
        with pytest.raises(TypeError, match="feature_map's query map output"):
            arrayattn.linear_attention_step(q[0], q[0], q[0],
                                            type(st)(st.S, st.z, 0, bad))

# The same call from 4 threads at once equals the serial call: every variant, causal or
# not, in tests/numpy_engine/test_numpy_parallel.py::test_concurrent_calls_bit_identical.
