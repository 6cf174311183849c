"""The conventions of the kernels people ship (issue #51, point 3): xFormers, FlashInfer,
vLLM and the Triton tutorial.  Each passes its clean pure-torch kernel of exactly that
signature and finds each broken one; the xFormers bias stand-ins agree with the
convention's mapping (and with the real classes when xFormers imports).  None of the four
libraries' kernels runs on a CPU: the tests against them need CUDA and are skipped here."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

sys.path.insert(0, os.path.dirname(__file__))
from kernels_shipped import SHIPPED_CLEAN, SHIPPED_ZOO, broken  # noqa: E402

from arrayattn import cli  # noqa: E402
from arrayattn.testing import check_kernel  # noqa: E402
from arrayattn.testing.check.cases import Case  # noqa: E402
from arrayattn.testing.check.conventions import CONVENTIONS, get_convention  # noqa: E402
from arrayattn.testing.check.conventions import vllm, xformers_bias  # noqa: E402
from arrayattn.testing.check.conventions.triton_tutorial import TritonTutorial  # noqa: E402
from arrayattn.testing.check.conventions.xformers import (  # noqa: E402
    XFormers, mirror_bias_factory, real_bias_factory)

#: Each broken kernel must be found within this budget (each takes about 1 s here).
BUDGET = 10
SHIPPED = ("xformers", "flashinfer_single_prefill", "flashinfer_single_decode",
           "flashinfer_batch_prefill", "flashinfer_batch_decode", "vllm_paged_attention",
           "triton_tutorial")


def test_the_shipped_conventions_are_registered_with_a_signature():
    """Fails on the old code: none of these names was a convention."""
    for name in SHIPPED:
        conv = get_convention(name)
        assert name in CONVENTIONS and conv.name == name and conv.signature


@pytest.mark.parametrize("conv", SHIPPED)
def test_clean_kernel_passes(conv):
    res = check_kernel(SHIPPED_CLEAN[conv], conv, budget=2, seed=0)
    assert res.ok, res.summary()
    assert res.cases >= 5
    # the dtype probe's case (not normalized) is valid too: single decode's n = 16 made the
    # half precisions look unsupported before the conventions normalized their own cases
    assert res.dtypes == ("float32", "float16", "bfloat16")


@pytest.mark.parametrize("conv,fn,bug", SHIPPED_ZOO, ids=[f"{c}-{b}" for c, _, b in SHIPPED_ZOO])
def test_broken_kernel_is_found(conv, fn, bug):
    res = check_kernel(broken(fn, bug), conv, budget=BUDGET, seed=0)
    assert not res.ok, res.summary()
    assert res.time_to_finding <= BUDGET
    case = res.failure.case
    assert case.n + case.s <= 140 and case.b <= 2, case.describe()


def test_findings_name_the_option_that_breaks():
    """The shrunk case of a semantic bug keeps the option it is about."""
    res = check_kernel(broken(SHIPPED_CLEAN["xformers"], "bottom_right_as_top_left"),
                       "xformers", budget=BUDGET, seed=0, dtypes=["float32"])
    case = res.failure.case
    assert case.opts["attn_bias"] == "LowerTriangularFromBottomRightMask" and case.n < case.s
    res = check_kernel(broken(SHIPPED_CLEAN["flashinfer_single_prefill"], "lse_natural"),
                       "flashinfer_single_prefill", budget=BUDGET, seed=0, dtypes=["float32"])
    assert res.failure.case.opts.get("return_lse")
    assert [label for label, _ in res.failure.verdict.failing()] == ["lse"]


# -- xFormers' bias objects ---------------------------------------------------------------
@pytest.mark.parametrize("kind", xformers_bias.KINDS)
def test_xformers_mapping_agrees_with_the_bias_objects(kind):
    """The arrayattn options the convention judges with (mask, causal, window, bias) see
    exactly the keys the ``attn_bias`` object's ``materialize`` keeps."""
    from arrayattn import softmax_attention
    conv = XFormers(bias_factory=mirror_bias_factory)
    for n, s in ((3, 7), (5, 5), (7, 3)):
        case = conv.normalize(Case(b=2, hq=2, hkv=2, n=n, s=s, d=4, dv=4, seed=n)
                              .with_options(attn_bias=kind))
        call = conv.build(case)
        t = call.tensors
        bias = conv.bias_factory(kind, bias=t.get("attn_bias"), **t["bias_fields"])
        m, sk = t["q"].shape[1], t["k"].shape[1]
        if isinstance(bias, torch.Tensor):
            dense = bias.double()
        else:
            dense = bias.materialize((t["q"].shape[0], case.hq, m, sk), dtype=torch.float64)
        # the probe: values e_j, so that the output's column j is the weight on key j
        q = np.zeros((t["q"].shape[0], case.hq, m, 1))
        k = np.zeros((t["q"].shape[0], case.hq, sk, 1))
        v = np.broadcast_to(np.eye(sk), (t["q"].shape[0], case.hq, sk, sk))
        weights = softmax_attention(q, k, v, **call.params)
        expect = torch.softmax(dense, -1).nan_to_num(0.0).numpy()
        np.testing.assert_allclose(weights, expect, atol=1e-12)


