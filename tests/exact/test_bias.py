"""The additive logit bias of exact attention (ALiBi, T5/relative-position biases, a
float mask as SDPA's float ``attn_mask``) against a float64 loop oracle, on every
backend: exact dense and blockwise, and the sparse patterns."""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import (bigbird_layout, local_attention, local_layout, longformer_layout,
                       softmax_attention, sparse_attention, strided_layout)
from arrayattn.testing import xp_assert_close

from conftest import make_qkv

F64 = float(np.finfo(np.float64).eps)


def loop_oracle(q, k, v, bias, *, scale, causal=False):
    """``o_i = sum_j w_ij v_j``, ``w_ij ∝ exp(q_i·k_j scale + b_ij)`` over the keys the
    causal pattern allows and whose bias is not ``-inf``; zeros for a row with none."""
    *batch, n, _ = q.shape
    s = k.shape[-2]
    out = np.zeros((*batch, n, v.shape[-1]))
    for idx in np.ndindex(*batch):
        for i in range(n):
            logits = [(j, float(q[idx][i] @ k[idx][j]) * scale + bias[idx][i, j])
                      for j in range(s) if not (causal and j > i + s - n)
                      and bias[idx][i, j] != -math.inf]
            if not logits:
                continue
            top = max(x for _, x in logits)
            w = {j: math.exp(x - top) for j, x in logits}
            total = sum(w.values())
            out[idx][i] = sum(w[j] * v[idx][j] for j in w) / total
    return out


def alibi(heads, n, s):
    """ALiBi (Press et al. 2022): head ``h`` adds ``-m_h (i + s - n - j)``,
    ``m_h = 2^(-8 (h + 1) / H)``."""
    slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
    dist = (np.arange(n)[:, None] + s - n) - np.arange(s)[None, :]
    return -slopes[:, None, None] * np.abs(dist)[None]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [None, 8])
def test_bias_matches_loop_oracle(backend, rng, causal, block_size):
    q, k, v = make_qkv(rng, batch=(2, 3), n=20, s=28, d=8, dv=5, norm=6.0, sharp=True)
    bias = np.broadcast_to(alibi(3, 20, 28), (2, 3, 20, 28)).copy()
    bias[0, 1, 4, :] = -np.inf                 # a row with no allowed key: zeros
    bias[1, 0, :, ::3] = -np.inf               # every third key masked by the bias
    want = loop_oracle(q, k, v, bias, scale=0.3, causal=causal)
    on = backend.asarray
    out = softmax_attention(on(q), on(k), on(v), bias=on(bias), scale=0.3, causal=causal,
                            block_size=block_size)
    xp_assert_close(out, on(want), rtol=0, atol=64 * F64 * np.abs(v).max())
    assert np.all(backend.to_numpy(out)[0, 1, 4] == 0.0)


def test_bias_broadcasts_and_casts(rng):
    q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 3), n=6, d=4))
    bias = alibi(3, 6, 6)                      # (heads, n, s) float64 against float32 q
    out = softmax_attention(q, k, v, bias=bias)
    assert out.dtype == np.float32
    want = loop_oracle(q.astype(np.float64), k, v, np.broadcast_to(bias, (2, 3, 6, 6)),
                       scale=0.5)
    np.testing.assert_allclose(out, want, atol=64 * float(np.finfo(np.float32).eps))


def test_bias_errors():
    q = k = v = np.ones((2, 4, 8))
    with pytest.raises(ValueError, match=r"bias must have shape \(\.\.\., n, s\)"):
        softmax_attention(q, k, v, bias=np.zeros((2, 4, 5)))
    with pytest.raises(TypeError, match="bias must have a real floating dtype"):
        softmax_attention(q, k, v, bias=np.zeros((4, 4), bool))
    with pytest.raises(TypeError, match="bias must be an array"):
        softmax_attention(q, k, v, bias=[[0.0]])


SPARSE_LAYOUTS = {
    "local": lambda causal: local_layout(20, s=28, window=3, block_size=4, causal=causal),
    "longformer": lambda causal: longformer_layout(28, window=2, global_tokens=[0, 17],
                                                   block_size=4, causal=causal),
    "bigbird": lambda causal: bigbird_layout(28, block_size=4, num_random_blocks=1, seed=3,
                                             causal=causal),
    "strided": lambda causal: strided_layout(28, stride=2, block_size=4, causal=causal),
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", sorted(SPARSE_LAYOUTS))
def test_sparse_bias_matches_loop_oracle(backend, rng, pattern, causal):
    """The bias on a sparse pattern: the oracle sees the pattern as ``-inf`` bias
    entries; a bias ``-inf`` inside the pattern masks too."""
    layout = SPARSE_LAYOUTS[pattern](causal)
    n, s = layout.n, layout.s
    q, k, v = make_qkv(rng, batch=(2, 3), n=n, s=s, d=8, dv=5, norm=6.0, sharp=True)
    bias = np.broadcast_to(alibi(3, n, s), (2, 3, n, s)).copy()
    bias[1, 2, :, 1::4] = -np.inf
    bias[0, 0, 3, :] = -np.inf
    pattern_bias = np.where(layout.dense_mask(), bias, -np.inf)
    want = loop_oracle(q, k, v, pattern_bias, scale=0.3)
    on = backend.asarray
    out = sparse_attention(on(q), on(k), on(v), layout=layout, bias=on(bias), scale=0.3)
    xp_assert_close(out, on(want), rtol=0, atol=64 * F64 * np.abs(v).max())
    assert np.all(backend.to_numpy(out)[0, 0, 3] == 0.0)


def test_local_attention_bias_broadcasts(rng):
    """``local_attention`` passes ``bias (heads, n, s)`` through; ``-inf`` masks."""
    q, k, v = make_qkv(rng, batch=(2, 3), n=24, d=8, dv=4, norm=6.0)
    bias = alibi(3, 24, 24)
    bias[2, :, 5] = -np.inf
    out = local_attention(q, k, v, window=4, causal=True, bias=bias, block_size=8)
    band = local_layout(24, window=4, causal=True).dense_mask()
    want = loop_oracle(q, k, v, np.where(band, np.broadcast_to(bias, (2, 3, 24, 24)), -np.inf),
                       scale=1 / np.sqrt(8))
    np.testing.assert_allclose(out, want, rtol=0, atol=64 * F64 * np.abs(v).max())
