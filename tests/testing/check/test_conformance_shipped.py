"""The conformance suite of issue #48: the plain forms the conventions' authors ship --
FlashAttention's ``attention_ref`` (dense and varlen, ``upcast`` both ways,
``reorder_ops``; causal ALiBi with windows, n != s), Hugging Face's eager and sdpa
attention functions, torch SDPA's math and CPU flash backends, ``flex_attention`` eager,
``jax.nn.dot_product_attention`` and fla's naive recurrent and chunk references -- run
through ``check_kernel`` in float32, float16 and bfloat16, gradients included, are never
flagged.  Each is the formula its authors ship, rounded as they round it; before the
ensemble of plain evaluations (``arrayattn.testing.plain``) the referee flagged
``attention_ref``'s causal ALiBi in float32, fla's chunk gate gradients and Hugging Face's
half-precision attention."""
from __future__ import annotations

import os
import sys
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")

sys.path.insert(0, os.path.dirname(__file__))
import shipped  # noqa: E402

from arrayattn.testing import check_kernel  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention.*")

#: Seconds of search per kernel and seed (the catalogue, then random draws): CI's share.
BUDGET = 3
SEEDS = (0, 1)


def _kernels():
    ref = shipped.attention_ref
    yield "flash_attn", "attention_ref", lambda: ref
    yield "flash_attn", "attention_ref_half", lambda: shipped.with_options(ref, upcast=False)
    yield "flash_attn", "attention_ref_half_reorder", lambda: shipped.with_options(
        ref, upcast=False, reorder_ops=True)
    yield "flash_attn_varlen", "attention_ref_varlen", lambda: shipped.attention_ref_varlen
    yield "flash_attn_varlen", "attention_ref_varlen_half", lambda: shipped.with_options(
        shipped.attention_ref_varlen, upcast=False)
    yield "sdpa", "sdpa_math", lambda: shipped.sdpa_backend("math")
    yield "sdpa", "sdpa_cpu_flash", lambda: shipped.sdpa_backend("flash")
    yield "sdpa", "hf_eager", lambda: _needs("transformers", lambda: shipped.hf_attention(
        "eager"))
    yield "sdpa", "hf_sdpa", lambda: _needs("transformers", lambda: shipped.hf_attention(
        "sdpa"))
    yield "fla_simple_gla", "fla_naive_chunk_simple_gla", lambda: _needs(
        "fla", lambda: shipped.fla_simple_gla_refs()["chunk16"])
    yield "fla_simple_gla", "fla_naive_recurrent_simple_gla", lambda: _needs(
        "fla", lambda: shipped.fla_simple_gla_refs()["recurrent"])
    yield "fla_gla", "fla_naive_recurrent_gla", lambda: _needs(
        "fla", shipped.fla_gla_recurrent)
    yield "flex_attention", "flex_attention_eager", lambda: pytest.importorskip(
        "torch.nn.attention.flex_attention").flex_attention
    yield "jax_dot_product_attention", "jax_dot_product_attention", lambda: (
        pytest.importorskip("jax").nn.dot_product_attention)


def _needs(module, make):
    pytest.importorskip(module, reason=f"{module} is not installed (pip install .[ports])")
    return make()


KERNELS = list(_kernels())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("conv,name,make", KERNELS, ids=[k[1] for k in KERNELS])
def test_shipped_forms_are_never_flagged(conv, name, make, seed):
    kernel = make()
    dtypes = ("float32", "float16") if conv.startswith("jax") else None
    # Hugging Face's eager attention forms matmul(q, k^T) in the half dtype before the
    # scale: past 65504 it is inf, as the overflow class is built to show (a real
    # limit of that form, not a rounding: tests/testing/check/test_reach.py finds it)
    skip = ("overflow",) if name == "hf_eager" else ()
    res = check_kernel(kernel, conv, budget=BUDGET, seed=seed, dtypes=dtypes, explain=False,
                       skip=skip)
    assert res.ok, res.summary()


@pytest.mark.parametrize("seed", SEEDS)
def test_attention_ref_causal_alibi_window_float32(seed):
    """Class 1 of the issue: ``attention_ref`` forms causal ALiBi as ``slope (j - s + 1)``,
    large for early keys; with a window and n < s its float32 error was 1.3x the old
    tolerance.  The ``logits as formed`` member covers it."""
    from arrayattn.testing.check.cases import Case
    from arrayattn.testing.check.conventions import get_convention
    from arrayattn.testing.check.search import Search

    conv = get_convention("flash_attn")
    for n, s in ((33, 129), (104, 72), (65, 160)):
        case = conv.normalize(Case(b=1, hq=2, hkv=2, n=n, s=s, d=32, dv=32, seed=seed)
                              .with_options(alibi_slopes="h", causal=True,
                                            window_size=(2, 5)))
        out = Search(shipped.attention_ref, conv).evaluate(case)
        assert out.verdict.ok, out.verdict.lines()