def test_xformers_grouped_heads_are_five_dimensional():
    seen = {}

    def spy(query, key, value, attn_bias=None, p=0.0, scale=None):
        seen["shapes"] = (tuple(query.shape), tuple(key.shape))
        return SHIPPED_CLEAN["xformers"](query, key, value, attn_bias, p, scale)

    conv = XFormers(bias_factory=mirror_bias_factory)
    case = Case(b=1, hq=6, hkv=2, n=3, s=4, d=8, dv=8)
    call = conv.build(case)
    conv.run(spy, call, case, backward=False)
    assert seen["shapes"] == ((1, 3, 2, 3, 8), (1, 4, 2, 3, 8))


def test_xformers_stand_ins_mirror_the_documented_masks():
    """xFormers' own docstring example: LocalAttentionFromBottomRightMask(1, 2) on 4x5."""
    keep = xformers_bias.LocalAttentionFromBottomRightMask(1, 2).materialize((4, 5))
    assert keep.isfinite().int().tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1],
                                               [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    with pytest.raises(ValueError, match="num_keys >= num_queries"):
        xformers_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens([3], [2])


def _real_attn_bias():
    try:
        from xformers.ops.fmha import attn_bias
    except Exception:
        pytest.skip("xFormers' attn_bias classes do not import here (xformers not installed)")
    return attn_bias


@pytest.mark.parametrize("kind", [k for k in xformers_bias.KINDS if k != "tensor"])
def test_xformers_stand_ins_materialize_as_the_real_classes(kind):
    """Needs xformers (its bias classes import on a CPU; its kernels need CUDA)."""
    real = _real_attn_bias()
    fields = {"bias": torch.randn(1, 2, 5, 7), "window_size": 3, "window_left": 2,
              "window_right": 1, "q_seqlen": [2, 3], "kv_seqlen": [3, 4]}
    shape = (1, 2, 5, 7)
    theirs = xformers_bias.make_bias(kind, namespace=real, **fields).materialize(shape)
    ours = xformers_bias.make_bias(kind, **fields).materialize(shape)
    assert type(theirs) is type(ours) and torch.equal(theirs, ours)


def test_clean_xformers_kernel_passes_with_the_real_bias_classes():
    """Needs xformers: the pure-torch kernel reads the real classes' fields as the
    stand-ins'; a broken one is still found."""
    _real_attn_bias()
    conv = XFormers(bias_factory=real_bias_factory)
    assert check_kernel(SHIPPED_CLEAN["xformers"], conv, budget=2, seed=0).ok
    res = check_kernel(broken(SHIPPED_CLEAN["xformers"], "block_causal_bottom_right"),
                       XFormers(bias_factory=real_bias_factory), budget=BUDGET, seed=0)
    assert not res.ok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="xFormers' kernels need CUDA")
def test_real_xformers_memory_efficient_attention():
    xops = pytest.importorskip("xformers.ops")
    res = check_kernel(xops.memory_efficient_attention, XFormers(real_bias_factory),
                       budget=30, seed=0, device="cuda")
    assert res.ok, res.summary()


