"""The public strategies (issue #51 point 2): ``@given(cases(convention))`` plus
``assert_case`` is a full conformance test -- torch's SDPA passes it, a broken kernel is
caught (and shrunk by Hypothesis); the module did not exist before."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from arrayattn.testing.strategies import Case, assert_case, cases, judge_case  # noqa: E402

SDPA = torch.nn.functional.scaled_dot_product_attention
UNSUPPORTED = ["softcap", "alibi_slopes", "window_size"]
QUICK = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))


def _top_left_flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False):
    """FlashAttention's signature with SDPA's top-left causal mask (FlashAttention's is
    bottom-right): wrong exactly when causal and n != s."""
    if softcap or alibi_slopes is not None or tuple(window_size) != (-1, -1):
        raise NotImplementedError
    out = SDPA(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal,
               scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    return (out, None, None) if return_attn_probs else out


@QUICK
@given(cases("sdpa"))
def test_torch_sdpa_passes_a_given_test(case):
    verdict = assert_case(SDPA, "sdpa", case)
    assert verdict.ok and verdict.worst < 1


def test_a_broken_kernel_is_caught_and_shrunk():
    def fails(case):
        verdict = judge_case(_top_left_flash, "flash_attn", case)
        return verdict is not None and not verdict.ok

    found = hypothesis.find(
        cases("flash_attn", grads=False, skip=UNSUPPORTED), fails,
        settings=settings(max_examples=300, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck)))
    assert found.opts.get("causal") and found.n != found.s
    assert found.n == 1 and found.b == 1, found.describe()
    with pytest.raises(AssertionError, match="kernel disagrees with the reference on b="):
        assert_case(_top_left_flash, "flash_attn", found)


def test_the_failing_given_test_reports_the_case():
    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases("flash_attn", grads=False, skip=UNSUPPORTED))
    def check(case):
        assert_case(_top_left_flash, "flash_attn", case)

    with pytest.raises(AssertionError, match=r"causal=True.*\n.*out: MISMATCH"):
        check()


def test_unsupported_case_is_rejected_and_options_respected():
    case = Case(options=(("softcap", 2.0),))
    assert judge_case(_top_left_flash, "flash_attn", case) is None
    with pytest.raises(NotImplementedError, match="does not support"):
        assert_case(_top_left_flash, "flash_attn", case)

    @QUICK
    @given(cases("flash_attn", grads=False))      # softcap etc. drawn, rejected
    def rejected(case):
        assert_case(_top_left_flash, "flash_attn", case.with_options(causal=None))

    rejected()

    @QUICK
    @given(cases("sdpa", dtypes=["float16"], grads=False, skip=["attn_mask"]))
    def drawn(case):
        assert case.dtype == "float16" and "attn_mask" not in case.opts
        assert "backward" not in case.opts

    drawn()


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown convention 'nope'"):
        cases("nope")
    with pytest.raises(ValueError, match="dtypes: 'float8'"):
        cases("sdpa", dtypes=["float8"])
    with pytest.raises(ValueError, match="skip: causl not an option"):
        cases("flash_attn", skip=["causl"])
    with pytest.raises(TypeError, match="case must be"):
        judge_case(SDPA, "sdpa", {"n": 3})
    with pytest.raises(TypeError, match="fn must be callable"):
        judge_case(None, "sdpa", Case())
