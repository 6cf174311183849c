"""Issue #15 for the low-rank and hashing family (Nyström, landmark, Linformer, Luna,
Poolingformer, LSH): padded keys and values may hold anything, s = 0, flags that are
not bools, seeds, and options whose errors must name the argument."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import (linformer_attention, linformer_projection, lsh_attention,
                       lsh_rotations, luna_attention, nystrom_attention, pooling_attention)

from conftest import make_qkv

FAMILY = ["nystrom_iterative", "nystrom_svd", "landmark", "linformer", "luna",
          "poolingformer", "lsh"]
OPTIONS = {"nystrom_iterative": {"num_landmarks": 5}, "nystrom_svd": {"num_landmarks": 5},
           "landmark": {"num_landmarks": 5}, "linformer": {"proj_dim": 6},
           "luna": {"num_packed": 4}, "poolingformer": {"window": 3, "pool_window": 8,
                                                        "block_size": 8},
           "lsh": {"num_hashes": 2, "chunk_size": 8}}
N = 24


@pytest.mark.parametrize("name", FAMILY)
def test_nan_and_inf_in_padded_keys_and_values_never_leak(backend, rng, name):
    """A masked key is in neither numerator nor denominator, so its row of ``k`` and
    ``v`` (NaN, inf from ``torch.empty`` padding) must not change any output: the result
    equals the one with finite padding, and is finite.  (LSH: ``q`` is the shared
    ``qk``, so its padded rows are keys too.)"""
    if backend.name == "jax" and name == "nystrom_svd":
        pytest.skip("jax: the SVD compiles for ~10 s per shape; nystrom_iterative covers "
                    "the path")
    var = arrayattn.get_variant(name)
    q, k, v = make_qkv(rng, batch=(2,), n=N, s=N, d=8, dv=3, norm=4.0)
    km = np.ones((2, N), bool)
    km[:, -6:] = False
    km[1, 3] = False
    dirty = [x.copy() for x in (q, k, v)]
    dirty[2][~km] = np.nan
    dirty[2][1, -1] = np.inf
    dirty[1][~km] = np.inf
    dirty[1][0, -2] = np.nan
    if name == "lsh":
        dirty[0][~km] = np.nan
    mask = backend.asarray(km)
    clean = var(*(backend.asarray(x, "float64") for x in (q, k, v)), key_mask=mask,
                **OPTIONS[name])
    out = var(*(backend.asarray(x, "float64") for x in dirty), key_mask=mask,
              **OPTIONS[name])
    clean, out = backend.to_numpy(clean), backend.to_numpy(out)
    if name == "lsh":   # the padded tokens' own rows are 0; the rest must be finite
        assert (out[~km] == 0).all()
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, clean, rtol=0, atol=1e-13 * np.abs(clean).max())


@pytest.mark.parametrize("name", ["linformer", "luna", "poolingformer"])
def test_no_keys_give_zeros(name, rng):
    """s = 0: every query attends to nothing, so the output is zeros (never an error
    from a reduction over an empty axis)."""
    var = arrayattn.get_variant(name)
    q = rng.standard_normal((2, 5, 8))
    k, v = np.zeros((2, 0, 8)), np.zeros((2, 0, 3))
    for engine in ("reference", "numpy"):
        with arrayattn.use_engine(engine):
            out = var(q, k, v, **OPTIONS[name])
        assert out.shape == (2, 5, 3) and (out == 0).all()
    p = rng.standard_normal((4, 8))
    out, packed = luna_attention(q, k, v, p, return_packed=True,
                                 unpack_key_proj=rng.standard_normal((3, 8)))
    assert packed.shape == (2, 4, 3) and (packed == 0).all() and (out == 0).all()


def test_lsh_without_tokens_gives_zeros():
    out = lsh_attention(np.zeros((2, 0, 8)), np.zeros((2, 0, 3)))
    assert out.shape == (2, 0, 3)


def test_nystrom_without_keys_returns_zeros_and_needs_a_key_per_landmark():
    """No keys: every query attends to nothing, zeros whatever ``num_landmarks`` (the
    conventions' s = 0, issue #25); with keys, a landmark is a mean of >= 1 key."""
    out = nystrom_attention(np.ones((5, 4)), np.ones((0, 4)), np.ones((0, 2)),
                            num_landmarks=1)
    assert out.shape == (5, 2) and not out.any()
    with pytest.raises(ValueError, match="num_landmarks=4 exceeds .* s=3"):
        nystrom_attention(np.ones((5, 4)), np.ones((3, 4)), np.ones((3, 2)),
                          num_landmarks=4)


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("flag", ["False", 0, None])
def test_causal_must_be_a_bool(name, flag, rng):
    """``causal="False"`` is a non-empty string, true: refused, naming ``causal``."""
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    with pytest.raises(TypeError, match="causal must be True or False"):
        arrayattn.get_variant(name)(q, k, v, causal=flag, **OPTIONS[name])


@pytest.mark.parametrize("call", [
    lambda q, k, v, seed: linformer_attention(q, k, v, proj_dim=4, seed=seed),
    lambda q, k, v, seed: linformer_projection(4, 10, seed=seed),
    lambda q, k, v, seed: arrayattn.get_variant("luna")(q, k, v, seed=seed),
    lambda q, k, v, seed: lsh_attention(q, v, chunk_size=8, seed=seed),
    lambda q, k, v, seed: lsh_rotations(8, num_buckets=4, seed=seed),
], ids=["linformer", "linformer_projection", "luna", "lsh", "lsh_rotations"])
@pytest.mark.parametrize("seed, error", [(-1, ValueError), (2.5, TypeError),
                                         ("x", TypeError), (None, TypeError),
                                         (True, TypeError)])
def test_seed_is_a_non_negative_int(call, seed, error, rng):
    """The one rule: a non-negative integer; ``None`` (fresh entropy, a different
    result on every call) is refused; every error names ``seed``."""
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    with pytest.raises(error, match="seed must be a non-negative integer"):
        call(q, k, v, seed)


def test_same_seed_same_result(rng):
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    for name in ("linformer", "luna", "lsh"):
        var = arrayattn.get_variant(name)
        np.testing.assert_array_equal(var(q, k, v, seed=3), var(q, k, v, seed=3))


@pytest.mark.parametrize("num_packed, error", [(0, ValueError), (-1, ValueError),
                                               (2.5, TypeError), ("8", TypeError),
                                               (None, TypeError), (True, TypeError)])
def test_luna_num_packed(num_packed, error, rng):
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    with pytest.raises(error, match="num_packed"):
        arrayattn.get_variant("luna")(q, k, v, num_packed=num_packed)


def test_luna_adapter_validates_before_reading_shapes():
    """0-d inputs: a clear error from the input checks, not an IndexError."""
    with pytest.raises((TypeError, ValueError), match=r"\bq\b"):
        arrayattn.get_variant("luna")(np.float64(1.0), np.ones((4, 8)), np.ones((4, 8)))
    with pytest.raises(TypeError, match=r"\bq\b"):
        arrayattn.get_variant("luna")(None, np.ones((4, 8)), np.ones((4, 8)))


def test_luna_return_packed_must_be_a_bool(rng):
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    with pytest.raises(TypeError, match="return_packed must be True or False"):
        luna_attention(q, k, v, q[:4], return_packed="yes")


@pytest.mark.parametrize("bad, error", [(-1, ValueError), ("8", TypeError),
                                        ((1, 2, 3), TypeError), (True, TypeError)])
def test_pooling_window_errors_name_pool_window(bad, error, rng):
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    with pytest.raises(error, match="^pool_window"):
        pooling_attention(q, k, v, window=2, pool_window=bad)
    with pytest.raises(error, match="^window"):
        pooling_attention(q, k, v, window=bad, pool_window=4)


def test_lsh_dedup_must_be_a_bool(rng):
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    with pytest.raises(TypeError, match="dedup must be True or False"):
        lsh_attention(q, v, chunk_size=8, dedup="no")


@pytest.mark.parametrize("kernel", [0, 1.5, [1.0, 2.0, 3.0], None])
def test_nystrom_conv_kernel_not_an_array(kernel, rng):
    q, k, v = make_qkv(rng, batch=(), n=N, s=N, d=8)
    if kernel is None:
        assert nystrom_attention(q, k, v, num_landmarks=4, conv_kernel=None).shape == v.shape
        return
    with pytest.raises(TypeError, match="conv_kernel must be an array"):
        nystrom_attention(q, k, v, num_landmarks=4, conv_kernel=kernel)
