"""The gradient referee: compare_grads / assert_grads_match, compare_lse, and
``arrayattn validate`` on files with ``do``, gradients and ``lse``."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.cli import main
from arrayattn.testing.outputs import compare_lse
from arrayattn.testing.grads import round_to
from arrayattn.testing import assert_grads_match, compare_grads

from conftest import make_qkv


def _problem(rng, dtype=np.float32, batch=(2, 3), n=24, d=16):
    q, k, v = make_qkv(rng, batch=batch, n=n, s=n, d=d, norm=6.0, sharp=True)
    do = rng.standard_normal((*batch, n, d))
    return [x.astype(dtype) for x in (q, k, v, do)]


def test_a_faithful_float32_backward_matches_and_a_wrong_one_does_not(rng):
    q, k, v, do = _problem(rng)
    mine = arrayattn.vjp("softmax", q, k, v, do, causal=True, block_size=8)
    assert_grads_match(mine, "softmax", q, k, v, do, causal=True)
    bad = dict(mine, k=mine["k"].copy())
    bad["k"][1, 2, 5, 3] += 1e-3 * np.abs(mine["k"]).max()
    c = compare_grads(bad, "softmax", q, k, v, do, causal=True)
    assert not c.ok and c.items["q"].ok and c.items["v"].ok
    assert c.items["k"].failing == [5] and c.items["k"].worst[5] == (5, 3)
    with pytest.raises(AssertionError, match="GRADIENTS MISMATCH: softmax: dk"):
        assert_grads_match(bad, "softmax", q, k, v, do, causal=True)


def test_a_gradient_that_ignores_the_mask_is_caught(rng):
    q, k, v, do = _problem(rng)
    wrong = arrayattn.vjp("softmax", q, k, v, do)               # not causal
    assert not compare_grads(wrong, "softmax", q, k, v, do, causal=True).ok


def test_bias_gradients_and_bnhd_layout_against_torch(rng):
    torch = pytest.importorskip("torch")
    q, k, v, do = _problem(rng, batch=(2, 3))
    bias = rng.standard_normal((2, 3, 24, 24)).astype(np.float32)
    t = [torch.tensor(x).requires_grad_() for x in (q, k, v, bias)]
    out = torch.nn.functional.scaled_dot_product_attention(t[0], t[1], t[2], attn_mask=t[3])
    out.backward(torch.tensor(do))
    grads = {name: x.grad for name, x in zip(("q", "k", "v", "bias"), t)}
    assert compare_grads(grads, "softmax", q, k, v, do, bias=bias).ok
    # the same in FlashAttention's (b, n, h, d) layout
    sw = lambda x: np.swapaxes(x, 1, 2)  # noqa: E731
    g2 = {name: sw(grads[name].numpy()) for name in "qkv"}
    assert compare_grads(g2, "softmax", sw(q), sw(k), sw(v), sw(do), layout="bnhd").ok is False
    assert compare_grads(g2, "softmax", sw(q), sw(k), sw(v), sw(do), layout="bnhd",
                         bias=bias).ok


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_kernels_by_flash_attentions_rule(dtype, rng):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype)
    q, k, v, do = _problem(rng, batch=(1, 2), n=64, d=32)
    t = [torch.tensor(x, dtype=tdt).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)
    out.backward(torch.tensor(do, dtype=tdt))
    grads = {name: x.grad for name, x in zip("qkv", t)}
    args = [x.detach() for x in t] + [torch.tensor(do, dtype=tdt)]
    c = compare_grads(grads, "softmax", *args, causal=True)
    assert c.rule == "same-dtype" and c.ok, c.verdict()
    # ten times the half-precision reference's own error is not a match
    noisy = {name: g + 10 * float(c.items[name].tolerance.max()) * torch.sign(g)
             for name, g in grads.items()}
    assert not compare_grads(noisy, "softmax", *args, causal=True).ok


def test_round_to_matches_the_libraries():
    x = np.random.default_rng(0).standard_normal(1000) * 100
    np.testing.assert_array_equal(round_to(x, "float16"), x.astype(np.float16))
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(round_to(x, "bfloat16"),
                                  torch.tensor(x).to(torch.bfloat16).double().numpy())


def test_bad_calls_are_refused(rng):
    q, k, v, do = _problem(rng)
    g = arrayattn.vjp("softmax", q, k, v, do)
    with pytest.raises(ValueError, match="grads is empty"):
        compare_grads({}, "softmax", q, k, v, do)
    with pytest.raises(ValueError, match="not arguments of this call"):
        compare_grads({"omega": g["q"]}, "softmax", q, k, v, do)
    with pytest.raises(ValueError, match="rtol"):
        compare_grads(g, "softmax", q, k, v, do, rtol=float("inf"))
    with pytest.raises(ValueError, match="shape"):
        compare_grads({"q": g["q"][:, :1]}, "softmax", q, k, v, do)


def test_lse_agrees_on_empty_rows_whatever_the_sign_of_infinity(rng):
    q, k, v, _ = _problem(rng, dtype=np.float64)
    mask = np.ones((24, 24), bool)
    mask[3] = False
    _, lse = arrayattn.softmax_attention(q, k, v, mask=mask, return_lse=True)
    flash_style = np.where(np.isinf(lse), np.inf, lse)     # FlashAttention stores +inf
    assert compare_lse(flash_style, "softmax", q, k, v, mask=mask).ok
    finite_there = np.where(np.isinf(lse), 0.0, lse)
    assert not compare_lse(finite_there, "softmax", q, k, v, mask=mask).ok
    assert not compare_lse(lse + 1e-6, "softmax", q, k, v, mask=mask).ok


def _save(path, **arrays):
    np.savez(path, **arrays)
    return str(path)


def test_cli_judges_gradients_and_lse(tmp_path, rng, capsys):
    q, k, v, do = _problem(rng)
    out, lse = arrayattn.softmax_attention(q, k, v, causal=True, return_lse=True)
    g = arrayattn.vjp("softmax", q, k, v, do, causal=True)
    good = _save(tmp_path / "good.npz", q=q, k=k, v=v, out=out, do=do, dq=g["q"], dk=g["k"],
                 dv=g["v"], lse=lse)
    assert main(["validate", good, "--variant", "softmax", "--option", "causal=true"]) == 0
    text = capsys.readouterr().out
    assert "GRADIENTS MATCH: softmax (dq, dk, dv" in text and "LSE MATCH" in text
    bad_dv = g["v"].copy()
    bad_dv[0, 0, 0, 0] += 1.0
    bad = _save(tmp_path / "bad.npz", q=q, k=k, v=v, out=out, do=do, dv=bad_dv)
    assert main(["validate", bad, "--variant", "softmax", "--option", "causal=true"]) == 1
    assert "GRADIENTS MISMATCH: softmax: dv" in capsys.readouterr().out
    no_do = _save(tmp_path / "no_do.npz", q=q, k=k, v=v, out=out, dq=g["q"])
    assert main(["validate", no_do, "--variant", "softmax"]) == 2
    assert "no 'do'" in capsys.readouterr().err


def test_cli_half_precision_file_uses_the_same_dtype_rule(tmp_path, rng, capsys):
    torch = pytest.importorskip("torch")
    q, k, v, do = _problem(rng, batch=(1, 2), n=32, d=16)
    t = [torch.tensor(x, dtype=torch.float16).requires_grad_() for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*t)
    out.backward(torch.tensor(do, dtype=torch.float16))
    f = _save(tmp_path / "half.npz", **{n: x.detach().numpy() for n, x in zip("qkv", t)},
              out=out.detach().numpy(), do=do.astype(np.float16),
              **{"d" + n: x.grad.numpy() for n, x in zip("qkv", t)})
    assert main(["validate", f, "--variant", "softmax"]) == 0
    assert "rule same-dtype" in capsys.readouterr().out
