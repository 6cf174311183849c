"""The checker's reach (issue #49): value classes that break sentinels, poison in the slots a
kernel must skip, varlen segments drawn independently, large sizes within ``max_size``, the
sampled judge, and the zoo of size- and value-gated bugs (zoo_sizes.py) found and shrunk to
the size that gates them."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import replace

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")

sys.path.insert(0, os.path.dirname(__file__))
import zoo_sizes  # noqa: E402
from zoo import CLEAN, broken  # noqa: E402
from zoo_sizes import SIZED  # noqa: E402

from arrayattn import cli  # noqa: E402
from arrayattn.testing import check_kernel  # noqa: E402
from arrayattn.testing.check import sampling  # noqa: E402
from arrayattn.testing.check.cases import (Case, large_catalogue, reach_catalogue,  # noqa: E402
                                           smaller)
from arrayattn.testing.check.conventions import get_convention  # noqa: E402
from arrayattn.testing.check.conventions.base import SENTINELS, draw_qkv  # noqa: E402
from arrayattn.testing.check.judge import judge_inputs  # noqa: E402
from arrayattn.testing.check.search import Search  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention.*")


def _logits(case):
    x = draw_qkv(case, np.random.default_rng(case.seed))
    return np.einsum("bhid,bhjd->bhij", x["q"], x["k"]) * case.d ** -0.5


# -- values ---------------------------------------------------------------------------
def test_value_classes_build_the_rows_sentinels_break_on():
    """Before: q, k Gaussian of magnitude <= 30, no row far below zero, no exact tie."""
    below = _logits(Case(n=40, s=30, values="far_below"))
    assert (below < -50).all() and below.min() < -5e4
    assert (_logits(Case(n=40, s=30, values="far_above")) > 50).all()
    sent = _logits(Case(n=200, s=5, values="sentinel"))
    near = np.abs(sent[..., None] - np.asarray(SENTINELS)).min(-1)
    assert (near < 10).all() and (sent.max(-1) - sent.min(-1) > 0).any()
    ties = _logits(Case(n=4, s=30, values="ties"))
    assert len(np.unique(ties[0, 0, 0])) <= 2
    dom = _logits(Case(n=8, s=30, values="dominant"))
    top = np.sort(dom, -1)
    assert (top[..., -1] - top[..., -2] > 15).all()
    over = draw_qkv(Case(values="overflow", dtype="float16"), np.random.default_rng(0))
    raw = np.einsum("bhid,bhjd->bhij", over["q"], over["k"])
    assert (np.abs(raw) > 65504).all()


def test_a_running_max_from_a_finite_sentinel_is_found():
    res = check_kernel(zoo_sizes.broken(zoo_sizes.flash_attn_func, "sentinel_max"),
                       "flash_attn", budget=10, seed=0, dtypes=["float32"], max_size=0)
    assert not res.ok
    assert res.failure.case.values in ("far_below", "sentinel"), res.summary()


@pytest.mark.parametrize("conv", ["flash_attn", "flash_attn_varlen", "flash_attn_kvcache",
                                  "sdpa", "torch_sdpa"])
def test_clean_kernels_pass_every_value_class_and_poison(conv):
    """The reach catalogue (value classes in float32/float16/bfloat16, forward and
    backward; poison) gives no finding on the clean kernels and torch's SDPA."""
    import torch
    fn = torch.nn.functional.scaled_dot_product_attention if conv == "torch_sdpa" \
        else CLEAN[conv]
    convention = get_convention("sdpa" if conv == "torch_sdpa" else conv)
    search = Search(fn, convention)
    for case in reach_catalogue(convention, ("float32", "float16", "bfloat16"), True):
        out = search.evaluate(case)
        assert out.verdict is not None and out.verdict.ok, (case.describe(),
                                                            out.verdict.lines())


