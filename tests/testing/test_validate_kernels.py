"""``arrayattn validate`` on the files a kernel author saves (issue #24 point 10): the
``flash_attn`` and ``flex_attention`` profiles, and the npz keys ``cu_seqlens_q``,
``cu_seqlens_k``, ``block_table``, ``cache_seqlens``, ``dropout_mask`` and ``lse``.

The "kernel" outputs are computed without arrayattn: :func:`flash_oracle` is FlashAttention's
semantics written out in NumPy (its layout ``(b, n, h, d)``, its causal ALiBi ``+slope j``,
``lse = +inf`` on an empty row), and the FlexAttention files come from torch's own
``flex_attention`` on the CPU.  Each correct file must give exit code 0 (MATCH, and LSE MATCH
where it holds ``lse``), the same file with one output entry off by 1e-3 exit code 1.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from arrayattn.cli import main
from arrayattn.testing import compare_lse, compare_to_reference

B, N, H, D = 2, 24, 4, 16


def flash_oracle(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, alibi=None,
                 scale=None, keep=None, p=0.0):
    """FlashAttention's forward on ``(b, n, h, d)`` inputs, in float64: ``(out (b, n, h, dv),
    lse (b, h, n))``.  As its kernel: causal = a right window of 0 and no left window; with
    causal, ALiBi is ``+slope j`` on every row, else ``-slope |i + s - n - j|``."""
    q, k, v = (np.swapaxes(np.asarray(x, np.float64), 1, 2) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    n, s = q.shape[-2], k.shape[-2]
    x = (q.shape[-1] ** -0.5 if scale is None else scale) * q @ np.swapaxes(k, -1, -2)
    if softcap:
        x = softcap * np.tanh(x / softcap)
    i, j = np.arange(n)[:, None] + s - n, np.arange(s)[None, :]
    left, right = window[0], 0 if causal else window[1]
    if alibi is not None:
        slope = np.asarray(alibi, np.float64).reshape(-1, q.shape[1], 1, 1)
        x = x + (slope * j if left < 0 and right == 0 else -slope * np.abs(i - j))
    seen = np.ones((n, s), bool)
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    x = np.where(seen, x, -np.inf)
    m = x.max(-1, keepdims=True, initial=-np.inf)
    e = np.exp(x - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    prob = e / np.where(total > 0, total, 1.0)
    lse = np.where(total[..., 0] > 0, np.log(np.where(total > 0, total, 1.0))[..., 0]
                   + np.where(np.isfinite(m), m, 0.0)[..., 0], np.inf)
    if keep is not None:
        prob = prob * keep / (1.0 - p)
    return np.swapaxes(prob @ v, 1, 2), lse


def varlen_oracle(q, k, v, cu_q, cu_k, **options):
    """``flash_attn_varlen_func``: q ``(total_q, h, d)`` -> out ``(total_q, h, dv)``, lse
    ``(h, total_q)``, one :func:`flash_oracle` call per sequence."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        o, lse = flash_oracle(q[None, cu_q[b]:cu_q[b + 1]], k[None, cu_k[b]:cu_k[b + 1]],
                              v[None, cu_k[b]:cu_k[b + 1]], **options)
        outs.append(o[0])
        lses.append(lse[0])
    return np.concatenate(outs), np.concatenate(lses, axis=-1)


