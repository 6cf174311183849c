"""The sampled judge's gradients (issue #49): dq on sampled query rows, dk and dv on sampled
key columns through the column sub-problem with its sink key, each exact in float64."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import arrayattn
from arrayattn.testing.check import sampled_grads, sampling
from arrayattn.testing.check.cases import Case
from arrayattn.testing.check.conventions import get_convention
from arrayattn.testing.check.judge import judge_inputs
from arrayattn.testing.problem import to_bhnd

torch = pytest.importorskip("torch")
warnings.filterwarnings("ignore", message=".*flex_attention.*")


def _problem(conv, opts, n, s, **kw):
    convention = get_convention(conv)
    case = convention.normalize(Case(b=2, hq=4, hkv=2, n=n, s=s, **kw).with_options(
        backward=True, **opts))
    call = convention.build(case)
    x = judge_inputs(call)
    prob = sampling.sliceable_problem(call, x)
    do = to_bhnd({"do": np.asarray(x["do"], dtype=np.float64)}, call.layout, ("do",))["do"]
    return prob, do


@pytest.mark.parametrize("conv,opts", [
    ("flash_attn", dict(window_size=(30, 5), alibi_slopes="h", softcap=1.0)),
    ("flash_attn", dict(causal=True)), ("sdpa", dict(is_causal=True)),
    ("jax_dot_product_attention", dict(is_causal=True, mask="bool"))])
@pytest.mark.parametrize("n,s", [(70, 150), (150, 70)])
def test_column_sub_problem_has_exactly_the_full_problems_key_gradients(conv, opts, n, s):
    """dk, dv of the sampled keys through the sink equal the full problem's (to 1e-13): the
    sink carries each row's rest log-sum-exp and D_i.  Without the sink's value dimension
    (c = 0) dk is off by P_ij D^rest_i q_i, ~1e-1."""
    prob, do = _problem(conv, opts, n, s)
    full = arrayattn.vjp("softmax", prob.q, prob.k, prob.v, do, **prob.options)
    cols = sampled_grads.sample_columns(n, s, window=sampling.window_of(prob.options),
                                        seed=1)
    assert {0, 63, 64, 65, s - 1} <= set(cols.tolist()) and len(cols) < s
    q, k, v, do1, sub = sampled_grads.column_problem(prob, do, cols)
    part = arrayattn.vjp("softmax", q, k, v, do1, **sub)
    m, dv = len(cols), do.shape[-1]
    np.testing.assert_allclose(part["k"][..., :m, :], full["k"][..., cols, :], atol=1e-13)
    np.testing.assert_allclose(part["v"][..., :m, :dv], full["v"][..., cols, :], atol=1e-13)
    do1[..., -1] = 0.0
    wrong = arrayattn.vjp("softmax", q, k, v, do1, **sub)["k"][..., :m, :]
    assert np.abs(wrong - full["k"][..., cols, :]).max() > 1e-3


def test_a_row_with_no_key_outside_the_columns_gets_no_sink():
    """Causal, n = s: row 0 sees key 0 only; with key 0 sampled its rest is empty (lse
    -inf): the sink is masked there and the row's gradients stay exact."""
    prob, do = _problem("sdpa", dict(is_causal=True), 40, 40)
    cols = np.arange(0, 40, 3)
    q, k, v, do1, sub = sampled_grads.column_problem(prob, do, cols)
    assert not sub["mask"][..., 0, -1].any() and sub["mask"][..., 5, -1].all()
    full = arrayattn.vjp("softmax", prob.q, prob.k, prob.v, do, **prob.options)
    part = arrayattn.vjp("softmax", q, k, v, do1, **sub)
    np.testing.assert_allclose(part["k"][..., :len(cols), :], full["k"][..., cols, :],
                               atol=1e-13)


class _Scale(torch.autograd.Function):
    """Identity forward; the backward scales the gradient of the rows from ``start`` (a
    bug in the tiles past the first: dq rows or dk columns)."""

    @staticmethod
    def forward(ctx, x, start, factor):
        ctx.start, ctx.factor = start, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[..., ctx.start:, :] *= ctx.factor
        return g, None, None


