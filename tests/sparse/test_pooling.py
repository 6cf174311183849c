"""pooling_attention (Poolingformer) against a float64 oracle of the same definition."""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import local_attention, pooled_spans, pooling_attention
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import make_qkv
from tolerances import attention_atol, round_to


def _softmax_rows(logits_list, values_list, out_dim):
    if not logits_list:
        return np.zeros(out_dim)
    lg = np.array(logits_list)
    w = np.exp(lg - lg.max())
    return (w / w.sum()) @ np.array(values_list)


def pooling_oracle(q, k, v, *, window, pool_window, pool_size, pool_stride=None,
                   pool="mean", q2=None, k2=None, v2=None, scale=None, causal=False,
                   key_mask=None):
    """Plain float64 Poolingformer, one query at a time, from the definition:
    level 1 over keys j with i'-w1 <= j <= i'+w1 (j <= i' if causal); level 2 over pooled
    keys t whose interval [t*stride, min(t*stride+size, s)-1] lies in [i'-w2, i'+w2]
    (ends by i' if causal), pooled over real keys; the two outputs added."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    q2 = q if q2 is None else np.asarray(q2, dtype=np.float64)
    k2 = k if k2 is None else np.asarray(k2, dtype=np.float64)
    v2 = v if v2 is None else np.asarray(v2, dtype=np.float64)
    n, d = q.shape[-2:]
    s, dv = k.shape[-2], v.shape[-1]
    s1 = 1 / math.sqrt(d) if scale is None else scale
    s2 = 1 / math.sqrt(q2.shape[-1]) if scale is None else scale
    stride = pool_size if pool_stride is None else pool_stride
    l1, r1 = (window, window) if isinstance(window, int) else window
    l2, r2 = (pool_window, pool_window) if isinstance(pool_window, int) else pool_window
    km = np.ones(k.shape[:-1], dtype=bool) if key_mask is None else np.asarray(key_mask)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], km.shape[:-1])
    out = np.zeros((*batch, n, dv))
    starts = list(range(0, max(s - pool_size, 0) + stride, stride))
    starts = [t for t in starts if t < s] if s > pool_size else [0]
    for idx in np.ndindex(*batch):
        Q, K, V, Q2, K2, V2 = (np.broadcast_to(x, (*batch, *x.shape[-2:]))[idx]
                               for x in (q, k, v, q2, k2, v2))
        M = np.broadcast_to(km, (*batch, s))[idx]
        pooled = []  # (start, end, kbar, vbar) of pooled keys with a real key
        for st in starts:
            en = min(st + pool_size, s) - 1
            real = [j for j in range(st, en + 1) if M[j]]
            if not real:
                continue
            red = np.mean if pool == "mean" else np.max
            pooled.append((st, en, red(K2[real], axis=0), red(V2[real], axis=0)))
        for i in range(n):
            pos = i + s - n
            lo1, hi1 = pos - l1, (pos if causal else pos + r1)
            keys = [j for j in range(s) if lo1 <= j <= hi1 and M[j]]
            y = _softmax_rows([s1 * Q[i] @ K[j] for j in keys], [V[j] for j in keys], dv)
            lo2, hi2 = pos - l2, (pos if causal else pos + r2)
            sel = [t for t in pooled if t[0] >= lo2 and t[1] <= hi2]
            z = _softmax_rows([s2 * Q2[i] @ t[2] for t in sel], [t[3] for t in sel], dv)
            out[idx][i] = y + z
    return out


def _atol(dtype, q, k, v):
    # Two exact softmax attentions added: twice the bound of one (pooled keys have
    # norms <= max |k|, pooled values |v| <= max |v|), plus the pooling's rounding.
    return 2 * attention_atol(dtype, q, k, v) + 8 * float(np.finfo(dtype).eps) * np.abs(v).max()


# (options, (n, s)): self-attention and n != s (queries end-aligned), s = 37 not a
# multiple of the strides.
CASES = {
    "mean": (dict(window=3, pool_window=12, pool_size=4), (37, 37)),
    "max_overlap": (dict(window=(2, 5), pool_window=(9, 4), pool_size=4, pool_stride=3,
                         pool="max"), (21, 37)),
    "mean_ragged": (dict(window=1, pool_window=20, pool_size=5, pool_stride=2), (30, 37)),
}


class TestPoolingAttention:
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("case", list(CASES))
    def test_matches_oracle(self, backend, rng, case, causal):
        base, (n, s) = CASES[case]
        opts = dict(base, causal=causal, block_size=8)
        q, k, v = (round_to(x, "float32")
                   for x in make_qkv(rng, batch=(2,), n=n, s=s, d=32, dv=5, norm=8.0))
        km = rng.random((2, s)) < 0.8
        out = pooling_attention(*(backend.asarray(x, "float32") for x in (q, k, v)),
                                key_mask=backend.asarray(km), **opts)
        ref = pooling_oracle(q, k, v, key_mask=km,
                             **{o: val for o, val in opts.items() if o != "block_size"})
        xp_assert_close(out, backend.asarray(ref, "float32"), rtol=0,
                        atol=_atol("float32", q, k, v))

    def test_float64_and_second_level_inputs(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=29, d=16, dv=4, norm=6.0)
        q2, k2, v2 = make_qkv(rng, batch=(2,), n=29, d=8, dv=4, norm=6.0)
        opts = dict(window=2, pool_window=10, pool_size=3, pool="max")
        out = pooling_attention(*(backend.asarray(x) for x in (q, k, v)), block_size=4,
                                q2=backend.asarray(q2), k2=backend.asarray(k2),
                                v2=backend.asarray(v2), **opts)
        ref = pooling_oracle(q, k, v, q2=q2, k2=k2, v2=v2, **opts)
        xp_assert_close(out, backend.asarray(ref), rtol=0, atol=_atol("float64", q, k, v))

    def test_pool_size_one_is_two_local_attentions(self, backend, rng):
        # kappa = stride = 1: level 2 is plain local attention with window w2.
        q, k, v = (backend.asarray(x) for x in make_qkv(rng, batch=(2,), n=40, d=8))
        for causal in (False, True):
            out = pooling_attention(q, k, v, window=2, pool_window=7, pool_size=1,
                                    causal=causal, block_size=8)
            ref = (local_attention(q, k, v, window=2, causal=causal)
                   + local_attention(q, k, v, window=7, causal=causal))
            xp_assert_close(out, ref, rtol=0, atol=1e-14)

    def test_causal_max_pooling_bit_for_bit(self, backend, rng):
        # A future key never reaches a past query, also through a pooled maximum.
        q, k, v = make_qkv(rng, batch=(2,), n=32, d=8)
        k2, v2 = k.copy(), v.copy()
        k2[:, 17:] *= 5.0
        v2[:, 17:] = 100.0
        opts = dict(window=3, pool_window=16, pool_size=4, pool_stride=3, pool="max",
                    causal=True, block_size=8)
        a = pooling_attention(*(backend.asarray(x) for x in (q, k, v)), **opts)
        b = pooling_attention(*(backend.asarray(x) for x in (q, k2, v2)), **opts)
        xp_assert_equal(a[:, :17, :], b[:, :17, :])
        assert np.abs(backend.to_numpy(a)[:, 17:] - backend.to_numpy(b)[:, 17:]).max() > 1

    def test_spans(self):
        for s, size, stride in ((10, 4, 3), (7, 8, 2), (12, 3, None), (9, 2, 2)):
            start, end = pooled_spans(s, size, stride)
            covered = np.zeros(s, dtype=bool)
            for a, e in zip(start, end):
                assert 0 <= a <= e < s and e - a + 1 <= size
                covered[a:e + 1] = True
            assert covered.all()

    def test_errors(self, np_backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=8, d=4)
        with pytest.raises(ValueError, match="pool must be one of"):
            pooling_attention(q, k, v, pool="sum")
        with pytest.raises(ValueError, match="q2, k2, v2 must have"):
            pooling_attention(q, k, v, q2=q[:, :5])
        with pytest.raises(ValueError, match="pool_size must be >= 1"):
            pooling_attention(q, k, v, pool_size=0)
