"""Reformer LSH attention: against plain float64 oracles of the same definition.

Two oracles, both loops over tokens in NumPy float64:

* ``dense_oracle``: softmax over unit keys with the self-exclusion rule -- what LSH with
  one bucket and one chunk must equal exactly;
* ``lsh_oracle``: the whole definition (hash, stable sort, chunk + previous chunk, same
  bucket, self-exclusion, duplicate count, union softmax over rounds), written as one
  softmax over the multiset union of the rounds' key sets rather than as the
  implementation's per-round log-sum-exp merge.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import lsh_attention, lsh_buckets, lsh_rotations
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import make_qkv
from tolerances import attention_atol


# ---------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------

def unit_keys(qk):
    return qk / np.linalg.norm(qk, axis=-1, keepdims=True)


def dense_oracle(qk, v, *, causal=False, key_mask=None, scale=None):
    """softmax(scale qk_i . qk_j/|qk_j|) over real keys j != i (j <= i if causal);
    a token with no such key attends to itself.  A padded token returns zeros."""
    qk, v = np.asarray(qk, np.float64), np.asarray(v, np.float64)
    *batch, n, d = qk.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    km = np.ones((*batch, n), bool) if key_mask is None else np.asarray(key_mask)
    k = unit_keys(qk)
    out = np.zeros((*batch, n, v.shape[-1]))
    for idx in np.ndindex(*batch):
        for i in range(n):
            if not km[idx][i]:
                continue
            keys = [j for j in range(n) if km[idx][j] and j != i and (not causal or j <= i)]
            if not keys:
                out[idx][i] = v[idx][i]
                continue
            logits = np.array([scale * qk[idx][i] @ k[idx][j] for j in keys])
            w = np.exp(logits - logits.max())
            out[idx][i] = (w / w.sum()) @ v[idx][keys]
    return out


def oracle_buckets(qk, rotations, key_mask=None):
    """h_r(x) = argmax([x R_r, -x R_r]); masked tokens in the extra bucket nb."""
    qk = np.asarray(qk, np.float64)
    *batch, n, _ = qk.shape
    H, _, half = rotations.shape
    nb = max(1, 2 * half)
    b = np.zeros((*batch, H, n), dtype=np.int64)
    for idx in np.ndindex(*batch):
        for r in range(H):
            for i in range(n):
                if key_mask is not None and not key_mask[idx][i]:
                    b[idx][r, i] = nb
                elif half:
                    proj = [qk[idx][i] @ rotations[r][:, c] for c in range(half)]
                    b[idx][r, i] = int(np.argmax(proj + [-x for x in proj]))
    return b, nb


def lsh_oracle(qk, v, *, rotations, chunk_size, causal=False, key_mask=None, scale=None,
               dedup=True, buckets=None):
    """The Reformer definition, one softmax over the union of the rounds' key sets."""
    qk, v = np.asarray(qk, np.float64), np.asarray(v, np.float64)
    *batch, n, d = qk.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    b_all, nb = oracle_buckets(qk, rotations, key_mask)
    if buckets is not None:
        b_all = np.asarray(buckets)
    H = b_all.shape[-2]
    km = np.ones((*batch, n), bool) if key_mask is None else np.asarray(key_mask)
    k = unit_keys(qk)
    out = np.zeros((*batch, n, v.shape[-1]))
    for idx in np.ndindex(*batch):
        b = b_all[idx]
        weight = {}  # (i, j) -> sum over rounds of exp(logit - log N)
        for r in range(H):
            order = sorted(range(n), key=lambda t: (b[r, t], t))
            rank = {tok: t for t, tok in enumerate(order)}
            chunk = {tok: t // chunk_size for tok, t in rank.items()}
            for i in range(n):
                for j in range(n):
                    if j == i or b[r, j] != b[r, i] or b[r, j] >= nb:
                        continue
                    if chunk[j] not in (chunk[i] - 1, chunk[i]):
                        continue
                    if causal and (j > i or rank[i] - rank[j] > chunk_size):
                        continue  # causal: the chunk_size sorted slots before i
                    count = sum(b[r2, i] == b[r2, j] for r2 in range(H)) if dedup else 1
                    weight.setdefault(i, []).append((j, scale * qk[idx][i] @ k[idx][j],
                                                     math.log(count)))
        for i in range(n):
            if i not in weight:
                if km[idx][i]:
                    out[idx][i] = v[idx][i]
                continue
            js = [j for j, _, _ in weight[i]]
            logits = np.array([l - c for _, l, c in weight[i]])
            w = np.exp(logits - logits.max())
            out[idx][i] = (w / w.sum()) @ v[idx][js]
    return out


def lsh_atol(dtype, qk, v, *, rounds=1):
    """Rounding bound of softmax attention over unit keys; the merge of ``rounds``
    log-sum-exp weighted partial results adds a few ulps per round."""
    return (1 + rounds) * attention_atol(dtype, qk, unit_keys(qk), v)


def clustered(rng, batch, n, d, clusters, norm, spread):
    """Tokens around ``clusters`` random unit directions, rescaled to ``norm``."""
    c = rng.standard_normal((*batch, clusters, d))
    c /= np.linalg.norm(c, axis=-1, keepdims=True)
    label = rng.integers(0, clusters, (*batch, n))
    x = np.take_along_axis(c, label[..., None], axis=-2)
    x = x + spread * rng.standard_normal((*batch, n, d)) / math.sqrt(d)
    return x / np.linalg.norm(x, axis=-1, keepdims=True) * norm


# ---------------------------------------------------------------------------------
# Tests.  Most backend tests share one problem shape (JAX compiles every operation
# once per shape, so a shared shape keeps the JAX runs short).
# ---------------------------------------------------------------------------------

N, D, DV, C, NB, H = 45, 8, 3, 8, 4, 3   # n not a multiple of C; several chunks


def standard(rng, *, norm=8.0, batch=(2,)):
    qk, _, v = make_qkv(rng, batch=batch, n=N, d=D, dv=DV, norm=norm)
    return qk, v


class TestOracles:
    """The two oracles agree where they must (so neither is vacuous)."""

    def test_lsh_oracle_one_bucket_is_dense(self, rng):
        qk, _, v = make_qkv(rng, batch=(2,), n=12, d=4, norm=3.0)
        km = rng.random((2, 12)) < 0.7
        rot = lsh_rotations(4, num_hashes=2, num_buckets=1)
        for causal in (False, True):
            a = lsh_oracle(qk, v, rotations=rot, chunk_size=12, causal=causal, key_mask=km)
            np.testing.assert_allclose(a, dense_oracle(qk, v, causal=causal, key_mask=km),
                                       rtol=0, atol=1e-14)


class TestLshAttention:
    @pytest.mark.parametrize("num_hashes", [1, 3])
    def test_one_bucket_equals_dense(self, backend, rng, num_hashes):
        qk, v = standard(rng, batch=(3,))
        km = rng.random((3, N)) < 0.8
        km[0, :] = False            # a fully padded sequence: zeros
        km[1, :] = False
        km[1, 5] = True             # a single real token: it attends to itself
        for causal in (False, True):
            ref = dense_oracle(qk, v, causal=causal, key_mask=km)
            out = lsh_attention(backend.asarray(qk), backend.asarray(v), num_buckets=1,
                                chunk_size=N, num_hashes=num_hashes, causal=causal,
                                key_mask=backend.asarray(km))
            xp_assert_close(out, backend.asarray(ref), rtol=0,
                            atol=lsh_atol("float64", qk, v, rounds=num_hashes))
            np.testing.assert_array_equal(backend.to_numpy(out)[0], 0.0)
            np.testing.assert_array_equal(backend.to_numpy(out)[1, 5], v[1, 5])

    def test_one_bucket_chunk_larger_than_n(self, np_backend, rng):
        qk, _, v = make_qkv(rng, batch=(3,), n=20, d=8, norm=6.0)
        out = lsh_attention(qk, v, num_buckets=1, chunk_size=64, num_hashes=2)
        np.testing.assert_allclose(out, dense_oracle(qk, v), rtol=0,
                                   atol=lsh_atol("float64", qk, v, rounds=2))

    @pytest.mark.parametrize("causal", [False, True])
    def test_equals_definition(self, backend, rng, causal):
        """Several buckets, several chunks (n not a multiple of C), padding, sharp qk,
        with and without the duplicate count."""
        qk, v = standard(rng)
        km = rng.random((2, N)) < 0.85
        rot = lsh_rotations(D, num_hashes=H, num_buckets=NB, seed=5)
        for dedup in (True, False):
            ref = lsh_oracle(qk, v, rotations=rot, chunk_size=C, causal=causal,
                             key_mask=km, dedup=dedup)
            out = lsh_attention(backend.asarray(qk), backend.asarray(v), num_hashes=H,
                                num_buckets=NB, chunk_size=C, seed=5, causal=causal,
                                key_mask=backend.asarray(km), dedup=dedup)
            xp_assert_close(out, backend.asarray(ref), rtol=0,
                            atol=lsh_atol("float64", qk, v, rounds=H))

    @pytest.mark.parametrize("causal", [False, True])
    def test_blocks_of_chunks(self, np_backend, rng, monkeypatch, causal):
        """Long inputs run over blocks of chunks: one chunk per block (the smallest
        tile) gives the oracle's result too."""
        import arrayattn.reference.lsh as lsh_module

        qk, v = standard(rng)
        km = rng.random((2, N)) < 0.85
        rot = lsh_rotations(D, num_hashes=H, num_buckets=NB, seed=5)
        ref = lsh_oracle(qk, v, rotations=rot, chunk_size=C, causal=causal, key_mask=km)
        monkeypatch.setattr(lsh_module, "_TILE", 1)
        out = lsh_attention(qk, v, num_hashes=H, num_buckets=NB, chunk_size=C, seed=5,
                            causal=causal, key_mask=km)
        np.testing.assert_allclose(out, ref, rtol=0, atol=lsh_atol("float64", qk, v, rounds=H))

    def test_equals_definition_float32(self, backend, rng):
        """float32: the attention part against the oracle given the same buckets."""
        qk, v = standard(rng)
        qk32, v32 = backend.asarray(qk, "float32"), backend.asarray(v, "float32")
        b = backend.to_numpy(lsh_buckets(qk32, num_hashes=H, num_buckets=NB, seed=1))
        rot = lsh_rotations(D, num_hashes=H, num_buckets=NB, seed=1)
        qk_r, v_r = (np.asarray(backend.to_numpy(x), np.float64) for x in (qk32, v32))
        ref = lsh_oracle(qk_r, v_r, rotations=rot, chunk_size=C, buckets=b)
        out = lsh_attention(qk32, v32, num_hashes=H, num_buckets=NB, chunk_size=C, seed=1)
        xp_assert_close(out, backend.asarray(ref, "float32"), rtol=0,
                        atol=lsh_atol("float32", qk_r, v_r, rounds=H))

    def test_self_only_when_no_other_key(self, np_backend):
        """Two tokens in different buckets of every round: each returns its own value."""
        qk = np.array([[1.0, 0.0], [-1.0, 0.0]])
        v = np.array([[3.0], [-7.0]])
        rot = np.ones((2, 2, 1))  # h = argmax([x0 + x1, -(x0 + x1)]): bucket 0 and 1
        out = lsh_attention(qk, v, num_hashes=2, rotations=rot, chunk_size=4)
        np.testing.assert_array_equal(out, v)
        # Same bucket: each sees only the other token.
        out = lsh_attention(qk, v, num_hashes=2, num_buckets=1, chunk_size=4)
        np.testing.assert_array_equal(out, v[::-1])

    def test_chunk_window(self, np_backend, rng):
        """One bucket, chunk C: sorted order = positions, so a query in chunk c sees
        exactly the keys of chunks c-1 and c (no wrap-around)."""
        n, C = 12, 4
        qk, _, _ = make_qkv(rng, batch=(), n=n, d=4, norm=1.0)
        a = lsh_attention(qk, np.eye(n), num_buckets=1, chunk_size=C, num_hashes=1)
        seen = a > 0
        for i in range(n):
            c = i // C
            expect = {j for j in range(n) if j // C in (c - 1, c) and j != i}
            assert set(np.flatnonzero(seen[i])) == expect

    def test_finite_with_padding(self, backend, rng):
        """Sharp logits, heavy and total padding, float32: finite, zeros for padding."""
        qk, v = standard(rng, norm=100.0)   # logits up to 35
        km = rng.random((2, N)) < np.array([0.0, 0.15])[:, None]
        for causal in (False, True):
            out = lsh_attention(backend.asarray(qk, "float32"), backend.asarray(v, "float32"),
                                num_hashes=H, num_buckets=NB, chunk_size=C, causal=causal,
                                key_mask=backend.asarray(km))
            o = backend.to_numpy(out)
            assert np.isfinite(o).all()
            np.testing.assert_array_equal(o[~km], 0.0)

    @pytest.mark.parametrize("causal", [False, True])
    def test_padding_is_removed(self, backend, rng, causal):
        """Padded tokens never take a chunk slot: the real tokens' result equals the
        result on the sequence with the padding cut out (same rotations)."""
        qk, v = standard(rng)
        real = 30   # the same number of real tokens per row, at random positions
        km = np.zeros((2, N), bool)
        for b in range(2):
            km[b, rng.choice(N, real, replace=False)] = True
        opts = dict(num_hashes=H, num_buckets=NB, chunk_size=C, seed=2, causal=causal)
        out = backend.to_numpy(lsh_attention(backend.asarray(qk), backend.asarray(v),
                                             key_mask=backend.asarray(km), **opts))
        # The cut problem runs on NumPy (bit for bit there; other backends within
        # rounding -- this spares JAX a compilation for one more shape). The dense
        # definition (numpy_reference) sums over the padded keys too, with weight 0:
        # the same to rounding, not bit for bit.
        ref = lsh_attention(qk[km].reshape(2, real, D), v[km].reshape(2, real, DV), **opts)
        if backend.name in ("numpy", "numpy_readonly"):
            np.testing.assert_array_equal(out[km].reshape(2, real, DV), ref)
        np.testing.assert_allclose(out[km].reshape(2, real, DV), ref, rtol=0,
                                   atol=lsh_atol("float64", qk, v, rounds=H))
        np.testing.assert_array_equal(out[~km], 0.0)

    def test_more_hashes_reduce_error(self, np_backend):
        """Clustered tokens (8 directions, sharp): the error against full attention
        (self excluded) falls as hash rounds are added.  Fixed seeds; measured means
        over 4 problems x 4 seeds are 1.75, 1.01, 0.70, 0.56 for H = 1, 2, 4, 8."""
        rng = np.random.default_rng(7)
        errors = {h: [] for h in (1, 2, 4, 8)}
        for _ in range(4):
            qk = clustered(rng, (2,), 256, 32, clusters=8, norm=24.0, spread=0.3)
            v = rng.standard_normal((2, 256, 4))
            ref = dense_oracle(qk, v)
            for h in errors:
                for seed in range(4):
                    out = lsh_attention(qk, v, num_hashes=h, num_buckets=8, chunk_size=32,
                                        seed=seed)
                    errors[h].append(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        mean = [np.mean(errors[h]) for h in (1, 2, 4, 8)]
        assert all(a > 1.15 * b for a, b in zip(mean, mean[1:])), mean
        assert mean[-1] < 0.4 * mean[0], mean

    def test_causal_future_values_and_rescaled_keys(self, backend, rng):
        """Changing future values, or future qk by a factor 2 (same buckets, same unit
        keys), leaves every past output bit for bit."""
        cut = 20
        qk, v = standard(rng, norm=5.0)
        qk2, v2 = qk.copy(), v.copy()
        qk2[:, cut + 1:] *= 2.0
        v2[:, cut + 1:] = 1e3
        opts = dict(num_hashes=H, num_buckets=NB, chunk_size=C, causal=True)
        a = lsh_attention(backend.asarray(qk), backend.asarray(v), **opts)
        b = lsh_attention(backend.asarray(qk2), backend.asarray(v2), **opts)
        xp_assert_equal(a[:, : cut + 1, :], b[:, : cut + 1, :])

    def test_causal_future_buckets_do_not_leak(self, backend, rng):
        """Moving future tokens into other buckets (which shifts their sorted slots and,
        with plain chunk windows, the chunk boundaries of past tokens) leaves every past
        output unchanged: to rounding, since the past keys sit at other slots of the
        window (another summation order), and never with another key set."""
        n, cut = 64, 32
        qk, _, v = make_qkv(rng, batch=(2,), n=n, d=8, norm=5.0)
        opts = dict(num_hashes=2, num_buckets=4, chunk_size=8, causal=True, seed=0)
        qk2 = qk.copy()
        qk2[:, cut + 1:] = rng.standard_normal(qk2[:, cut + 1:].shape) * 5.0
        b1 = lsh_buckets(qk, **{k_: opts[k_] for k_ in ("num_hashes", "num_buckets", "seed")})
        b2 = lsh_buckets(qk2, **{k_: opts[k_] for k_ in ("num_hashes", "num_buckets", "seed")})
        assert (b1[..., cut + 1:] != b2[..., cut + 1:]).any()  # the buckets did move
        a = lsh_attention(backend.asarray(qk), backend.asarray(v), **opts)
        b = lsh_attention(backend.asarray(qk2), backend.asarray(v), **opts)
        xp_assert_close(a[:, : cut + 1, :], b[:, : cut + 1, :], rtol=0,
                        atol=lsh_atol("float64", qk, v, rounds=2))
        # And the float64 definition agrees (no key set changed, exactly).
        rot = lsh_rotations(8, num_hashes=2, num_buckets=4, seed=0)
        r1 = lsh_oracle(qk, v, rotations=rot, chunk_size=8, causal=True)
        r2 = lsh_oracle(qk2, v, rotations=rot, chunk_size=8, causal=True)
        np.testing.assert_allclose(r1[:, : cut + 1], r2[:, : cut + 1], rtol=0, atol=1e-13)

    def test_seed_reproduces_on_every_backend(self, backend, rng):
        qk, v = standard(rng)
        opts = dict(num_hashes=H, num_buckets=NB, chunk_size=C)
        ref_b = lsh_buckets(qk, seed=11, **opts)
        b = lsh_buckets(backend.asarray(qk), seed=11, **opts)
        np.testing.assert_array_equal(backend.to_numpy(b), ref_b)
        np.testing.assert_array_equal(
            ref_b, oracle_buckets(qk, lsh_rotations(D, num_hashes=H, num_buckets=NB,
                                                    seed=11))[0])
        assert not np.array_equal(lsh_buckets(qk, seed=12, **opts), ref_b)
        ref = lsh_attention(qk, v, seed=11, **opts)
        for _ in range(2):
            out = lsh_attention(backend.asarray(qk), backend.asarray(v), seed=11, **opts)
            xp_assert_close(out, backend.asarray(ref), rtol=0,
                            atol=lsh_atol("float64", qk, v, rounds=H))

    def test_caller_rotations(self, backend, rng):
        """Given rotations replace the draw; per-head rotations broadcast."""
        qk, v = standard(rng)     # batch (2,): read as two heads
        rot = lsh_rotations(D, num_hashes=H, num_buckets=NB, seed=4)
        a = lsh_attention(backend.asarray(qk), backend.asarray(v), num_hashes=H,
                          num_buckets=NB, chunk_size=C, seed=4)
        b = lsh_attention(backend.asarray(qk), backend.asarray(v), num_hashes=H,
                          chunk_size=C, rotations=backend.asarray(rot))
        xp_assert_equal(a, b)
        heads = np.stack([lsh_rotations(D, num_hashes=H, num_buckets=NB, seed=s)
                          for s in range(2)])                         # (2, H, d, nb/2)
        c = backend.to_numpy(lsh_attention(backend.asarray(qk), backend.asarray(v),
                                           num_hashes=H, chunk_size=C,
                                           rotations=backend.asarray(heads)))
        for h in range(2):
            ref = lsh_attention(qk[h], v[h], num_hashes=H, num_buckets=NB, chunk_size=C,
                                seed=h)
            np.testing.assert_allclose(c[h], ref, rtol=0,
                                       atol=lsh_atol("float64", qk, v, rounds=H))

    def test_half_precision(self, backend, rng):
        if backend.name.startswith("strict") or backend.name == "numpy_readonly":
            pytest.skip("float16 covered on numpy/torch/jax")
        qk, v = standard(rng)
        out = lsh_attention(backend.asarray(qk, "float16"), backend.asarray(v, "float16"),
                            num_hashes=H, num_buckets=NB, chunk_size=C)
        assert out.dtype == backend.dtype("float16")
        assert np.isfinite(backend.to_numpy(out).astype(np.float64)).all()

    def test_errors(self, np_backend, rng):
        qk, _, v = make_qkv(rng, batch=(2,), n=10, d=4)
        with pytest.raises(ValueError, match="num_buckets must be 1 or even"):
            lsh_attention(qk, v, num_buckets=3)
        with pytest.raises(ValueError, match="chunk_size must be >= 1"):
            lsh_attention(qk, v, chunk_size=0)
        with pytest.raises(ValueError, match="v has s=9 tokens but qk has s=10"):
            lsh_attention(qk, v[:, :9])
        with pytest.raises(ValueError, match=r"rotations must have shape .* d=4"):
            lsh_attention(qk, v, rotations=np.ones((4, 5, 2)))
        with pytest.raises(ValueError, match="hold 2 hash rounds but num_hashes=4"):
            lsh_attention(qk, v, rotations=np.ones((2, 4, 2)))
        with pytest.raises(ValueError, match="give 4 buckets but num_buckets=6"):
            lsh_attention(qk, v, num_hashes=2, num_buckets=6, rotations=np.ones((2, 4, 2)))
        with pytest.raises(ValueError, match="do not broadcast to the batch"):
            lsh_attention(qk, v, num_hashes=2, rotations=np.ones((3, 2, 4, 2)))
        with pytest.raises(ValueError, match="key_mask must have shape"):
            lsh_attention(qk, v, key_mask=np.ones((2, 9), bool))
        with pytest.raises(TypeError, match="qk must have a real floating dtype"):
            lsh_attention(qk.astype(np.int64), v)


class TestLshGradients:
    def test_torch_gradcheck(self, rng):
        """Gradients flow through the gathers, sorts and the round merge (buckets are
        piecewise constant: the finite differences stay inside one bucket pattern)."""
        from conftest import get_backend
        get_backend("torch")
        import torch

        qk, _, v = make_qkv(rng, batch=(1,), n=12, d=4, dv=2, norm=3.0)
        km = torch.tensor(rng.random((1, 12)) < 0.8)
        opts = dict(num_hashes=2, num_buckets=4, chunk_size=4)
        b0 = lsh_buckets(qk, **opts)
        qk_t, v_t = (torch.tensor(x, requires_grad=True) for x in (qk, v))
        assert torch.autograd.gradcheck(
            lambda a, b: lsh_attention(a, b, causal=True, key_mask=km, **opts), (qk_t, v_t))
        # the finite differences did not cross a bucket boundary
        np.testing.assert_array_equal(lsh_buckets(qk + 1e-6, **opts), b0)
        np.testing.assert_array_equal(lsh_buckets(qk - 1e-6, **opts), b0)
