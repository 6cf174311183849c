"""Luna pack-and-unpack attention against a plain float64 oracle of the same definition."""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import luna_attention
from arrayattn.testing import xp_assert_close

from conftest import make_qkv
from oracle import softmax_attention as exact_oracle
from tolerances import attention_atol

N, S, L, D, DV = 30, 41, 7, 8, 5


def luna_oracle(q, k, v, p, *, key_mask=None, wk=None, wv=None, scale=None):
    """P' = Attn(P, K, V) row by row, then O = Attn(Q, P' W_K, P' W_V) row by row."""
    packed = exact_oracle(p, k, v, key_mask=key_mask, scale=scale)
    keys = packed if wk is None else packed @ wk
    values = packed if wv is None else packed @ wv
    return exact_oracle(q, keys, values, scale=scale), packed


def luna_atol(dtype, q, k, v, p, wk=None, wv=None, scale=None):
    """Rounding bound derived step by step.

    The pack step is softmax attention: its entries are within ``e`` =
    ``attention_atol(p, k, v)``.  A pack error ``e`` per entry moves an unpack logit
    by at most ``scale |q| |W_K| sqrt(dv) e`` (``|W_K|`` the largest column sum, 1
    without it), which changes the unpack weights by a relative ``2x`` that and the
    output by ``2 dlogit max|values|``; the values themselves move by ``|W_V| e``.
    The unpack softmax adds its own rounding ``attention_atol(q, keys, values)``.
    """
    packed = exact_oracle(p, k, v)
    keys = packed if wk is None else packed @ wk
    values = packed if wv is None else packed @ wv
    d, dv = q.shape[-1], v.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kscale = 1.0 if wk is None else float(np.abs(wk).sum(axis=-2).max())
    vscale = 1.0 if wv is None else float(np.abs(wv).sum(axis=-2).max())
    e = attention_atol(dtype, p, k, v, scale)
    dlogit = abs(scale) * float(np.linalg.norm(q, axis=-1).max()) * kscale * math.sqrt(dv) * e
    return (attention_atol(dtype, q, keys, values, scale) + vscale * e
            + 2 * dlogit * float(np.abs(values).max()))


