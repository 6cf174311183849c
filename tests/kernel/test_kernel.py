"""Kernel (linear) attention, its three causal forms, the decoding state, efficient attention.

The oracles below are written straight from the definitions, one query and one key at a
time in float64: the kernels from their closed forms (``1 + cos(q, k)``, ``1 + t +
t^2/2``), not from the feature maps under test.
"""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import arrayattn
from arrayattn import (LinearAttentionState, efficient_attention, feature_attention,
                       feature_attention_step, get_feature_map, linear_attention,
                       linear_attention_state, linear_attention_step, taylor_feature_map)
from arrayattn.kernel.feature_maps import FEATURE_MAPS
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import make_qkv, skip_jax_compile
from oracle import allowed_matrix
from tolerances import round_to, working_eps

MAPS = ["elu+1", "relu", "cosine", "taylor"]
FORMS = [None, "recurrent", "cumsum", "chunked"]   # None: non-causal
METHODS = ["recurrent", "cumsum", "chunked"]


# ---------------------------------------------------------------------------------------
# Oracles: plain float64, one pair at a time.
# ---------------------------------------------------------------------------------------

def kernel_plain(name, q, k, a=1.0):
    """kappa(q, k) and the same sum taken over absolute values (for the error bound)."""
    q, k = np.asarray(q, float), np.asarray(k, float)
    if name == "elu+1":
        f = lambda x: np.array([xi + 1.0 if xi > 0 else math.exp(xi) for xi in x])  # noqa
        val = float(f(q) @ f(k))
        return val, val
    if name == "relu":
        val = float(np.maximum(q, 0) @ np.maximum(k, 0))
        return val, val
    if name == "cosine":
        nq, nk = math.sqrt(q @ q), math.sqrt(k @ k)
        cos = 0.0 if nq == 0 or nk == 0 else float(q @ k) / (nq * nk)
        return 1.0 + cos, 2.0
    if name == "taylor":
        t = a * a * float(q @ k)
        ta = a * a * float(np.abs(q) @ np.abs(k))
        return 1.0 + t + t * t / 2.0, 1.0 + ta + ta * ta / 2.0
    raise ValueError(name)


