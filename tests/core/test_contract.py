"""The contract of the conventions, for every registered variant on every backend: the
classes of an adversarial probe (issue #15) held as permanent tests -- padding that holds
NaN or inf, non-array and 0-d inputs, d = 0, s = 0, flags given as strings."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn

from conftest import make_qkv

RECORDS = arrayattn.variants()
IDS = [r.name for r in RECORDS]


@pytest.fixture(params=RECORDS, ids=IDS)
def record(request):
    return request.param


def _qkv(rng, n=96):
    return make_qkv(rng, batch=(2,), n=n, d=16, dv=5, norm=6.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_padding_values_and_keys_never_leak(record, backend, rng, bad):
    """A masked key is in neither numerator nor denominator, so what its row of ``k`` and
    ``v`` holds (``torch.empty`` padding: anything) cannot matter: NaN/inf padding gives
    the output of zero padding, bit for bit."""
    if not record.key_mask:
        pytest.skip(f"{record.name} takes no key_mask")
    q, k, v = _qkv(rng)
    km = np.ones((2, 96), bool)
    km[:, -17:] = False
    kz, vz = k.copy(), v.copy()
    kz[:, -17:], vz[:, -17:] = 0.0, 0.0
    kb, vb = k.copy(), v.copy()
    kb[:, -17:], vb[:, -17:] = bad, bad
    if record.name == "lsh":   # shared-QK: the padded keys are the padded queries too
        q, qb = kz, kb
    else:
        qb = q
    on = backend.asarray
    want = record(on(q), on(kz), on(vz), key_mask=on(km))
    got = record(on(qb), on(kb), on(vb), key_mask=on(km))
    got, want = backend.to_numpy(got), backend.to_numpy(want)
    if record.name == "lsh":   # the padded queries' own outputs are not defined by padding
        got, want = got[:, :-17], want[:, :-17]
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("value", [None, [[1.0, 2.0]], 3.0])
def test_not_an_array(record, value, rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match=r"\bqk?\b"):   # lsh calls it qk (shared QK)
        record(value, k, v)


def test_zero_dim_input(record):
    x = np.float64(1.0)
    with pytest.raises((ValueError, TypeError)) as info:
        record(np.asarray(x), np.ones((4, 2)), np.ones((4, 2)))
    assert "q" in str(info.value)


def test_d_zero(record):
    """No features: a clear error or a finite result, never ZeroDivisionError."""
    q, k, v = np.ones((2, 8, 0)), np.ones((2, 8, 0)), np.ones((2, 8, 3))
    try:
        out = record(q, k, v)
    except (ValueError, TypeError):
        return
    assert np.isfinite(out).all()


def test_no_keys(record, backend):
    """``s = 0``: every query attends to nothing -- zeros (or a clear error where the
    variant needs keys, e.g. a landmark needs a key)."""
    if not record.cross:
        pytest.skip(f"{record.name} is self-attention only (n = s)")
    q = backend.asarray(np.ones((2, 6, 4)))
    k = backend.asarray(np.ones((2, 0, 4)))
    v = backend.asarray(np.ones((2, 0, 3)))
    try:
        out = record(q, k, v)
    except ValueError:
        return
    out = backend.to_numpy(out)
    assert out.shape == (2, 6, 3)
    np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("flag", ["False", "True", 1, None])
def test_causal_takes_bools_only(record, flag, rng):
    q, k, v = _qkv(rng)
    with pytest.raises((TypeError, ValueError), match="causal"):
        record(q, k, v, causal=flag)


def test_numpy_bools_are_bools(record, rng):
    q, k, v = _qkv(rng)
    if not record.causal:
        pytest.skip(f"{record.name} cannot be causal")
    np.testing.assert_array_equal(record(q, k, v, causal=np.bool_(True)),
                                  record(q, k, v, causal=True))


@pytest.mark.parametrize("seed", [-1, 2.5, "x", None])
def test_one_seed_rule(record, seed, rng):
    if not record.random:
        pytest.skip(f"{record.name} draws nothing")
    q, k, v = _qkv(rng)
    with pytest.raises((TypeError, ValueError), match="seed"):
        record(q, k, v, seed=seed)


def test_register_takes_a_variant():
    with pytest.raises(TypeError, match="Variant"):
        arrayattn.register("softmax")
