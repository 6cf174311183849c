"""Grouped-query heads through the uniform call of every variant, on every backend: the
result equals the same call with ``k`` and ``v`` repeated per query group
(``repeat_interleave`` order, as SDPA's ``enable_gqa``), masks included."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.testing import xp_assert_close

from conftest import make_qkv
from oracle import softmax_attention as oracle

RECORDS = arrayattn.variants()
HQ, HKV, N = 4, 2, 80


def _grouped(rng):
    q, k, v = make_qkv(rng, batch=(2, HQ), n=N, d=16, dv=5, norm=6.0)
    return q, k[:, :HKV], v[:, :HKV]


def _repeat(x):
    return np.repeat(x, HQ // HKV, axis=1)


@pytest.mark.parametrize("rec", RECORDS, ids=[r.name for r in RECORDS])
def test_grouped_equals_repeated(rec, backend, rng):
    q, k, v = _grouped(rng)
    key_mask = rng.random((2, HKV, N)) > 0.2 if rec.key_mask else None
    opts = {} if key_mask is None else {"key_mask": backend.asarray(key_mask)}
    rep = {} if key_mask is None else {"key_mask": backend.asarray(_repeat(key_mask))}
    a = rec(*(backend.asarray(x) for x in (q, k, v)), **opts)
    b = rec(*(backend.asarray(x) for x in (q, _repeat(k), _repeat(v))), **rep)
    assert tuple(a.shape) == (2, HQ, N, 5)
    # NumPy: the same arithmetic, bit for bit.  Other libraries may batch the matmuls of
    # the grouped view differently (rounding); performer_trig's cancellation (its
    # denominator is a difference of cosines) amplifies that up to ~1e4 times.
    top = float(np.abs(backend.to_numpy(b)).max())
    eps = float(np.finfo(np.float64).eps)
    atol = 0.0 if backend.name.startswith("numpy") else 1e4 * eps * max(1.0, top)
    xp_assert_close(a, b, rtol=0, atol=atol)


def test_grouped_softmax_matches_oracle(backend, rng):
    q, k, v = _grouped(rng)
    mask = rng.random((2, HQ, N, N)) > 0.3
    out = arrayattn.get_variant("softmax")(
        *(backend.asarray(x) for x in (q, k, v)), mask=backend.asarray(mask), causal=True)
    want = oracle(q, _repeat(k), _repeat(v), mask=mask, causal=True)
    xp_assert_close(out, backend.asarray(want), rtol=0,
                    atol=64 * np.finfo(np.float64).eps * np.abs(v).max())


def test_heads_not_a_multiple(rng):
    q, k, v = make_qkv(rng, batch=(1, 3), n=8, d=4)
    with pytest.raises(ValueError, match=r"do not broadcast: q \(1, 3\), k \(1, 2\)"):
        arrayattn.get_variant("softmax")(q, k[:, :2], v[:, :2])


def test_mask_with_wrong_heads(rng):
    q, k, v = _grouped(rng)
    with pytest.raises(ValueError, match="key_mask has 3 heads"):
        arrayattn.get_variant("softmax")(q, k, v, key_mask=np.ones((2, 3, N), bool))


def test_no_copy_of_keys(rng):
    """k and v are viewed, not repeated: NumPy views share k's memory."""
    from arrayattn.core.heads import group_heads
    q, k, v = _grouped(rng)
    qg, kg, vg, _, _ = group_heads(q, k, v, {})
    assert np.shares_memory(kg, k) and np.shares_memory(vg, v) and kg.shape[-3] == 1