class TestLunaAttention:
    def test_equals_oracle(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=N, s=S, d=D, dv=D, norm=6.0)
        p = rng.standard_normal((L, D)) * 2.0
        km = rng.random((2, S)) < 0.7
        km[1, :] = False          # every key padded: P' = 0, then O = mean of P' = 0
        ref, ref_packed = luna_oracle(q, k, v, p, key_mask=km)
        out, packed = luna_attention(*(backend.asarray(x) for x in (q, k, v, p)),
                                     key_mask=backend.asarray(km), return_packed=True)
        xp_assert_close(packed, backend.asarray(ref_packed), rtol=0,
                        atol=attention_atol("float64", p, k, v))
        xp_assert_close(out, backend.asarray(ref), rtol=0,
                        atol=luna_atol("float64", q, k, v, p))
        np.testing.assert_array_equal(backend.to_numpy(out)[1], 0.0)

    def test_projections_equal_oracle(self, backend, rng):
        """dv != d with the caller's unpack projections; per-head P broadcasts."""
        q, k, v = make_qkv(rng, batch=(2, 3), n=N, s=S, d=D, dv=DV, norm=8.0)
        p = rng.standard_normal((3, L, D)) * 2.0          # one P per head
        wk = rng.standard_normal((DV, D)) / math.sqrt(DV)
        wv = rng.standard_normal((DV, 4))
        ref, _ = luna_oracle(q, k, v, p, wk=wk, wv=wv, scale=0.3)
        out = luna_attention(*(backend.asarray(x) for x in (q, k, v, p)), scale=0.3,
                             unpack_key_proj=backend.asarray(wk),
                             unpack_value_proj=backend.asarray(wv))
        assert tuple(out.shape) == (2, 3, N, 4)
        xp_assert_close(out, backend.asarray(ref), rtol=0,
                        atol=luna_atol("float64", q, k, v, p, wk, wv, scale=0.3))

    def test_float32(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=N, s=S, d=D, dv=D, norm=6.0)
        p = rng.standard_normal((L, D)) * 2.0
        arrays = [backend.asarray(x, "float32") for x in (q, k, v, p)]
        rounded = [np.asarray(backend.to_numpy(x), np.float64) for x in arrays]
        ref, _ = luna_oracle(*rounded)
        out = luna_attention(*arrays)
        xp_assert_close(out, backend.asarray(ref, "float32"), rtol=0,
                        atol=luna_atol("float32", *rounded))

    def test_l_equals_keys_reduces_to_two_softmaxes(self, np_backend, rng):
        """With P = K (l = s) the pack step is exact self-attention of the keys; the
        result is Attn(Q, Attn(K, K, V), Attn(K, K, V)) -- checked against the exact
        oracle composed by hand, not against luna_oracle."""
        q, k, v = make_qkv(rng, batch=(), n=N, s=S, d=D, dv=D, norm=3.0)
        packed = exact_oracle(k, k, v)
        ref = exact_oracle(q, packed, packed)
        np.testing.assert_allclose(luna_attention(q, k, v, k), ref, rtol=0,
                                   atol=luna_atol("float64", q, k, v, k))

    def test_not_linear_in_v(self, np_backend, rng):
        """Documented: the unpack keys depend on v, so the output is not linear in v."""
        q, k, v = make_qkv(rng, batch=(), n=N, s=S, d=D, dv=D, norm=6.0)
        p = rng.standard_normal((L, D))
        a = luna_attention(q, k, 2.0 * v, p)
        b = 2.0 * luna_attention(q, k, v, p)
        assert np.abs(a - b).max() > 1e-3

    def test_errors(self, np_backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=N, s=S, d=D, dv=DV)
        p = rng.standard_normal((L, D))
        wk = np.ones((DV, D))
        with pytest.raises(ValueError, match="luna_attention cannot be causal: every packed"):
            luna_attention(q, k, v, p, causal=True, unpack_key_proj=wk)
        with pytest.raises(ValueError,
                           match=r"pass unpack_key_proj of shape \(dv, d\) = \(5, 8\)"):
            luna_attention(q, k, v, p)
        with pytest.raises(ValueError, match=r"k has d=8 but p has d=3 \(shapes p \(7, 3\)"):
            luna_attention(q, k, v, p[:, :3], unpack_key_proj=wk)
        with pytest.raises(ValueError, match="unpack_key_proj must have shape"):
            luna_attention(q, k, v, p, unpack_key_proj=np.ones((4, D)))
        with pytest.raises(ValueError, match="unpack_key_proj must map dv=5 to d=8"):
            luna_attention(q, k, v, p, unpack_key_proj=np.ones((DV, 3)))
        with pytest.raises(TypeError, match="p must have a real floating dtype"):
            luna_attention(q, k, v, p.astype(np.int64), unpack_key_proj=wk)
        with pytest.raises(ValueError, match="key_mask must have shape"):
            luna_attention(q, k, v, p, unpack_key_proj=wk, key_mask=np.ones((2, S - 1), bool))


class TestLunaGradients:
    def test_torch_gradcheck(self, rng):
        from conftest import get_backend
        get_backend("torch")
        import torch

        q, k, v = make_qkv(rng, batch=(2,), n=6, s=9, d=4, dv=3, norm=2.0)
        p = rng.standard_normal((3, 4))
        wk = rng.standard_normal((3, 4))
        km = torch.tensor(rng.random((2, 9)) < 0.8)
        args = tuple(torch.tensor(x, requires_grad=True) for x in (q, k, v, p, wk))
        assert torch.autograd.gradcheck(
            lambda a, b, c, d, e: luna_attention(a, b, c, d, key_mask=km, unpack_key_proj=e),
            args)