def _sdpa_with(bug):
    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
        if bug == "dq":
            q = _Scale.apply(q, 64, 1.01)
        elif bug == "dk":
            k = _Scale.apply(k, 64, 1.01)
        elif bug == "dv":
            v = _Scale.apply(v, 128, 1.01)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    return kernel


@pytest.mark.parametrize("bug", [None, "dq", "dk", "dv"])
def test_sampled_backward_judge_names_rows_and_columns(monkeypatch, bug):
    """Past SAMPLE_ABOVE logits a backward case is judged on sampled rows (out, dq) and key
    columns (dk, dv); a 1 % error in the gradients of the second tile on is caught in the
    gradient it touches only (before: the case was judged whole)."""
    from arrayattn.testing.check.search import Search

    monkeypatch.setattr(sampling, "SAMPLE_ABOVE", 2 ** 14)
    conv = get_convention("sdpa")
    case = Case(b=1, hq=2, hkv=2, n=300, s=260, d=32, dv=32).with_options(
        backward=True, is_causal=True)
    verdict = Search(_sdpa_with(bug), conv).evaluate(case).verdict
    labels = [label for label, _ in verdict.items]
    assert labels[1].startswith("dq (") and labels[1].endswith(" of 300 rows)"), labels
    assert labels[2].endswith(" of 260 key columns)") and labels[3].startswith("dv ("), labels
    failing = [label.split()[0] for label, _ in verdict.failing()]
    assert failing == ([] if bug is None else [bug]), verdict.lines()


def test_a_sampled_findings_position_is_the_full_problems():
    """The worst position of a sampled comparison names the full problem's query / key
    (the bug starts at key 64: the worst key is one of the sampled ones past it)."""
    from arrayattn.testing.check.search import Search

    conv = get_convention("sdpa")
    case = Case(b=1, hq=2, hkv=2, n=300, s=260, d=32, dv=32).with_options(backward=True)
    old = sampling.SAMPLE_ABOVE
    try:
        sampling.SAMPLE_ABOVE = 2 ** 14
        verdict = Search(_sdpa_with("dk"), conv).evaluate(case).verdict
    finally:
        sampling.SAMPLE_ABOVE = old
    (label, c), = verdict.failing()
    cols = sampled_grads.sample_columns(300, 260, seed=case.seed)
    key = c.worst[c.failing[0]][0]
    assert key >= 64 and key in set(cols.tolist()), (key, c.head_line(c.failing[0]))


def test_a_sampled_backward_findings_repro_files_are_validated(tmp_path, monkeypatch,
                                                               capsys):
    """The repro of a sampled backward case: the rows' file (out, dq on the rows) and the
    key columns' file (dk, dv through the sink, no out); validate judges each as the check
    did: the dk bug fails the columns' file only."""
    from arrayattn import cli
    from arrayattn.testing.check.repro import write_repro

    monkeypatch.setattr(sampling, "SAMPLE_ABOVE", 2 ** 14)
    conv = get_convention("sdpa")
    case = Case(b=1, hq=2, hkv=2, n=300, s=260, d=32, dv=32).with_options(
        backward=True, is_causal=True)
    path = str(tmp_path / "f.npz")
    command = write_repro(path, conv, _sdpa_with("dk"), case)
    rows_cmd, cols_cmd = command.split("; ")
    assert cols_cmd.startswith("arrayattn validate ") and ".cols.npz" in cols_cmd
    assert len(np.loadtxt(path + ".cols.txt")) == np.load(path + ".cols.npz")["dk"].shape[-2]
    assert cli.main(rows_cmd.split()[1:]) == 0
    assert "GRADIENTS MATCH" in capsys.readouterr().out
    assert cli.main(cols_cmd.split()[1:]) == 1
    assert "GRADIENTS MISMATCH: softmax: dk" in capsys.readouterr().out
    write_repro(path, conv, _sdpa_with(None), case)
    assert cli.main([*cols_cmd.split()[1:]]) == 0
