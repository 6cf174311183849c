"""Exact attention's kernel options (issue #24): window, softcap, ALiBi, query_mask, lse,
dropout keep-masks, packed variable-length sequences, a paged KV cache, FlexAttention's
score_mod / mask_mod.

The oracle is a float64 loop over (batch, head, query, key) written from FlashAttention's
and FlexAttention's documented semantics, independent of the logits pipeline; every
option alone and every pair of them is checked against it, dense and blockwise, plus the
backward of each against torch autograd through the reference form.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import arrayattn

from conftest import get_backend, make_qkv

B, H, N, S, D = 2, 2, 7, 9, 4


def oracle(q, k, v, *, scale=None, causal=False, window=None, softcap=None,
           alibi_slopes=None, bias=None, key_mask=None, query_mask=None, mask=None,
           dropout_mask=None, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
           score_mod=None, mask_mod=None):
    """``(out, lse)`` of 4-D ``(B, H, n, d)`` inputs, one logit at a time."""
    b_, h_, n, d = q.shape
    s = k.shape[-2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    left, right = (None, None) if window is None else window
    left = None if left == -1 else left
    right = None if right == -1 else right
    if causal:
        right = 0 if right is None else min(right, 0)
    out = np.zeros((b_, h_, n, v.shape[-1]))
    lse = np.full((b_, h_, n), -np.inf)
    for b, h, i in itertools.product(range(b_), range(h_), range(n)):
        if cu_seqlens_q is not None:
            seg = int(np.searchsorted(cu_seqlens_q, i, side="right") - 1)
            keys = range(cu_seqlens_k[seg], cu_seqlens_k[seg + 1])
            diag = i + (cu_seqlens_k[seg + 1] - cu_seqlens_q[seg + 1])
        else:
            keys, diag = range(s), i + s - n
        logits, idx = [], []
        for j in keys:
            if left is not None and j < diag - left:
                continue
            if right is not None and j > diag + right:
                continue
            if key_mask is not None and not key_mask[b, h, j]:
                continue
            if query_mask is not None and not query_mask[b, 0, i]:
                continue
            if mask is not None and not mask[i, j]:
                continue
            if mask_mod is not None and not mask_mod(np.int64(b), np.int64(h), np.int64(i),
                                                     np.int64(j)):
                continue
            x = scale * float(q[b, h, i] @ k[b, h, j])
            if softcap:
                x = softcap * math.tanh(x / softcap)
            if score_mod is not None:
                x = float(score_mod(np.float64(x), np.int64(b), np.int64(h), np.int64(i),
                                    np.int64(j)))
            if bias is not None:
                x += bias[b, h, i, j]
            if alibi_slopes is not None:
                x -= alibi_slopes[h] * abs(diag - j)
            logits.append(x)
            idx.append(j)
        if not logits:
            continue
        m = max(logits)
        w = np.exp(np.array(logits) - m)
        lse[b, h, i] = m + math.log(w.sum())
        w /= w.sum()
        for wj, j in zip(w, idx):
            keep = 1.0 if dropout_mask is None else dropout_mask[b, h, i, j] / (1 - dropout_p)
            out[b, h, i] += wj * keep * v[b, h, j]
    return out, lse


def _score_mod(score, b, h, q_idx, kv_idx):
    """A relative-position bias written as FlexAttention users write them."""
    return score + 0.1 * (q_idx - kv_idx) * (h + 1) - 0.05 * b


def _mask_mod(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx + h) % 3 != 0


def _options(rng):
    """Each option with a value that exercises it."""
    keep = rng.random((B, H, N, S)) > 0.3
    return {
        "causal": {"causal": True},
        "window": {"window": (2, 1)},
        "window_left": {"window": (3, -1)},
        "softcap": {"softcap": 1.5},
        "alibi": {"alibi_slopes": np.array([0.5, 0.25])},
        "bias": {"bias": rng.standard_normal((B, H, N, S))},
        "key_mask": {"key_mask": rng.random((B, H, S)) > 0.3},
        "query_mask": {"query_mask": rng.random((B, 1, N)) > 0.3},
        "mask": {"mask": rng.random((N, S)) > 0.2},
        "dropout": {"dropout_mask": keep, "dropout_p": 0.3},
        "score_mod": {"score_mod": _score_mod},
        "mask_mod": {"mask_mod": _mask_mod},
    }


def _inputs(rng, n=N, s=S):
    q, k, v = make_qkv(rng, batch=(B, H), n=n, s=s, d=D, norm=3.0)
    return q, k, v


def _check(q, k, v, opts, block_size=None, atol=1e-12):
    out, lse = arrayattn.softmax_attention(q, k, v, block_size=block_size, return_lse=True,
                                           **opts)
    ref_out, ref_lse = oracle(q, k, v, **opts)
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=atol, rtol=0)


OPTION_NAMES = list(_options(np.random.default_rng(0)))


@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("block_size", [None, 3])
def test_each_option_against_the_loop_oracle(name, block_size, rng):
    q, k, v = _inputs(rng)
    _check(q, k, v, _options(rng)[name], block_size)


@pytest.mark.parametrize("pair", list(itertools.combinations(OPTION_NAMES, 2)),
                         ids=lambda p: "+".join(p))
def test_every_pair_of_options_composes(pair, rng):
    q, k, v = _inputs(rng)
    opts = _options(rng)
    combined = {**opts[pair[0]], **opts[pair[1]]}
    if pair == ("causal", "window") or pair == ("causal", "window_left"):
        pass   # causal caps the window's right side at 0 (FlashAttention's rule)
    _check(q, k, v, combined)
    _check(q, k, v, combined, block_size=4)


def test_causal_is_window_none_zero_and_caps_the_right_side(rng):
    q, k, v = _inputs(rng)
    a = arrayattn.softmax_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(a, arrayattn.softmax_attention(q, k, v, window=(None, 0)))
    np.testing.assert_array_equal(
        arrayattn.softmax_attention(q, k, v, window=(2, 5), causal=True),
        arrayattn.softmax_attention(q, k, v, window=(2, 0)))


def test_lse_of_an_empty_or_padded_row_is_minus_inf(rng):
    q, k, v = _inputs(rng)
    qm = np.ones((B, 1, N), bool)
    qm[..., 1] = False
    out, lse = arrayattn.softmax_attention(q, k, v, query_mask=qm, return_lse=True)
    assert np.all(out[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)
    assert np.isfinite(lse[:, :, 0]).all()


# --- packed variable-length sequences -------------------------------------------------

def _packed(rng, lens_q=(3, 0, 5, 2), lens_k=(4, 2, 5, 6)):
    cq = np.concatenate([[0], np.cumsum(lens_q)])
    ck = np.concatenate([[0], np.cumsum(lens_k)])
    q, k, v = make_qkv(rng, batch=(1, H), n=int(cq[-1]), s=int(ck[-1]), d=D, norm=3.0)
    return q, k, v, cq, ck


@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"window": (1, 1)},
                                  {"alibi_slopes": np.array([0.3, 0.7]), "causal": True},
                                  {"softcap": 2.0, "window": (2, 0)}])
@pytest.mark.parametrize("block_size", [None, 4])
def test_varlen_equals_the_segments_one_by_one(opts, block_size, rng):
    q, k, v, cq, ck = _packed(rng)
    out, lse = arrayattn.softmax_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                           block_size=block_size, return_lse=True, **opts)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        one, one_lse = arrayattn.softmax_attention(q[..., qs, :], k[..., ks, :], v[..., ks, :],
                                                   return_lse=True, **opts)
        np.testing.assert_allclose(out[..., qs, :], one, atol=1e-13, rtol=0)
        np.testing.assert_allclose(lse[..., qs], one_lse, atol=1e-13, rtol=0)
    ref, _ = oracle(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **opts)
    np.testing.assert_allclose(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("cq, message", [
    (np.array([1, 3, 10]), "start at 0"),
    (np.array([0, 6, 3, 10]), "never decrease"),
    (np.array([0, 3, 9]), "end at the packed length"),
    (np.array([0.0, 10.0]), "integer dtype"),
    (np.array([10]), "shape"),
])
def test_malformed_cu_seqlens_name_the_argument(cq, message, rng):
    q, k, v, _, ck = _packed(rng, lens_q=(4, 6), lens_k=(4, 6))
    with pytest.raises((ValueError, TypeError), match=f"cu_seqlens_q.*{message}|"
                                                     f"cu_seqlens_q must have an {message}"):
        arrayattn.softmax_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck)


# --- paged KV cache -------------------------------------------------------------------

@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"window": (3, 0), "softcap": 3.0}])
def test_paged_equals_dense_and_ignores_slots_past_the_length(opts, rng):
    num_blocks, page, hkv, hq, n = 7, 3, 2, 4, 2
    k_cache = rng.standard_normal((num_blocks, page, hkv, D))
    v_cache = rng.standard_normal((num_blocks, page, hkv, D))
    table = np.array([[5, 2, 0], [1, 6, 3]])
    lens = np.array([8, 4])
    q = rng.standard_normal((2, hq, n, D))
    out, lse = arrayattn.paged_attention(q, k_cache, v_cache, table, lens, return_lse=True,
                                         **opts)
    for b in range(2):
        k = np.concatenate([k_cache[p] for p in table[b]])[:lens[b]].transpose(1, 0, 2)
        v = np.concatenate([v_cache[p] for p in table[b]])[:lens[b]].transpose(1, 0, 2)
        one, one_lse = arrayattn.softmax_attention(q[b], k, v, return_lse=True, **opts)
        np.testing.assert_allclose(out[b], one, atol=1e-13, rtol=0)
        np.testing.assert_allclose(lse[b], one_lse, atol=1e-13, rtol=0)
    # every slot past a sequence's length holds NaN: nothing changes
    poisoned_k, poisoned_v = k_cache.copy(), v_cache.copy()
    for b in range(2):
        for slot in range(lens[b], table.shape[1] * page):
            poisoned_k[table[b, slot // page], slot % page] = np.nan
            poisoned_v[table[b, slot // page], slot % page] = np.inf
    again = arrayattn.paged_attention(q, poisoned_k, poisoned_v, table, lens, **opts)
    np.testing.assert_array_equal(again, out)


# --- every backend, jit, torch's own kernels --------------------------------------------

@pytest.mark.parametrize("name", ["strict", "strict_device1", "torch", "jax"])
def test_options_on_every_backend(name, rng):
    backend = get_backend(name)
    q, k, v = _inputs(rng)
    opts = {"window": (2, 1), "softcap": 1.5, "alibi_slopes": np.array([0.5, 0.25]),
            "query_mask": rng.random((B, 1, N)) > 0.3, "dropout_mask": rng.random((B, H, N, S)) > .3,
            "dropout_p": 0.3}
    ref, ref_lse = arrayattn.softmax_attention(q, k, v, return_lse=True, **opts)
    conv = {key: backend.asarray(val) if isinstance(val, np.ndarray) else val
            for key, val in opts.items()}
    for bs in (None, 4):
        out, lse = arrayattn.softmax_attention(*(backend.asarray(x) for x in (q, k, v)),
                                               return_lse=True, block_size=bs, **conv)
        np.testing.assert_allclose(backend.to_numpy(out), ref, atol=1e-13, rtol=0)
        np.testing.assert_allclose(backend.to_numpy(lse), ref_lse, atol=1e-13, rtol=0)


def test_score_and_mask_mod_with_torch_and_jax_operations(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(rng)

    def score_mod(score, b, h, q_idx, kv_idx):       # torch operations, as in FlexAttention
        return score + torch.where(q_idx >= kv_idx, 0.5, -0.5) * (h + 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return torch.remainder(q_idx - kv_idx, 2) == 0

    out = arrayattn.softmax_attention(*(torch.tensor(x) for x in (q, k, v)),
                                      score_mod=score_mod, mask_mod=mask_mod)
    ref, _ = oracle(q, k, v, score_mod=lambda s, b, h, i, j: s + (0.5 if i >= j else -0.5) *
                    (h + 1), mask_mod=lambda b, h, i, j: (i - j) % 2 == 0)
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-12, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_against_torch_flex_attention(rng):
    torch = pytest.importorskip("torch")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        pytest.skip("torch has no flex_attention")
    q, k, v = _inputs(rng, n=16, s=16)
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - 0.1 * (q_idx - kv_idx).abs() * (h + 1)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    try:
        block_mask = create_block_mask(causal, B, H, 16, 16, device="cpu")
        ref = flex_attention(tq, tk, tv, score_mod=score_mod, block_mask=block_mask)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        pytest.skip(f"flex_attention does not run on this CPU build: {exc}")
    out = arrayattn.softmax_attention(tq, tk, tv, score_mod=score_mod, mask_mod=causal)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), atol=1e-12, rtol=0)


def test_against_torch_sdpa_with_dropout_free_window_as_mask(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(rng)
    out = arrayattn.softmax_attention(q, k, v, window=(2, 1))
    i, j = np.arange(N)[:, None] + S - N, np.arange(S)[None, :]
    allowed = torch.tensor((j >= i - 2) & (j <= i + 1))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(x) for x in (q, k, v)), attn_mask=allowed)
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-13, rtol=0)


def test_options_under_jax_jit(rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, cq, ck = _packed(rng)
    ref = arrayattn.softmax_attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True,
                                      softcap=2.0, alibi_slopes=np.array([0.3, 0.7]))
    f = jax.jit(lambda *a: arrayattn.softmax_attention(
        a[0], a[1], a[2], cu_seqlens_q=a[3], cu_seqlens_k=a[4], causal=True, softcap=2.0,
        alibi_slopes=a[5]))
    out = f(*map(jax.numpy.asarray, (q, k, v, cq, ck, np.array([0.3, 0.7]))))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-13, rtol=0)


# --- the backward of every option ---------------------------------------------------------

@pytest.mark.parametrize("name", OPTION_NAMES)
@pytest.mark.parametrize("block_size", [None, 4])
def test_vjp_of_each_option_against_torch_autograd(name, block_size, rng):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(rng)
    do = rng.standard_normal((B, H, N, D))
    opts = _options(rng)[name]
    grads = arrayattn.vjp("softmax", q, k, v, do, block_size=block_size, **opts)
    t = {key: torch.tensor(x, requires_grad=True) for key, x in
         (("q", q), ("k", k), ("v", v), ("bias", opts.get("bias"))) if x is not None}
    topts = {key: (t[key] if key == "bias" else torch.tensor(val)
                   if isinstance(val, np.ndarray) else val) for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = arrayattn.softmax_attention(t["q"], t["k"], t["v"], **topts)
    out.backward(torch.tensor(do))
    # score_mod's slope is a central difference (error ~eps^(2/3)); everything else exact
    rtol = 1e-8 if name == "score_mod" else 1e-10
    for key, x in t.items():
        err = np.max(np.abs(grads[key] - x.grad.numpy())) / np.max(np.abs(x.grad.numpy()))
        assert err <= rtol, key


def test_vjp_of_varlen_and_padded_queries(rng):
    q, k, v, cq, ck = _packed(rng)
    do = rng.standard_normal(q.shape)
    grads = arrayattn.vjp("softmax", q, k, v, do, cu_seqlens_q=cq, cu_seqlens_k=ck,
                          causal=True)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        one = arrayattn.vjp("softmax", q[..., qs, :], k[..., ks, :], v[..., ks, :],
                            do[..., qs, :], causal=True)
        np.testing.assert_allclose(grads["q"][..., qs, :], one["q"], atol=1e-13, rtol=0)
        np.testing.assert_allclose(grads["k"][..., ks, :], one["k"], atol=1e-13, rtol=0)
        np.testing.assert_allclose(grads["v"][..., ks, :], one["v"], atol=1e-13, rtol=0)
    qm = rng.random((B, 1, N)) > 0.4
    q2, k2, v2 = _inputs(rng)
    q2[~qm.repeat(H, 1)] = np.nan          # padded query rows hold garbage
    g = arrayattn.vjp("softmax", q2, k2, v2, rng.standard_normal((B, H, N, D)), query_mask=qm)
    assert np.all(g["q"][~qm.repeat(H, 1)] == 0)
    assert all(np.isfinite(x).all() for x in g.values())
