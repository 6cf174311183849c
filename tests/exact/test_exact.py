"""softmax_attention (dense and blockwise) against the float64 oracle."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import arrayattn
from arrayattn import softmax_attention
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import get_backend, make_qkv
from oracle import softmax_attention as oracle
from strategies import attention_problems
from tolerances import attention_atol, round_to

BLOCKS = [None, 1, 3, 16]


def _run(backend, dtype, q, k, v, **opts):
    """Run on ``backend`` in ``dtype``; also return the oracle on the rounded inputs."""
    qr, kr, vr = (round_to(x, dtype) for x in (q, k, v))
    args = [backend.asarray(x, dtype) for x in (qr, kr, vr)]
    kw = {key: (backend.asarray(val) if isinstance(val, np.ndarray) else val)
          for key, val in opts.items()}
    out = softmax_attention(*args, **kw)
    ref_opts = {key: val for key, val in opts.items() if key != "block_size"}
    return out, oracle(qr, kr, vr, **ref_opts), attention_atol(dtype, qr, kr, vr, opts.get("scale"))


class TestSoftmaxAttention:
    def test_sharp_inputs_are_sharp(self, rng):
        # Guard for the test inputs themselves: aimed queries give peaked rows.
        q, k, v = make_qkv(rng, batch=(4,), n=64, s=64, d=64, norm=8.0, sharp=True)
        a = oracle(q, k, np.eye(64))
        assert np.median(a.max(axis=-1)) > 0.3
        q, k, v = make_qkv(rng, batch=(4,), n=64, s=64, d=64, norm=8.0)
        assert np.median(oracle(q, k, np.eye(64)).max(axis=-1)) < 0.2

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    @pytest.mark.parametrize("block_size", BLOCKS)
    @pytest.mark.parametrize("causal", [False, True])
    def test_matches_oracle(self, backend, rng, dtype, block_size, causal):
        q, k, v = make_qkv(rng, batch=(2, 3), n=7, s=11, d=8, dv=5, norm=6.0, sharp=True)
        km = rng.random((2, 1, 11)) < 0.7
        mask = rng.random((7, 11)) < 0.8
        out, ref, atol = _run(backend, dtype, q, k, v, causal=causal, key_mask=km,
                              mask=mask, block_size=block_size)
        assert out.dtype == backend.dtype(dtype)
        xp_assert_close(out, backend.asarray(ref, dtype), rtol=0, atol=atol)

    @pytest.mark.parametrize("block_size", BLOCKS)
    def test_extreme_logits_float32(self, backend, rng, block_size):
        # |q.k.scale| ~ 1e4: the max shift keeps everything finite and correct.
        q, k, v = make_qkv(rng, batch=(2,), n=6, s=9, d=4)
        q = q * 1e4 / np.abs(q @ np.swapaxes(k, -1, -2) / 2).max()
        out, ref, atol = _run(backend, "float32", q, k, v, block_size=block_size, causal=True)
        assert np.isfinite(backend.to_numpy(out)).all()
        xp_assert_close(out, backend.asarray(ref, "float32"), rtol=0, atol=atol)

    @pytest.mark.parametrize("block_size", BLOCKS)
    def test_empty_rows_are_zero(self, backend, rng, block_size):
        q, k, v = make_qkv(rng, batch=(), n=5, s=4, d=3)
        mask = np.ones((5, 4), dtype=bool)
        mask[2] = False
        km = np.array([True, False, True, True])
        out = softmax_attention(*(backend.asarray(x) for x in (q, k, v)),
                                mask=backend.asarray(mask), key_mask=backend.asarray(km),
                                block_size=block_size)
        o = backend.to_numpy(out)
        assert np.isfinite(o).all() and (o[2] == 0).all()
        # Every key masked: all zeros, no NaN.
        out = softmax_attention(*(backend.asarray(x) for x in (q, k, v)),
                                key_mask=backend.asarray(np.zeros(4, bool)),
                                block_size=block_size)
        assert (backend.to_numpy(out) == 0).all()

    def test_causal_is_end_aligned(self, np_backend, rng):
        # n < s: the last query sees every key, query i sees keys j <= i + (s - n).
        q, k, v = make_qkv(rng, batch=(), n=3, s=5, d=4)
        a = arrayattn.attention_matrix("softmax", q, k, causal=True)
        assert (a[-1] > 0).all()
        assert (a[0, 3:] == 0).all() and (a[0, :3] > 0).all()

    @pytest.mark.parametrize("block_size", [None, 2])
    def test_causality_bit_for_bit(self, backend, rng, block_size):
        q, k, v = make_qkv(rng, batch=(2,), n=8, s=8, d=4)
        k2, v2 = k.copy(), v.copy()
        k2[:, 5:] = 1e3 * rng.standard_normal(k2[:, 5:].shape)
        v2[:, 5:] = -7.0
        a = softmax_attention(*(backend.asarray(x) for x in (q, k, v)), causal=True,
                              block_size=block_size)
        b = softmax_attention(*(backend.asarray(x) for x in (q, k2, v2)), causal=True,
                              block_size=block_size)
        xp_assert_equal(a[..., :5, :], b[..., :5, :])

    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_half_precision_computed_in_float32(self, backend, rng, dtype):
        if dtype == "bfloat16" and backend.name not in ("torch", "jax"):
            pytest.skip(f"{backend.name} has no bfloat16")
        if not hasattr(backend.xp, dtype):
            pytest.skip(f"{backend.name} has no {dtype}")
        q, k, v = make_qkv(rng, batch=(2,), n=64, s=64, d=16, norm=6.0, sharp=True)
        out, ref, atol = _run(backend, dtype, q, k, v, causal=True)
        assert out.dtype == backend.dtype(dtype)
        # float32 arithmetic (atol) plus one rounding of the result to the half format.
        half = np.abs(ref).max() * (2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10)
        xp_assert_close(out, backend.asarray(ref, dtype), rtol=0, atol=atol + half)

    def test_broadcast_batch_dims(self, np_backend, rng):
        q = rng.standard_normal((2, 3, 4, 5))
        k = rng.standard_normal((1, 3, 6, 5))
        v = rng.standard_normal((6, 2))
        out = softmax_attention(q, k, v)
        assert out.shape == (2, 3, 4, 2)
        np.testing.assert_allclose(out, oracle(q, k, v), rtol=0, atol=1e-13)

    @given(problem=attention_problems(), block=st.sampled_from([None, 1, 2, 5]),
           dtype=st.sampled_from(["float32", "float64"]))
    def test_hypothesis_vs_oracle(self, problem, block, dtype):
        backend = get_backend("numpy")
        q, k, v = problem.pop("q"), problem.pop("k"), problem.pop("v")
        out, ref, atol = _run(backend, dtype, q, k, v, block_size=block, **problem)
        o = backend.to_numpy(out)
        assert np.isfinite(o).all()
        np.testing.assert_allclose(o, ref, rtol=0, atol=atol)


class TestSoftmaxAttentionErrors:
    def test_wrong_ndim(self, rng):
        with pytest.raises(ValueError, match=r"q must have at least 2 dimensions.*\(5,\)"):
            softmax_attention(np.ones(5), np.ones((3, 5)), np.ones((3, 2)))

    def test_mismatched_d(self):
        with pytest.raises(ValueError, match="k has d=32 but q has d=64"):
            softmax_attention(np.ones((4, 64)), np.ones((3, 32)), np.ones((3, 2)))

    def test_mismatched_s(self):
        with pytest.raises(ValueError, match="v has s=4 tokens but k has s=3"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((4, 2)))

    def test_batch_does_not_broadcast(self):
        with pytest.raises(ValueError, match=r"do not broadcast: q \(2,\), k \(3,\)"):
            softmax_attention(np.ones((2, 4, 8)), np.ones((3, 3, 8)), np.ones((3, 3, 2)))

    def test_integer_dtype(self):
        with pytest.raises(TypeError, match="q must have a real floating dtype"):
            softmax_attention(np.ones((4, 8), int), np.ones((3, 8)), np.ones((3, 2)))

    def test_complex_dtype(self):
        with pytest.raises(TypeError, match="real floating"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8), complex), np.ones((3, 2)))

    def test_mixed_dtypes(self):
        with pytest.raises(TypeError, match="k has dtype float32 but q has dtype float64"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8), np.float32), np.ones((3, 2)))

    def test_mixed_namespaces(self):
        strict = get_backend("strict")
        with pytest.raises(TypeError, match="different array libraries.*k is array_api_strict"):
            softmax_attention(np.ones((4, 8)), strict.asarray(np.ones((3, 8))), np.ones((3, 2)))

    def test_mixed_devices(self):
        a = get_backend("strict")
        b = get_backend("strict_device1")
        with pytest.raises(ValueError, match="k is on device .*device1.* but q is on device"):
            softmax_attention(a.asarray(np.ones((4, 8))), b.asarray(np.ones((3, 8))),
                              a.asarray(np.ones((3, 2))))

    def test_key_mask_wrong_shape(self):
        with pytest.raises(ValueError, match=r"key_mask must have shape \(\.\.\., s\) with s=3.*\(4,\)"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)),
                              key_mask=np.ones(4, bool))

    def test_key_mask_not_bool(self):
        with pytest.raises(TypeError, match="key_mask must be a boolean array"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)),
                              key_mask=np.ones(3))

    def test_mask_wrong_shape(self):
        with pytest.raises(ValueError, match=r"mask must have shape \(\.\.\., n, s\) = \(\.\.\., 4, 3\); got shape \(3, 4\)"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)),
                              mask=np.ones((3, 4), bool))

    def test_mask_extra_batch_dims(self):
        with pytest.raises(ValueError, match="more batch dimensions"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)),
                              mask=np.ones((2, 4, 3), bool))

    @pytest.mark.parametrize("bad", [0, -3])
    def test_block_size_not_positive(self, bad):
        with pytest.raises(ValueError, match=f"block_size must be >= 1; got {bad}"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)), block_size=bad)

    def test_block_size_not_int(self):
        with pytest.raises(TypeError, match="block_size must be an integer"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)), block_size=2.5)

    def test_scale_not_finite(self):
        with pytest.raises(ValueError, match="scale must be finite"):
            softmax_attention(np.ones((4, 8)), np.ones((3, 8)), np.ones((3, 2)), scale=np.inf)
