"""Registry-driven tests: every registered variant, on every backend.

A variant is covered here as soon as it is registered: output kind (namespace, dtype,
device, shape), no mutation of inputs, linearity in ``v`` (``fn(q, k, v) ==
attention_matrix(fn, q, k) @ v``), normalisation, causality, key masking, agreement
with the exact oracle when it claims to be exact, and agreement between backends.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import attention_matrix
from arrayattn.testing import xp_assert_close, xp_assert_equal, xp_assert_kind

from conftest import make_qkv
from oracle import softmax_attention as oracle

RECORDS = arrayattn.variants()
IDS = [r.name for r in RECORDS]
F64 = float(np.finfo(np.float64).eps)


def _inputs(rec, rng, *, batch=(2,), d=16, norm=3.0):
    n, s = (80, 96) if rec.cross else (96, 96)
    return make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=5, norm=norm)


def _on(backend, *arrays, dtype="float64"):
    return [backend.asarray(a, dtype) for a in arrays]


@pytest.fixture(params=RECORDS, ids=IDS)
def record(request):
    return request.param


class TestEveryVariant:
    def test_registry_records(self, record):
        assert record is arrayattn.get_variant(record.name)
        assert record.citation and record.complexity and record.family
        assert callable(record.fn)

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_output_kind(self, record, backend, rng, dtype):
        q, k, v = _on(backend, *_inputs(record, rng), dtype=dtype)
        out = record(q, k, v)
        ref = backend.xp.zeros((2, q.shape[-2], 5), dtype=backend.dtype(dtype),
                               device=backend.device)
        xp_assert_kind(out, ref)
        assert np.isfinite(backend.to_numpy(out)).all()

    def test_inputs_not_mutated(self, record, backend, rng):
        host = _inputs(record, rng)
        q, k, v = _on(backend, *host)
        record(q, k, v)
        for before, after in zip(host, (q, k, v)):
            np.testing.assert_array_equal(backend.to_numpy(after), before)

    def test_linear_in_v(self, record, backend, rng):
        if not record.linear_in_v:
            pytest.skip(f"{record.name}'s weights depend on v (not linear in v)")
        q, k, v = _on(backend, *_inputs(record, rng))
        out = record(q, k, v)
        a = attention_matrix(record, q, k)
        s = k.shape[-2]
        scale = float(np.abs(backend.to_numpy(a)).max() * np.abs(backend.to_numpy(v)).max())
        xp_assert_close(a @ v, out, rtol=0, atol=8 * s * F64 * max(scale, 1.0))

    def test_rows_sum_to_one(self, record, backend, rng):
        if not record.normalized:
            pytest.skip(f"{record.name} does not define a normalised attention")
        q, k, _ = _on(backend, *_inputs(record, rng))
        s = k.shape[-2]
        const = backend.xp.full((s, 3), 2.5, dtype=q.dtype, device=backend.device)
        out = record(q, k, const)
        xp_assert_close(out, backend.xp.full(out.shape, 2.5, dtype=q.dtype,
                                             device=backend.device),
                        rtol=16 * s * F64)

    def test_exact_matches_oracle(self, record, backend, rng):
        if not record.exact:
            pytest.skip(f"{record.name} is an approximation")
        host = _inputs(record, rng)
        out = record(*_on(backend, *host))
        xp_assert_close(out, backend.asarray(oracle(*host)), rtol=0, atol=1e-12)

    def test_causality(self, record, backend, rng):
        q, k, v = _inputs(record, rng)
        if not record.causal:
            with pytest.raises(ValueError, match="causal"):
                record(*_on(backend, q, k, v), causal=True)
            return
        n, s = q.shape[-2], k.shape[-2]
        cut = s - n + n // 2  # keys after this are in the future of queries < n // 2
        k2, v2 = k.copy(), v.copy()
        k2[..., cut + 1:, :] *= 3.0
        v2[..., cut + 1:, :] = 100.0
        a = record(*_on(backend, q, k, v), causal=True)
        b = record(*_on(backend, q, k2, v2), causal=True)
        xp_assert_equal(a[..., : n // 2 + 1, :], b[..., : n // 2 + 1, :])

    def test_key_mask_removes_keys(self, record, backend, rng):
        if not record.key_mask:
            pytest.skip(f"{record.name} takes no key_mask")
        q, k, v = _inputs(record, rng)
        km = rng.random(k.shape[:-1]) < 0.7
        k2, v2 = k.copy(), v.copy()
        k2[~km] *= 2.0
        v2[~km] = 50.0
        a = record(*_on(backend, q, k, v), key_mask=backend.asarray(km))
        b = record(*_on(backend, q, k2, v2), key_mask=backend.asarray(km))
        scale = float(np.abs(backend.to_numpy(a)).max())
        xp_assert_close(a, b, rtol=0, atol=64 * k.shape[-2] * F64 * max(scale, 1.0))

    def test_backends_agree(self, record, backend, rng):
        host = _inputs(record, rng)
        ref = record(*host)  # numpy, float64
        out = record(*_on(backend, *host))
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=0,
                                   atol=64 * host[1].shape[-2] * F64 * max(scale, 1.0))


class TestRegistry:
    def test_names_unique_and_ordered(self):
        names = [r.name for r in arrayattn.variants()]
        assert len(names) == len(set(names))
        assert names[:2] == ["softmax", "softmax_blockwise"]

    def test_get_variant_unknown(self):
        with pytest.raises(ValueError, match="no variant named 'nope'; registered: softmax"):
            arrayattn.get_variant("nope")

    def test_register_duplicate(self):
        with pytest.raises(ValueError, match="already registered"):
            arrayattn.register(arrayattn.get_variant("softmax"))

    def test_defaults_are_read_only(self):
        with pytest.raises(TypeError):
            arrayattn.get_variant("softmax_blockwise").defaults["block_size"] = 3

    def test_filters(self):
        assert all(r.exact for r in arrayattn.variants(exact=True))
        assert all(r.family == "exact" for r in arrayattn.variants(family="exact"))


class TestAttentionMatrix:
    def test_equals_softmax_matrix(self, backend, rng):
        q, k, _ = make_qkv(rng, batch=(2,), n=4, s=6, d=3)
        a = attention_matrix(arrayattn.softmax_attention, *_on(backend, q, k), causal=True)
        ref = oracle(q, k, np.eye(6), causal=True)
        xp_assert_close(a, backend.asarray(ref), rtol=0, atol=1e-14)