# -- vLLM and the Triton tutorial ---------------------------------------------------------
@pytest.mark.parametrize("dtype,x", [("float32", 4), ("float16", 8), ("bfloat16", 8)])
def test_vllm_key_cache_splits_the_head_into_16_byte_vectors(dtype, x):
    conv = get_convention("vllm_paged_attention")
    case = conv.normalize(Case(b=2, hq=4, hkv=2, n=5, s=20, d=64, dv=64, dtype=dtype))
    t = conv.build(case).tensors
    assert case.n == 1
    assert tuple(t["key_cache"].shape[1:]) == (2, 64 // x, 16, x)
    assert tuple(t["value_cache"].shape[1:]) == (2, 64, 16)
    pages = np.random.default_rng(0).standard_normal((3, 16, 2, 64))
    k, v = vllm._pages_of(vllm.key_cache_layout(pages, x), vllm.value_cache_layout(pages))
    assert np.array_equal(k, pages) and np.array_equal(v, pages)


def test_vllm_rows_left_unwritten_are_found():
    """The checker fills ``out`` with NaN before the call."""
    def writes_nothing(out, *args, **kwargs):
        return None
    res = check_kernel(writes_nothing, "vllm_paged_attention", budget=3, seed=0,
                       dtypes=["float32"])
    assert not res.ok and "non-finite" in "\n".join(res.failure.verdict.lines())


def test_triton_tutorial_lengths_and_head_dims():
    conv = TritonTutorial(n_multiple=128)
    case = conv.normalize(Case(n=5, s=5, d=8, dv=8))
    assert (case.n, case.s, case.d, case.dv) == (128, 128, 16, 16)
    assert get_convention("triton_tutorial").normalize(Case(n=5, s=5)).n == 5
    with pytest.raises(ValueError, match="n_multiple"):
        TritonTutorial(n_multiple=0)
    res = check_kernel(SHIPPED_CLEAN["triton_tutorial"], conv, budget=2, seed=0,
                       dtypes=["float32"])
    assert res.ok and res.covered["max_n"] % 128 == 0


def test_cli_runs_a_shipped_convention(tmp_path, monkeypatch, capsys):
    (tmp_path / "shipped_kernels.py").write_text(
        "import functools, sys\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import kernels_shipped as ks\n"
        "good = ks.paged_attention_v1\n"
        "bad = functools.partial(ks.paged_attention_v1, bug='reads_past_seq_len')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    common = ["--convention", "vllm_paged_attention", "--budget", "2", "--dtype", "float32"]
    assert cli.main(["check", "shipped_kernels:good", *common]) == 0
    assert cli.main(["check", "shipped_kernels:bad", *common]) == 1
    assert "paged_attention" in capsys.readouterr().out


@pytest.mark.parametrize("conv,bug", [("vllm_paged_attention", "reads_past_seq_len"),
                                      ("flashinfer_batch_prefill", "last_page_full"),
                                      ("flashinfer_single_prefill", "lse_natural"),
                                      ("xformers", "block_causal_bottom_right"),
                                      ("triton_tutorial", "dk_missing_scale")])
def test_repro_of_a_finding_is_judged_by_validate(conv, bug, tmp_path, capsys):
    """The repro file holds the inputs in arrayattn's layout (paged caches, or the keys
    gathered from the pages) and ``validate --variant softmax`` finds the same mismatch."""
    repro = str(tmp_path / "finding.npz")
    res = check_kernel(broken(SHIPPED_CLEAN[conv], bug), conv, budget=BUDGET, seed=0,
                       dtypes=["float32"], repro=repro)
    assert "--variant softmax" in res.validate
    assert cli.main(res.validate.split()[1:]) == 1
    assert "MISMATCH" in capsys.readouterr().out


# -- the real libraries (CUDA only; skipped on a CPU) --------------------------------------
def _real(module):
    if not torch.cuda.is_available():
        pytest.skip(f"{module}'s kernels need CUDA")
    return pytest.importorskip(module)


def test_real_flashinfer_single_and_batch():
    from arrayattn.testing.check.conventions.flashinfer import (batch_decode_wrapper,
                                                                batch_prefill_wrapper)
    flashinfer = _real("flashinfer")
    half = ["float16", "bfloat16"]
    for fn, conv in ((flashinfer.single_prefill_with_kv_cache, "flashinfer_single_prefill"),
                     (flashinfer.single_decode_with_kv_cache, "flashinfer_single_decode"),
                     (batch_prefill_wrapper(), "flashinfer_batch_prefill"),
                     (batch_decode_wrapper(), "flashinfer_batch_decode")):
        res = check_kernel(fn, conv, budget=20, seed=0, dtypes=half, device="cuda")
        assert res.ok, res.summary()


def test_real_vllm_paged_attention_v1():
    _real("vllm")
    from vllm import _custom_ops as ops
    res = check_kernel(ops.paged_attention_v1, "vllm_paged_attention", budget=20, seed=0,
                       dtypes=["float16", "bfloat16"], device="cuda")
    assert res.ok, res.summary()