# -- poison ---------------------------------------------------------------------------
def test_poison_fills_exactly_the_slots_a_kernel_must_skip():
    conv = get_convention("flash_attn_kvcache")
    case = Case(b=2, n=4, s=64, poison="nan").with_options(window_size=(3, 0))
    call = conv.build(case)
    k = call.tensors["k"].numpy()
    ref = judge_inputs(call)["k"]
    assert np.isnan(k).any() and np.isfinite(ref).all()
    table = call.params["block_table"]
    lengths = call.params["cache_seqlens"]
    unused = np.setdiff1d(np.arange(k.shape[0]), table.ravel())
    assert np.isnan(k[unused]).all()
    for b in range(case.b):
        flat = k[table[b]].reshape(-1, *k.shape[2:])
        first = lengths[b] - case.n - 3
        visible = np.arange(flat.shape[0])
        read = (visible >= first // 16 * 16) & (visible < lengths[b])
        assert np.isfinite(flat[read]).all()      # every page the window reads is clean
        assert np.isnan(flat[lengths[b]:]).all()  # past cache_seqlens: poison
    assert set(conv.poison_regions(case)) == {"unused_pages", "past_cache_seqlens",
                                              "pages_a_window_skips"}


def test_a_kernel_reading_window_pages_is_named():
    res = check_kernel(zoo_sizes.broken(zoo_sizes.flash_attn_with_kvcache,
                                        "reads_window_pages"), "flash_attn_kvcache",
                       budget=10, seed=0, dtypes=["float32"], max_size=0)
    assert not res.ok
    text = res.failure.case.describe()
    assert "poison nan in the slots it must skip (pages a window skips)" in text, text


# -- varlen ---------------------------------------------------------------------------
@pytest.mark.parametrize("seg", ["no_queries", "no_keys", "very_uneven", "many"])
def test_varlen_segments_drawn_independently(seg):
    conv = get_convention("flash_attn_varlen")
    case = conv.normalize(Case(n=9, s=11).with_options(segments=seg, backward=True))
    lq, lk = conv._lengths(case, np.random.default_rng(0))
    if seg == "no_queries":
        assert lq[-1] == 0 and lk[-1] > 0
    if seg == "no_keys":
        assert lk[-1] == 0 and lq[-1] > 0
    if seg == "many":
        assert case.b >= 8
    out = Search(CLEAN["flash_attn_varlen"], conv).evaluate(case)
    assert out.verdict.ok, out.verdict.lines()


# -- sizes and shrinking ----------------------------------------------------------------
def test_smaller_keeps_a_head_dim_and_halves_lengths_by_powers():
    conv = get_convention("flash_attn")
    case = Case(n=1, s=16384, d=128, dv=128)
    cands = smaller(case, conv)
    dims = [c.d for c in cands if replace(c, d=128, dv=128) == case]
    assert dims[:2] == [8, 96]                  # 8 first (as before), then descending
    lengths = [c.s for c in cands if replace(c, s=16384) == case]
    # halved, then less by every power of two (largest first), then one less
    assert lengths[:3] == [8192, 16384 - 4096, 16384 - 2048] and lengths[-1] == 16383


def test_large_catalogue_within_max_size_and_summary_names_the_largest():
    conv = get_convention("flash_attn")
    cases = large_catalogue(conv, ("float32",), True, max_size=2 ** 20)
    assert cases and all(c.elements() <= 2 ** 20 for c in cases)
    assert {128, 256}.issubset({c.d for c in cases})
    assert max(c.s for c in cases) >= 1025
    assert any(c.b * c.hq >= 64 for c in cases)
    res = check_kernel(CLEAN["flash_attn"], "flash_attn", budget=8, seed=0,
                       dtypes=["float32"], grads=False, max_size=2 ** 20)
    assert res.ok, res.summary()
    assert "largest case: " in res.summary()
    with pytest.raises(ValueError, match="max_size"):
        check_kernel(CLEAN["flash_attn"], "flash_attn", budget=1, max_size=-1)


# -- the sampled judge ------------------------------------------------------------------
@pytest.mark.parametrize("conv,opts", [
    ("flash_attn", dict(window_size=(3, 0), alibi_slopes="h", softcap=1.0)),
    ("flash_attn", dict(causal=True)), ("sdpa", dict(is_causal=True)),
    ("jax_dot_product_attention", dict(is_causal=True, mask="bool"))])
@pytest.mark.parametrize("n,s", [(70, 150), (150, 70)])
def test_row_sub_problem_is_exactly_the_full_problems_rows(conv, opts, n, s):
    from arrayattn.exact.softmax import softmax_attention
    convention = get_convention(conv)
    case = convention.normalize(Case(b=2, hq=4, hkv=2, n=n, s=s).with_options(**opts))
    call = convention.build(case)
    prob = sampling.sliceable_problem(call, judge_inputs(call))
    rows = sampling.sample_rows(case.n, case.s, seed=1)
    assert {0, 63, 64, 65, case.n - 1} <= set(rows.tolist())
    q, k, v, sub = sampling.row_problem(prob, rows)
    full, lf = softmax_attention(prob.q, prob.k, prob.v, return_lse=True, **prob.options)
    part, lp = softmax_attention(q, k, v, return_lse=True, **sub)
    np.testing.assert_allclose(part, full[..., rows, :], rtol=0, atol=1e-13)
    np.testing.assert_allclose(lp, lf[..., rows], rtol=0, atol=1e-12)


def test_sampled_judge_finds_a_tile_bug_and_its_repro_is_validated(tmp_path, monkeypatch,
                                                                   capsys):
    """Past SAMPLE_ABOVE logits the verdict is on sampled rows; the repro judges them."""
    monkeypatch.setattr(sampling, "SAMPLE_ABOVE", 2 ** 14)
    conv = get_convention("flash_attn")
    case = Case(b=1, hq=2, hkv=2, n=300, s=200).with_options(return_attn_probs=True,
                                                              window_size=(50, 3))
    clean = Search(CLEAN["flash_attn"], conv).evaluate(case)
    assert clean.verdict.ok and clean.verdict.items[0][0].endswith(" rows)")
    bad = broken(CLEAN["flash_attn"], "tile_drops_last_key")
    found = Search(bad, conv).evaluate(case)
    assert not found.verdict.ok
    from arrayattn.testing.check.repro import write_repro
    path = str(tmp_path / "rows.npz")
    command = write_repro(path, conv, bad, case)
    assert command.endswith("--variant softmax")
    assert os.path.exists(path + ".rows.txt")
    assert cli.main(command.split()[1:]) == 1
    assert "MISMATCH" in capsys.readouterr().out


# -- the zoo of size- and value-gated bugs ------------------------------------------------
#: The smallest budget (s) that finds each with seed 0 on a loaded 2-core machine, with
#: margin (measured times in docs/check.rst, "Reach").
BUDGETS = {"d128_scale": 20, "split_kv_merge": 15, "mem_efficient": 30,
           "causal_tile_skip": 30, "program_ids": 15, "sentinel_max": 10,
           "varlen_offset_wraps": 45, "varlen_bwd_no_queries": 20,
           "reads_window_pages": 10}


@pytest.mark.parametrize("conv,fn,bug,shrunk", SIZED, ids=[z[2] for z in SIZED])
def test_size_gated_bug_is_found_and_shrunk_to_its_gate(conv, fn, bug, shrunk):
    res = check_kernel(zoo_sizes.broken(fn, bug), conv, budget=BUDGETS[bug], seed=0,
                       dtypes=["float32"])
    assert not res.ok, res.summary()
    assert shrunk(res.failure.case), res.failure.case.describe()


def test_shrinking_a_large_case_keeps_every_new_dimension_minimal():
    """A value class, a poison region and a big head dim shrink independently."""
    conv = get_convention("flash_attn_kvcache")
    case = Case(n=4, s=64, d=128, dv=128, values="ties", poison="nan").with_options(
        window_size=(3, 0))
    cands = smaller(case, conv)
    assert replace(case, values="normal") in cands and replace(case, poison="") in cands
    assert replace(case, poison="nan:pages_a_window_skips") in cands


@pytest.mark.parametrize("conv,seed", [("flash_attn", 0), ("flash_attn", 1),
                                       ("flash_attn_kvcache", 0), ("flash_attn_varlen", 1),
                                       ("torch_sdpa", 0)])
def test_clean_kernels_are_not_flagged_at_the_new_sizes(conv, seed):
    """Large catalogue cases and large random draws (within max_size 2**20), every value
    class and poison: no finding on the clean kernels or torch's SDPA."""
    import torch
    fn = torch.nn.functional.scaled_dot_product_attention if conv == "torch_sdpa" \
        else CLEAN[conv]
    res = check_kernel(fn, "sdpa" if conv == "torch_sdpa" else conv, budget=15, seed=seed,
                       max_size=2 ** 20)
    assert res.ok, res.summary()
    assert res.covered["largest"][0] > 2 ** 16, res.summary()


def test_cli_max_size(capsys):
    """--max-size bounds the cases (0: small only); a negative one is a usage error."""
    kernel = "torch.nn.functional:scaled_dot_product_attention"
    assert cli.main(["check", kernel, "--convention", "sdpa", "--max-size", "-1"]) == 2
    assert "--max-size" in capsys.readouterr().err
    assert cli.main(["check", kernel, "--convention", "sdpa", "--budget", "1", "--dtype",
                     "float32", "--no-grads", "--max-size", "0", "--repro",
                     os.devnull]) == 0
    out = capsys.readouterr().out
    import re
    assert "OK: nothing found" in out
    assert int(re.search(r"s up to (\d+)", out).group(1)) <= 160     # small cases only


def test_varlen_padding_is_poisoned_and_a_kernel_reading_it_is_found():
    """k, v rows past cu_seqlens_k[-1] hold NaN for the kernel (forward cases); before,
    the packed buffers had no padding at all."""
    def reads_padding(q, k, v, cq, ck, *args, **kw):
        out = CLEAN["flash_attn_varlen"](q, k, v, cq, ck, *args, **kw)
        touched = k.float().sum() * 0           # a reduction over the whole buffer
        return (out[0] + touched,) + tuple(out[1:]) if isinstance(out, tuple) \
            else out + touched
    res = check_kernel(reads_padding, "flash_attn_varlen", budget=10, seed=0,
                       dtypes=["float32"], grads=False, max_size=0)
    assert not res.ok
    assert "(padding past cu seqlens)" in res.failure.case.describe(), res.summary()
    conv = get_convention("flash_attn_varlen")
    case = conv.normalize(Case(b=3, n=9, s=11, poison="nan").with_options(backward=True))
    assert not case.poison                      # dk, dv of the padding are not judged


def test_a_fitted_draw_stays_a_case_the_convention_draws():
    """Fitting a large draw halves s first where n = s; under a JAX window that gave n > s
    (rows with no key, where JAX returns the mean of v: a false finding on
    jax.nn.dot_product_attention at n = 104, s = 52).  The fitted case is normalized
    again."""
    from arrayattn.testing.check.cases import fit, fitted
    conv = get_convention("jax_dot_product_attention")
    case = conv.normalize(Case(hq=8, hkv=8, n=4096, s=4096, d=128, dv=128).with_options(
        local_window_size=(5, 5)))
    assert fit(case, 2 ** 22, float("inf")).n > fit(case, 2 ** 22, float("inf")).s
    small = fitted(conv, case, 2 ** 22)
    assert small.n <= small.s and small.b * small.hq * small.n * small.s <= 2 ** 22