def paged_oracle(q, k_cache, v_cache, table, lens, **options):
    """``flash_attn_with_kvcache``: q ``(b, n, h, d)``, caches ``(blocks, page, h_kv, d)``."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = (c[table[b]].reshape(-1, *c.shape[2:])[:lens[b]] for c in (k_cache, v_cache))
        o, lse = flash_oracle(q[b:b + 1], k[None], v[None], **options)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses)


def f32(**arrays):
    return {key: (a.astype(np.float32) if a.dtype.kind == "f" else a)
            for key, a in arrays.items()}


def run(capsys, path, *argv):
    code = main(["validate", path, *argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def check_file(tmp_path, capsys, arrays, argv, *, lse=True):
    """The file validates to MATCH (exit 0); one output entry off by 1e-3 gives MISMATCH
    (exit 1), and so does one lse entry off by 1e-3."""
    path = str(tmp_path / "kernel.npz")
    np.savez(path, **arrays)
    code, out, err = run(capsys, path, *argv)
    assert code == 0, out + err
    assert "\nMATCH: " in out and ("\nLSE MATCH: " in out) == lse, out
    bad = dict(arrays, out=arrays["out"].copy())
    bad["out"].reshape(-1)[7] += 1e-3
    np.savez(path, **bad)
    code, out, err = run(capsys, path, *argv)
    assert code == 1 and "MISMATCH: " in out, out + err
    if lse:
        bad = dict(arrays, lse=arrays["lse"].copy())
        finite = np.flatnonzero(np.isfinite(bad["lse"]))
        bad["lse"].reshape(-1)[finite[3]] += 1e-3
        np.savez(path, **bad)
        code, out, err = run(capsys, path, *argv)
        assert code == 1 and "LSE MISMATCH: " in out and "\nMATCH: " in out, out + err


@pytest.fixture
def bnhd(rng):
    return tuple(rng.standard_normal((B, N, H, D)) for _ in range(3))


# ---------------------------------------------------------------------------------------
# --profile flash_attn
# ---------------------------------------------------------------------------------------

FLASH_CASES = {
    "defaults": ({}, []),
    "causal_alibi_softcap_scale": (
        dict(causal=True, alibi=2.0 ** -np.arange(1, H + 1), softcap=5.0, scale=0.3),
        ["--option", "causal=true", "--option", "softcap=5.0", "--option",
         "softmax_scale=0.3"]),
    "window_alibi_per_batch": (
        dict(window=(4, 2), alibi=np.linspace(0.1, 0.8, B * H).reshape(B, H)),
        ["--option", "window_size=(4, 2)"]),
    "causal_window_left": (dict(causal=True, window=(6, -1)),
                           ["--option", "causal=true", "--option", "window_size=6,-1"]),
}


@pytest.mark.parametrize("case", sorted(FLASH_CASES))
def test_flash_attn_profile(case, bnhd, tmp_path, capsys):
    options, argv = FLASH_CASES[case]
    out, lse = flash_oracle(*bnhd, **options)
    arrays = f32(q=bnhd[0], k=bnhd[1], v=bnhd[2], out=out, lse=lse)
    if "alibi" in options:
        arrays["alibi_slopes"] = np.asarray(options["alibi"], np.float32)
    check_file(tmp_path, capsys, arrays, ["--profile", "flash_attn", *argv])


def test_flash_attn_grouped_heads(rng, tmp_path, capsys):
    q = rng.standard_normal((B, N, H, D))
    k, v = (rng.standard_normal((B, N, 2, D)) for _ in range(2))
    out, lse = flash_oracle(q, k, v, causal=True)
    check_file(tmp_path, capsys, f32(q=q, k=k, v=v, out=out, lse=lse),
               ["--profile", "flash_attn", "--option", "causal=true"])


def test_flash_attn_dropout_mask(bnhd, rng, tmp_path, capsys):
    keep = rng.random((B, H, N, N)) > 0.2
    out, lse = flash_oracle(*bnhd, causal=True, keep=keep, p=0.2)
    arrays = f32(q=bnhd[0], k=bnhd[1], v=bnhd[2], out=out, lse=lse, dropout_mask=keep)
    check_file(tmp_path, capsys, arrays, ["--profile", "flash_attn", "--option",
                                          "causal=true", "--option", "dropout_p=0.2"])


def test_flash_attn_varlen(rng, tmp_path, capsys):
    cu_q, cu_k = np.array([0, 5, 17, 30], np.int32), np.array([0, 9, 17, 40], np.int32)
    q = rng.standard_normal((30, H, D))
    k, v = (rng.standard_normal((40, H, D)) for _ in range(2))
    slopes = 2.0 ** -np.arange(1, H + 1)
    out, lse = varlen_oracle(q, k, v, cu_q, cu_k, causal=True, alibi=slopes)
    arrays = f32(q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                 alibi_slopes=slopes)
    check_file(tmp_path, capsys, arrays, ["--profile", "flash_attn", "--option", "causal=true",
                                          "--option", "max_seqlen_q=13"])


def test_flash_attn_paged_kv_cache(rng, tmp_path, capsys):
    page, h_kv = 8, 2
    k_cache, v_cache = (rng.standard_normal((7, page, h_kv, D)) for _ in range(2))
    k_cache[6] = np.nan                                  # a page no sequence uses
    table = np.array([[3, 0, 5], [1, 4, 2]], np.int32)
    lens = np.array([19, 11], np.int32)
    q = rng.standard_normal((B, 3, H, D))
    slopes = 2.0 ** -np.arange(1, H + 1)
    out, lse = paged_oracle(q, k_cache, v_cache, table, lens, causal=True, alibi=slopes)
    arrays = f32(q=q, k=k_cache, v=v_cache, out=out, lse=lse, block_table=table,
                 cache_seqlens=lens, alibi_slopes=slopes)
    check_file(tmp_path, capsys, arrays, ["--profile", "flash_attn", "--option", "causal=true"])


# ---------------------------------------------------------------------------------------
# --variant softmax with the new keys (arrayattn's layout and option names)
# ---------------------------------------------------------------------------------------

def bhnd(x):
    return np.swapaxes(x, 1, 2)


def test_variant_softmax_varlen(rng, tmp_path, capsys):
    cu = np.array([0, 7, 7, 25], np.int64)               # an empty sequence too
    q, k, v = (rng.standard_normal((25, H, D)) for _ in range(3))
    out, lse = varlen_oracle(q, k, v, cu, cu, causal=True)
    arrays = f32(q=bhnd(q[None])[0], k=bhnd(k[None])[0], v=bhnd(v[None])[0],
                 out=bhnd(out[None])[0], lse=lse, cu_seqlens_q=cu, cu_seqlens_k=cu)
    check_file(tmp_path, capsys, arrays, ["--variant", "softmax", "--option", "causal=true"])


def test_variant_softmax_paged(rng, tmp_path, capsys):
    page = 4
    k_cache, v_cache = (rng.standard_normal((9, page, H, D)) for _ in range(2))
    table = np.array([[8, 2, 0, 1], [5, 6, 7, 3]], np.int64)
    lens = np.array([16, 6], np.int64)
    q = rng.standard_normal((B, 2, H, D))
    out, lse = paged_oracle(q, k_cache, v_cache, table, lens)
    arrays = f32(q=bhnd(q), k=k_cache, v=v_cache, out=bhnd(out), lse=lse, block_table=table,
                 cache_seqlens=lens)
    check_file(tmp_path, capsys, arrays, ["--variant", "softmax"])


def test_variant_softmax_dropout_mask(bnhd, rng, tmp_path, capsys):
    keep = rng.random((B, H, N, N)) > 0.5
    out, _ = flash_oracle(*bnhd, keep=keep, p=0.5)
    arrays = f32(q=bhnd(bnhd[0]), k=bhnd(bnhd[1]), v=bhnd(bnhd[2]), out=bhnd(out),
                 dropout_mask=keep)
    check_file(tmp_path, capsys, arrays, ["--variant", "softmax", "--option", "dropout_p=0.5"],
               lse=False)


@pytest.mark.parametrize("bad, message", [
    ({"cu_seqlens_q": np.array([0.0, 24.0]), "cu_seqlens_k": np.array([0, 24])},
     "cu_seqlens_q must be an integer array"),
    ({"block_table": np.array([[0], [1]])}, "needs both block_table and cache_seqlens"),
    ({"dropout_mask": np.ones((B, H, N, N))}, "dropout_mask must be a boolean array"),
])
def test_malformed_kernel_arrays_are_usage_errors(bad, message, bnhd, tmp_path, capsys):
    out, _ = flash_oracle(*bnhd)
    path = str(tmp_path / "bad.npz")
    np.savez(path, **f32(q=bnhd[0], k=bnhd[1], v=bnhd[2], out=out), **bad)
    code, _, err = run(capsys, path, "--profile", "flash_attn")
    assert code == 2 and message in err, err


def test_usage_errors_of_the_new_options(bnhd, tmp_path, capsys):
    out, _ = flash_oracle(*bnhd)
    path = str(tmp_path / "plain.npz")
    np.savez(path, **f32(q=bnhd[0], k=bnhd[1], v=bnhd[2], out=out))
    for argv, message in (
            (["--option", "block_table=3"], "block_table is an array"),
            (["--option", "dropout_p=0.1"], "needs dropout_mask"),
            (["--option", "window_size=left"], "window_size must be a pair of integers")):
        code, _, err = run(capsys, path, "--profile", "flash_attn", *argv)
        assert code == 2 and message in err, err
    np.savez(path, **f32(q=bnhd[0], k=bnhd[1], v=bnhd[2], out=out),
             block_table=np.zeros((B, 1), np.int32), cache_seqlens=np.ones(B, np.int32))
    code, _, err = run(capsys, path, "--variant", "linear_elu")
    assert code == 2 and "judged against paged_attention" in err, err


# ---------------------------------------------------------------------------------------
# --profile flex_attention (torch's own flex_attention on the CPU)
# ---------------------------------------------------------------------------------------

@pytest.fixture
def flex():
    torch = pytest.importorskip("torch")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    return torch, fa


def test_flex_attention_profile_file(flex, rng, tmp_path, capsys):
    torch, fa = flex
    q = torch.tensor(rng.standard_normal((B, H, N, D)), dtype=torch.float32)
    k, v = (torch.tensor(rng.standard_normal((B, 2, N, D)), dtype=torch.float32)
            for _ in range(2))
    out, lse = fa.flex_attention(q, k, v, scale=0.2, enable_gqa=True, return_lse=True)
    arrays = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "out": out.numpy(),
              "lse": lse.numpy()}
    check_file(tmp_path, capsys, arrays, ["--profile", "flex_attention", "--option",
                                          "scale=0.2", "--option", "enable_gqa=true"])


def test_flex_attention_hooks_from_python(flex, rng):
    torch, fa = flex

    def tanh_bias(score, b, h, q_idx, kv_idx):               # torch operations
        return score + 0.5 * torch.tanh((q_idx - kv_idx) / 4.0) * (h + 1)

    def sliding(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= 5)

    q, k, v = (torch.tensor(rng.standard_normal((B, H, N, D)), dtype=torch.float32)
               for _ in range(3))
    block_mask = fa.create_block_mask(sliding, None, None, N, N, device="cpu")
    out, lse = fa.flex_attention(q, k, v, score_mod=tanh_bias, block_mask=block_mask,
                                 return_lse=True)
    hooks = {"score_mod": tanh_bias, "block_mask": block_mask}
    c = compare_to_reference(out, None, q, k, v, profile="flex_attention", **hooks)
    assert c.ok, c.table()
    assert compare_lse(lse, None, q, k, v, profile="flex_attention", **hooks).ok
    assert compare_to_reference(out, None, q, k, v, profile="flex_attention",
                                score_mod=tanh_bias, mask_mod=sliding).ok
    assert not compare_to_reference(out, None, q, k, v, profile="flex_attention",
                                    score_mod=tanh_bias).ok          # the mask matters
    bad = out.clone()
    bad[1, 2, 9, 4] += 1e-3
    assert not compare_to_reference(bad, None, q, k, v, profile="flex_attention",
                                    **hooks).ok
    with pytest.raises(ValueError, match="block_mask= or mask_mod="):
        compare_to_reference(out, None, q, k, v, profile="flex_attention", mask_mod=sliding,
                             block_mask=block_mask)