def linear_oracle(name, q, k, v, *, causal=False, key_mask=None, a=1.0):
    """out_i = sum_j kappa(q_i, k_j) v_j / sum_j kappa(q_i, k_j) over allowed j, and
    R_i = sum_j |kappa|_ij / |den_i| (the cancellation factor of the error bound)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, s = q.shape[-2], k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    allowed = allowed_matrix(n, s, batch=batch, causal=causal, key_mask=key_mask)
    batch = allowed.shape[:-2]
    q = np.broadcast_to(q, (*batch, *q.shape[-2:]))
    k = np.broadcast_to(k, (*batch, *k.shape[-2:]))
    v = np.broadcast_to(v, (*batch, *v.shape[-2:]))
    out = np.zeros((*batch, n, v.shape[-1]))
    ratio = np.zeros((*batch, n))
    for idx in np.ndindex(*batch):
        for i in range(n):
            num, den, absum = 0.0, 0.0, 0.0
            for j in np.flatnonzero(allowed[idx][i]):
                w, wa = kernel_plain(name, q[idx][i], k[idx][j], a)
                num = num + w * v[idx][j]
                den += w
                absum += wa
            if den != 0.0:
                out[idx][i] = num / den
                ratio[idx][i] = absum / abs(den)
    return out, ratio


def linear_atol(dtype, name, d, s, v, ratio):
    """Rounding bound: each kernel value is a length-m dot product of features that carry
    a few ulps each (relative error (m + 8) u of the absolute sum), numerator and
    denominator are sums over <= s keys; u = eps/2, doubled for the ratio."""
    m = FEATURE_MAPS[name].output_dim(d)
    eps = working_eps(dtype)
    return eps * float(np.abs(v).max()) * ((m + 8) * float(ratio.max(initial=1.0)) + s + 8)


def _skip_heavy(backend, name="elu+1", dtype="float64"):
    """JAX in eager mode compiles every operation per new shape (0.1-0.2 s each on a
    loaded machine, 30-50 per call).  On JAX the map- and dtype-agnostic machinery runs
    with ``elu+1`` in float64, and numerical-only checks (same arithmetic on every
    backend) are left to the other backends.  Every map is still checked on JAX by
    ``test_kernel_identity`` and by the registry tests (which run each record's
    default causal form on JAX), and every form by ``test_matches_oracle``."""
    if backend.name == "jax" and (name != "elu+1" or dtype != "float64"):
        pytest.skip("JAX: elu+1/float64 only here (maps: test_kernel_identity, registry)")


def _dev(backend, dtype, *arrays):
    return [backend.asarray(round_to(x, dtype), dtype) for x in arrays]


def _problem(rng, n, s, *, d=8, dv=5, norm=6.0):
    q, k, v = make_qkv(rng, batch=(2, 3), n=n, s=s, d=d, dv=dv, norm=norm)
    k, v = k[:, :1], v[:, :1]            # k, v broadcast over the head axis
    km = rng.random((2, 3, s)) < 0.75
    return q, k, v, km


# ---------------------------------------------------------------------------------------

class TestFeatureMaps:
    @pytest.mark.parametrize("name", MAPS)
    def test_kernel_identity(self, backend, rng, name):
        fm = get_feature_map(name)
        q, k, _ = make_qkv(rng, batch=(), n=6, s=7, d=5, norm=3.0)
        q[0] = 0.0  # a zero row (cosine: cos taken as 0, never NaN)
        fq = fm.query(backend.asarray(q))
        fk = fm.key(backend.asarray(k))
        assert fq.shape == (6, fm.output_dim(5)) and fk.shape == (7, fm.output_dim(5))
        got = fq @ backend.xp.matrix_transpose(fk)
        ref = np.array([[kernel_plain(name, qi, kj)[0] for kj in k] for qi in q])
        absum = np.array([[kernel_plain(name, qi, kj)[1] for kj in k] for qi in q])
        m = fm.output_dim(5)
        xp_assert_close(got, backend.asarray(ref), rtol=0,
                        atol=float((m + 8) * 2.2e-16 * absum.max()))

    @pytest.mark.parametrize("name", ["elu+1", "relu"])
    def test_nonnegative_and_finite_at_extremes(self, backend, name):
        x = np.array([[-1e4, -50.0, -1.0, -1e-300, 0.0, 1e-300, 1.0, 50.0, 1e4]])
        fm = get_feature_map(name)
        assert fm.nonnegative
        for dtype in ("float32", "float64"):
            phi = backend.to_numpy(fm.query(backend.asarray(x, dtype)))
            assert np.isfinite(phi).all() and (phi >= 0).all()
        if name == "elu+1":  # strictly positive where it does not underflow
            assert (backend.to_numpy(fm.key(backend.asarray(x[:, 1:]))) > 0).all()

    def test_kernels_nonnegative_where_features_are_not(self, rng):
        # cosine and taylor have negative features but kernels >= 0 (> 0 for taylor).
        q, k, _ = make_qkv(rng, batch=(), n=40, s=40, d=6, norm=5.0)
        for name, strict in (("cosine", False), ("taylor", True)):
            fm = get_feature_map(name)
            a = fm.query(q) @ fm.key(k).T
            assert (fm.query(q) < 0).any()
            assert (a > 0).all() if strict else (a >= -4 * 2.2e-16).all()
        # exactly antiparallel: 1 + cos = 0 to rounding
        fm = get_feature_map("cosine")
        x = rng.standard_normal(6)
        assert abs(float(fm.query(x) @ fm.key(-3.0 * x))) < 8 * 2.2e-16

    def test_taylor_input_scale(self, rng):
        q, k, _ = make_qkv(rng, batch=(), n=3, s=4, d=4)
        a = 4 ** -0.25
        fm = taylor_feature_map(a)
        ref = np.array([[kernel_plain("taylor", qi, kj, a)[0] for kj in k] for qi in q])
        np.testing.assert_allclose(fm.query(q) @ fm.key(k).T, ref, rtol=1e-14)
        assert fm.name == "taylor(input_scale=0.707107)" and fm.output_dim(4) == 21

    def test_user_maps(self, rng):
        fq = lambda x: np.exp(x)          # noqa: E731
        fk = lambda x: np.exp(-x)         # noqa: E731
        fm = get_feature_map((fq, fk))
        assert fm.output_dim(3) == 3 and fm.dim is None
        q, k, v = make_qkv(rng, batch=(), n=4, s=5, d=3)
        out = linear_attention(q, k, v, feature_map=(fq, fk))
        a = fq(q) @ fk(k).T
        np.testing.assert_allclose(out, a @ v / a.sum(-1, keepdims=True), rtol=1e-13)
        single = linear_attention(q, k, v, feature_map=fq, causal=True)
        a = np.tril(fq(q) @ fq(k).T, k=1)  # end-aligned: s - n = 1
        np.testing.assert_allclose(single, a @ v / a.sum(-1, keepdims=True), rtol=1e-13)

    def test_bad_specs(self):
        with pytest.raises(ValueError, match=r"feature_map must be one of \['cosine', 'elu\+1'"):
            get_feature_map("elu")
        with pytest.raises(TypeError, match="feature_map must be a name"):
            get_feature_map(3)
        for bad in (0.0, -1, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="input_scale must be a finite number > 0"):
                taylor_feature_map(bad)


class TestLinearAttention:
    # Tests loop over the forms inside one test: JAX compiles every primitive per shape
    # in eager mode, so shared shapes keep the suite fast.

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    @pytest.mark.parametrize("name", MAPS)
    def test_matches_oracle(self, backend, rng, dtype, name):
        _skip_heavy(backend, name, dtype)
        # n=7 < s=11 (end-aligned), key mask, k/v broadcast over heads, chunk 4 (no divisor).
        q, k, v, km = _problem(rng, 7, 11)
        args = _dev(backend, dtype, q, k, v)
        for form in FORMS:
            out = linear_attention(*args, feature_map=name, causal=form is not None,
                                   method=form, chunk_size=4, key_mask=backend.asarray(km))
            ref, ratio = linear_oracle(name, *(round_to(x, dtype) for x in (q, k, v)),
                                       causal=form is not None, key_mask=km)
            atol = linear_atol(dtype, name, 8, 11, v, ratio)
            xp_assert_close(out, backend.asarray(ref, dtype), rtol=0, atol=atol,
                            err_msg=f"form={form}")

    @pytest.mark.parametrize("n, s", [(11, 5), (16, 16), (5, 40), (1, 1)])
    def test_causal_shapes(self, backend, rng, n, s):
        if (n, s) != (11, 5):
            skip_jax_compile(backend, "the other backends")
        # n > s (leading queries see no key -> 0), n = s a multiple of the chunk, n << s,
        # a single token.
        q, k, v, km = _problem(rng, n, s, norm=3.0)
        ref, ratio = linear_oracle("elu+1", q, k, v, causal=True, key_mask=km)
        for method in METHODS:
            out = linear_attention(*_dev(backend, "float64", q, k, v), causal=True,
                                   method=method, chunk_size=8, key_mask=backend.asarray(km))
            xp_assert_close(out, backend.asarray(ref), rtol=0, err_msg=f"method={method}",
                            atol=linear_atol("float64", "elu+1", 8, s, v, ratio))
            if n > s:
                assert (backend.to_numpy(out)[..., : n - s, :] == 0).all()

    def test_chunk_sizes_agree_with_recurrent(self, backend, rng):
        skip_jax_compile(backend, "the other backends")
        q, k, v, _ = _problem(rng, 23, 23, norm=3.0)
        args = _dev(backend, "float64", q, k, v)
        b = linear_attention(*args, causal=True, method="recurrent")
        for chunk_size in (1, 3, 16, 100):
            a = linear_attention(*args, causal=True, chunk_size=chunk_size)
            xp_assert_close(a, b, rtol=0, atol=64 * 23 * 2.2e-16 * float(np.abs(v).max()))

    def test_causality_bit_for_bit(self, backend, rng):
        q, k, v, km = _problem(rng, 9, 12, norm=3.0)
        cut = 7          # keys >= 7 are in the future of queries < 7 - (12 - 9) = 4
        k2, v2 = k.copy(), v.copy()
        k2[..., cut:, :] = 50.0 * rng.standard_normal(k2[..., cut:, :].shape)
        v2[..., cut:, :] = -1e3
        for method in METHODS:
            runs = [linear_attention(*(backend.asarray(x) for x in args), causal=True,
                                     method=method, chunk_size=4,
                                     key_mask=backend.asarray(km))
                    for args in ((q, k, v), (q, k2, v2))]
            xp_assert_equal(runs[0][..., :4, :], runs[1][..., :4, :], err_msg=method)
            assert not np.array_equal(backend.to_numpy(runs[0])[..., 4:, :],
                                      backend.to_numpy(runs[1])[..., 4:, :])

    @pytest.mark.parametrize("name", MAPS)
    def test_constant_values_returned(self, backend, rng, name):
        skip_jax_compile(backend, "the other backends")  # rows sum to 1 on JAX: tests/registry/test_registry.py
        q, k, _, km = _problem(rng, 10, 10, norm=6.0)
        km[..., 0] = True       # every causal row sees at least one key
        const = np.full((2, 1, 10, 3), -1.75)
        for form in FORMS:
            out = linear_attention(*(backend.asarray(x) for x in (q, k, const)),
                                   feature_map=name, causal=form is not None, method=form,
                                   chunk_size=3, key_mask=backend.asarray(km))
            _, ratio = linear_oracle(name, q, k, const, causal=form is not None,
                                     key_mask=km)
            xp_assert_close(out, backend.asarray(np.full((2, 3, 10, 3), -1.75)), rtol=0,
                            atol=linear_atol("float64", name, 8, 10, const, ratio),
                            err_msg=f"form={form}")

    def test_key_mask_removes_keys_exactly(self, backend, rng):
        # A masked key's features become exact zeros: changing it changes nothing, bit for
        # bit, and an all-masked row is zero (not NaN).
        q, k, v, km = _problem(rng, 6, 8, norm=3.0)
        km[0, 0] = False
        k, v = (np.broadcast_to(x, (2, 3, *x.shape[-2:])) for x in (k, v))
        k2, v2 = k.copy(), v.copy()
        k2[~km] = 7.0
        v2[~km] = 1e6
        for form in FORMS:
            kw = dict(causal=form is not None, method=form, chunk_size=4,
                      key_mask=backend.asarray(km))
            a = linear_attention(*(backend.asarray(x) for x in (q, k, v)), **kw)
            b = linear_attention(*(backend.asarray(x) for x in (q, k2, v2)), **kw)
            xp_assert_equal(a, b, err_msg=f"form={form}")
            assert (backend.to_numpy(a)[0, 0] == 0).all()

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_half_precision_accumulates_in_float32(self, backend, rng, dtype):
        if dtype == "float16":
            skip_jax_compile(backend, "the other backends")
        if dtype == "bfloat16" and backend.name not in ("torch", "jax"):
            pytest.skip(f"{backend.name} has no bfloat16")
        if not hasattr(backend.xp, dtype):
            pytest.skip(f"{backend.name} has no {dtype}")
        q, k, v = make_qkv(rng, batch=(2,), n=128, s=128, d=16, norm=2.0)
        q, k, v = (round_to(x, dtype) for x in (q, k, v))
        # The float32 result rounded once to the half format (plus float32 noise).
        # Accumulating 128 keys in the half format would be off by ~ 100 half ulps.
        half = 2.0 ** -8 if dtype == "bfloat16" else 2.0 ** -11
        for method in (None, "chunked", "recurrent"):
            out = linear_attention(*(backend.asarray(x, dtype) for x in (q, k, v)),
                                   causal=method is not None, method=method)
            ref = linear_attention(*(backend.asarray(x, "float32") for x in (q, k, v)),
                                   causal=method is not None, method=method)
            assert out.dtype == backend.dtype(dtype)
            ref_np = backend.to_numpy(ref)
            atol = half * np.abs(ref_np).max() + 1e-5 * np.abs(v).max()
            np.testing.assert_allclose(backend.to_numpy(out).astype(np.float64), ref_np,
                                       rtol=0, atol=atol, err_msg=f"method={method}")

    def test_eps_only_guards_the_division(self, rng):
        # Tiny kernels (elu(x) + 1 = e^x, x ~ -60): the default eps leaves them exact.
        q, k, v = make_qkv(rng, batch=(), n=4, s=5, d=3)
        q = q - 60.0
        out = linear_attention(q, k, v)
        ref, _ = linear_oracle("elu+1", q, k, v)
        np.testing.assert_allclose(out, ref, rtol=1e-13)
        # A larger eps zeroes exactly the rows whose |denominator| <= eps.
        fq, fk = get_feature_map("elu+1").query(q), get_feature_map("elu+1").key(k)
        den = fq @ fk.sum(0)
        eps = float(np.sort(den)[1])
        out = linear_attention(q, k, v, eps=eps)
        small = den <= eps
        assert small.sum() == 2
        assert (out[small] == 0).all()
        np.testing.assert_allclose(out[~small], ref[~small], rtol=1e-13)

    def test_relu_zero_kernel_row_is_zero(self):
        q = np.array([[-1.0, -2.0], [1.0, 0.5]])
        k = np.array([[1.0, 1.0], [2.0, 0.0]])
        v = np.array([[1.0], [3.0]])
        for causal in (False, True):
            out = linear_attention(q, k, v, feature_map="relu", causal=causal)
            assert out[0, 0] == 0.0 and np.isfinite(out).all()

    def test_extreme_inputs_finite(self, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=20, s=20, d=4)
        for name in MAPS:
            for method in METHODS:
                out = linear_attention(q * 1e4, k * 1e4, v, feature_map=name, causal=True,
                                       method=method, chunk_size=6)
                assert np.isfinite(out).all(), (name, method)

    def test_chunked_memory_has_no_n_m_dv_tensor(self):
        # tracemalloc sees NumPy's allocations.  chunked: O(n (m + dv + c) + (n/c) m dv);
        # cumsum materialises n x m x (dv + 1) -- the test tells them apart.
        n, m, dv, c = 2048, 64, 64, 32
        rng = np.random.default_rng(0)
        fq, fk = rng.random((1, n, m)), rng.random((1, n, m))
        v = rng.standard_normal((1, n, dv))
        peaks = {}
        for method in ("chunked", "cumsum"):
            tracemalloc.start()
            feature_attention(fq, fk, v, causal=True, method=method, chunk_size=c)
            peaks[method] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        bound = 8 * (6 * n * (m + dv + c) + 4 * (n // c) * m * (dv + 1))
        assert peaks["chunked"] < bound < n * m * dv * 8 < peaks["cumsum"], peaks

    @given(data=st.data())
    def test_hypothesis_forms_vs_oracle(self, data):
        nb = data.draw(st.integers(0, 2))
        batch = tuple(data.draw(st.lists(st.integers(1, 3), min_size=nb, max_size=nb)))
        n, s = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 12))
        d, dv = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 4))
        name = data.draw(st.sampled_from(MAPS))
        form = data.draw(st.sampled_from(FORMS))
        chunk = data.draw(st.integers(1, 14))
        scale = data.draw(st.sampled_from([0.01, 1.0, 5.0]))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        q = scale * rng.standard_normal((*batch, n, d))
        k = scale * rng.standard_normal((*batch, s, d))
        v = rng.standard_normal((*batch, s, dv))
        km = (rng.random((*batch, s)) < data.draw(st.sampled_from([0.0, 0.5, 1.0])))
        out = linear_attention(q, k, v, feature_map=name, causal=form is not None,
                               method=form, chunk_size=chunk, key_mask=km)
        ref, ratio = linear_oracle(name, q, k, v, causal=form is not None, key_mask=km)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=0,
                                   atol=linear_atol("float64", name, d, s, v, ratio))


class TestDecoding:
    def _state(self, backend, dtype="float64", batch=(2, 3), d=8, dv=5, fm="elu+1"):
        return linear_attention_state(backend.xp, batch, d, dv, feature_map=fm,
                                      dtype=backend.dtype(dtype), device=backend.device)

    @pytest.mark.parametrize("name", ["elu+1", "taylor"])
    def test_steps_equal_full_causal(self, backend, rng, name):
        _skip_heavy(backend, name)
        q, k, v = make_qkv(rng, batch=(2, 3), n=9, d=8, dv=5, norm=3.0)
        full = linear_attention(*(backend.asarray(x) for x in (q, k, v)), causal=True,
                                feature_map=name)
        state = self._state(backend, fm=name)
        assert state.num_tokens == 0 and state.S.shape == (2, 3, state.m, 5)
        outs = []
        for t in range(9):
            o, state = linear_attention_step(*(backend.asarray(x[..., t, :]) for x in (q, k, v)),
                                             state)
            outs.append(backend.to_numpy(o))
        assert state.num_tokens == 9 and state.feature_map.name == name
        _, ratio = linear_oracle(name, q, k, v, causal=True)
        np.testing.assert_allclose(np.stack(outs, axis=-2), backend.to_numpy(full), rtol=0,
                                   atol=2 * linear_atol("float64", name, 8, 9, v, ratio))

    @pytest.mark.parametrize("method", METHODS)
    def test_prompt_then_steps(self, backend, rng, method):
        if method != "chunked":
            skip_jax_compile(backend, "the other backends")
        q, k, v = make_qkv(rng, batch=(2,), n=12, d=8, dv=5, norm=3.0)
        full, ratio = linear_oracle("elu+1", q, k, v, causal=True)
        out, state = linear_attention(*(backend.asarray(x[..., :7, :]) for x in (q, k, v)),
                                      causal=True, method=method, chunk_size=3,
                                      return_state=True)
        assert state.num_tokens == 7 and state.feature_map.name == "elu+1"
        got = [backend.to_numpy(out)]
        for t in range(7, 12):
            o, state = linear_attention_step(*(backend.asarray(x[..., t, :]) for x in (q, k, v)),
                                             state)
            got.append(backend.to_numpy(o)[..., None, :])
        np.testing.assert_allclose(np.concatenate(got, axis=-2), full, rtol=0,
                                   atol=linear_atol("float64", "elu+1", 8, 12, v, ratio))
        # The state equals the plain sums over the 12 keys.
        fk = np.where(k > 0, k + 1.0, np.exp(np.minimum(k, 0.0)))
        np.testing.assert_allclose(backend.to_numpy(state.S), np.swapaxes(fk, -1, -2) @ v,
                                   rtol=1e-13)
        np.testing.assert_allclose(backend.to_numpy(state.z), fk.sum(-2), rtol=1e-13)

    def test_state_never_mutated(self, backend, rng):
        skip_jax_compile(backend, "the other backends")  # JAX arrays cannot be mutated
        q, k, v = make_qkv(rng, batch=(2, 3), n=2, d=8, dv=5)
        _, s1 = linear_attention(*(backend.asarray(x) for x in (q, k, v)), causal=True,
                                 return_state=True)
        before = backend.to_numpy(s1.S).copy(), backend.to_numpy(s1.z).copy()
        _, s2 = linear_attention_step(*(backend.asarray(x[..., 0, :]) for x in (q, k, v)), s1)
        np.testing.assert_array_equal(backend.to_numpy(s1.S), before[0])
        np.testing.assert_array_equal(backend.to_numpy(s1.z), before[1])
        assert s1.num_tokens == 2 and s2.num_tokens == 3

    def test_feature_attention_with_state_continues_a_prompt(self, backend, rng):
        skip_jax_compile(backend, "the other backends")
        # A second causal call with the prompt's state equals the one-shot call.
        fq, fk = rng.random((2, 12, 4)), rng.random((2, 12, 4))
        v = rng.standard_normal((2, 12, 3))
        xs = [backend.asarray(x) for x in (fq, fk, v)]
        full = feature_attention(*xs, causal=True)
        a, st1 = feature_attention(*(x[..., :6, :] for x in xs), causal=True,
                                   return_state=True)
        b, st2 = feature_attention(*(x[..., 6:, :] for x in xs), causal=True, state=st1,
                                   return_state=True)
        xp_assert_close(backend.xp.concat([a, b], axis=-2), full, rtol=1e-13)
        assert st1.num_tokens == 6 and st2.num_tokens == 12 and st2.feature_map is None
        o, st3 = feature_attention_step(*(x[..., 11, :] for x in xs), feature_attention(
            *(x[..., :11, :] for x in xs), causal=True, return_state=True)[1])
        xp_assert_close(o, full[..., 11, :], rtol=1e-13)
        xp_assert_close(st3.S, st2.S, rtol=1e-13)

    def test_half_precision_state(self, rng):
        torch = pytest.importorskip("torch")
        st = linear_attention_state(torch, (2,), 4, 3, dtype=torch.float16)
        assert st.S.dtype == torch.float32
        q, k, v = (torch.asarray(rng.standard_normal((2, dim)), dtype=torch.float16)
                   for dim in (4, 4, 3))
        o, st = linear_attention_step(q, k, v, st)
        assert o.dtype == torch.float16 and st.S.dtype == torch.float32

    def test_state_errors(self, rng):
        st = linear_attention_state(np, (2,), 4, 3)
        q = rng.standard_normal((2, 4))
        with pytest.raises(ValueError, match=r"state has S \(2, 4, 3\).*\(\.\.\., 4, 5\)"):
            linear_attention_step(q, q, rng.standard_normal((2, 5)), st)
        with pytest.raises(TypeError, match="state is in float64 but inputs of dtype float32"):
            linear_attention_step(*(x.astype(np.float32) for x in (q, q, q[:, :3])), st)
        with pytest.raises(TypeError, match="state must be a LinearAttentionState"):
            linear_attention_step(q, q, q[:, :3], None)
        bare = LinearAttentionState(st.S, st.z, 0, None)
        with pytest.raises(TypeError, match="made by linear_attention_state"):
            linear_attention_step(q, q, q[:, :3], bare)
        with pytest.raises(ValueError, match="q_t must have at least 1 dimension"):
            feature_attention_step(np.float64(1.0), q, q, st)


class TestLinearAttentionErrors:
    def test_method(self):
        with pytest.raises(ValueError, match=r"method must be one of \['chunked', 'cumsum', 'recurrent'\]"):
            linear_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)), causal=True,
                             method="scan")

    def test_chunk_size(self):
        with pytest.raises(ValueError, match="chunk_size must be >= 1; got 0"):
            linear_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)), causal=True,
                             chunk_size=0)

    @pytest.mark.parametrize("eps", [-1.0, math.nan, "1e-6"])
    def test_eps(self, eps):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            linear_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)), eps=eps)

    def test_feature_dims_differ(self):
        with pytest.raises(ValueError, match="phi_k has d=3 but phi_q has d=4"):
            feature_attention(np.ones((5, 4)), np.ones((6, 3)), np.ones((6, 2)))
        with pytest.raises(ValueError, match="phi_k has d=2 but phi_q has d=3"):
            linear_attention(np.ones((5, 3)), np.ones((6, 3)), np.ones((6, 2)),
                             feature_map=(lambda x: x, lambda x: x[..., :2]))

    def test_key_mask_shape(self):
        with pytest.raises(ValueError, match=r"key_mask must have shape \(\.\.\., s\) with s=3"):
            linear_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)),
                             key_mask=np.ones(4, bool))


class TestEfficientAttention:
    @staticmethod
    def oracle(q, k, v, key_mask=None):
        q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                    () if key_mask is None else key_mask.shape[:-1])
        n, d = q.shape[-2:]
        s = k.shape[-2]
        km = np.ones((*batch, s), bool) if key_mask is None else np.broadcast_to(
            key_mask, (*batch, s))
        q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
        out = np.zeros((*batch, n, v.shape[-1]))
        for idx in np.ndindex(*batch):
            keys = np.flatnonzero(km[idx])
            if keys.size == 0:
                continue
            rk = np.zeros((s, d))
            for f in range(d):
                e = np.exp(k[idx][keys, f] - k[idx][keys, f].max())
                rk[keys, f] = e / e.sum()
            for i in range(n):
                e = np.exp(q[idx][i] - q[idx][i].max())
                rq = e / e.sum()
                for j in keys:
                    out[idx][i] += (rq @ rk[j]) * v[idx][j]
        return out

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_matches_oracle(self, backend, rng, dtype):
        q, k, v, km = _problem(rng, 7, 11, norm=6.0)
        km[1, 2] = False       # one head with every key masked -> zeros
        out = efficient_attention(*_dev(backend, dtype, q, k, v),
                                  key_mask=backend.asarray(km))
        ref = self.oracle(*(round_to(x, dtype) for x in (q, k, v)), key_mask=km)
        # exp of arguments up to 2 max|x| (relative error 2 max|x| u), sums over d and s.
        xmax = max(np.abs(q).max(), np.abs(k).max())
        atol = working_eps(dtype) * np.abs(v).max() * (4 * xmax + 8 + 11 + 8)
        xp_assert_close(out, backend.asarray(ref, dtype), rtol=0, atol=float(atol))
        assert (backend.to_numpy(out)[1, 2] == 0).all()

    def test_rows_sum_to_one_and_causal_raises(self, backend, rng):
        q, k, _ = make_qkv(rng, batch=(2,), n=5, s=9, d=4, norm=8.0)
        a = backend.to_numpy(arrayattn.attention_matrix(
            efficient_attention, *(backend.asarray(x) for x in (q, k))))
        np.testing.assert_allclose(a.sum(-1), 1.0, rtol=0, atol=32 * 2.2e-16)
        assert (a > 0).all()
        with pytest.raises(ValueError, match="efficient_attention cannot be causal"):
            efficient_attention(*(backend.asarray(x) for x in (q, k, k)), causal=True)


class TestFeatureAttentionPadding:
    @pytest.mark.parametrize("causal", [False, True])
    def test_nonfinite_padding_is_ignored(self, backend, rng, causal):
        from arrayattn import feature_attention
        phi_q, phi_k = rng.random((2, 6, 4)), rng.random((2, 6, 4))
        v = rng.standard_normal((2, 6, 3))
        km = np.ones((2, 6), bool)
        km[:, 4:] = False
        v_bad = v.copy()
        v_bad[:, 4] = np.inf
        v_bad[:, 5] = np.nan
        a = feature_attention(*(backend.asarray(x) for x in (phi_q, phi_k, v)),
                              key_mask=backend.asarray(km), causal=causal)
        b = feature_attention(*(backend.asarray(x) for x in (phi_q, phi_k, v_bad)),
                              key_mask=backend.asarray(km), causal=causal)
        assert np.isfinite(backend.to_numpy(b)).all()
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))


@pytest.mark.parametrize("causal", [False, True])
def test_unnormalised_linear_attention(backend, rng, causal):
    """``normalize=False``: ``O_i = sum_{j in J_i} (phi(q_i) . phi(k_j)) v_j`` (fla's
    default), against a float64 loop on every backend, with masked keys."""
    from conftest import make_qkv
    q, k, v = make_qkv(rng, batch=(2,), n=12, s=15, d=4, dv=3)
    keep = rng.random((2, 15)) > 0.3
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))  # noqa: E731
    want = np.zeros((2, 12, 3))
    for b in range(2):
        for i in range(12):
            for j in range(15):
                if keep[b, j] and not (causal and j > i + 3):
                    want[b, i] += (phi(q[b, i]) @ phi(k[b, j])) * v[b, j]
    on = backend.asarray
    out = linear_attention(on(q), on(k), on(v), causal=causal, normalize=False,
                           key_mask=on(keep))
    xp_assert_close(out, on(want), rtol=0, atol=64 * 15 * 2.0 ** -52 * np.abs(want).max())
