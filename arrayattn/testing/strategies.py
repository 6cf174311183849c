"""Hypothesis strategies of the kernel checker's cases, and the judge of one case, for
kernel authors who write their own ``@given`` tests::

    from hypothesis import given, settings
    from arrayattn.testing.strategies import cases, assert_case

    @settings(max_examples=50, deadline=None)
    @given(cases("flash_attn", dtypes=["float32", "bfloat16"]))
    def test_flash_fwd(case):
        assert_case(mypkg.flash_fwd, "flash_attn", case)

:func:`cases` draws what ``arrayattn check`` draws at random (sizes, grouped heads, the
convention's options, dtypes, the magnitude of q and k, the seed of the inputs; small
first, so that Hypothesis shrinks toward few tokens, heads and options);
:func:`judge_case` runs the kernel on one case and judges its outputs, lse, final state and
gradients with the checker's referee; :func:`assert_case` asserts it.  Hypothesis is the
``check`` extra (``pip install "arrayattn[check]"``), imported when a strategy is built.
"""
from __future__ import annotations

__all__ = ["cases", "judge_case", "assert_case", "Case", "Verdict"]

from .check.cases import Case
from .check.judge import Verdict


def _hypothesis():
    try:
        import hypothesis
    except ImportError:
        raise ImportError('arrayattn.testing.strategies needs Hypothesis: pip install '
                          '"arrayattn[check]"') from None
    return hypothesis


def cases(convention, *, dtypes=None, grads: bool = True, skip=(), device: str = "cpu"):
    """The Hypothesis strategy of the cases of ``convention``.

    Parameters
    ----------
    convention : str or adapter
        A name of :data:`arrayattn.testing.check.CONVENTIONS` or a custom adapter object.
    dtypes : sequence of str, optional
        The dtypes drawn (default ``["float32"]``).
    grads : bool
        Also draw ``backward=True`` (the gradients judged) where the convention has it.
    skip : sequence of str
        Options never drawn (their first value, off, always).

    Returns
    -------
    SearchStrategy of Case

    Examples
    --------
    >>> from arrayattn.testing.strategies import cases
    >>> case = cases("sdpa", grads=False).example()   # doctest: +SKIP
    >>> case.describe()                                # doctest: +SKIP
    'b=1 h=2 n=5 s=31 d=16 dv=16 float32, is_causal=True, magnitude 1, seed 17'
    """
    _hypothesis()
    from .check import get_convention
    from .check.cases import case_strategy

    conv = get_convention(convention, device)
    dtypes = ("float32",) if dtypes is None else tuple(dtypes)
    if not dtypes:
        raise ValueError("dtypes must name at least one dtype")
    for dt in dtypes:
        if dt not in ("float64", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtypes: {dt!r} is not one of float64, float32, float16, "
                             "bfloat16")
    unknown = sorted(set(skip) - set(conv.space))
    if unknown:
        raise ValueError(f"skip: {', '.join(unknown)} not an option of {conv.name or 'the '}"
                         f" convention (its options: {', '.join(conv.space)})")
    return case_strategy(conv, dtypes, bool(grads), tuple(skip))


def judge_case(fn, convention, case: Case, *, device: str = "cpu") -> Verdict | None:
    """Run ``fn`` on ``case`` under ``convention`` and judge every output, lse, final state
    and (with ``backward``) gradient against arrayattn's float64 reference.

    Returns
    -------
    Verdict or None
        ``.ok``, ``.worst`` (error / tolerance), ``.lines()`` (the failing comparisons) or
        ``.error`` (what the kernel raised); None when the kernel raised
        ``NotImplementedError`` (the case is unsupported).

    Examples
    --------
    >>> import torch
    >>> from arrayattn.testing.strategies import Case, judge_case
    >>> sdpa = torch.nn.functional.scaled_dot_product_attention
    >>> judge_case(sdpa, "sdpa", Case(n=5, s=7, options=(("is_causal", True),))).ok
    True
    """
    from .check import get_convention
    from .check.search import Search

    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__}")
    if not isinstance(case, Case):
        raise TypeError(f"case must be an arrayattn.testing.strategies.Case; got "
                        f"{type(case).__name__}")
    conv = get_convention(convention, device)
    return Search(fn, conv).evaluate(conv.normalize(case)).verdict


def assert_case(fn, convention, case: Case, *, device: str = "cpu") -> Verdict:
    """:func:`judge_case`, raising ``AssertionError`` with the case and the failing
    comparisons on a discrepancy; an unsupported case (the kernel raised
    ``NotImplementedError``) is rejected inside a ``@given`` test, as
    ``hypothesis.assume(False)`` would, and raises ``NotImplementedError`` outside one.  The
    verdict otherwise."""
    verdict = judge_case(fn, convention, case, device=device)
    if verdict is None:
        from hypothesis.control import currently_in_test_context
        if currently_in_test_context():
            _hypothesis().reject()
        raise NotImplementedError(f"the kernel does not support {case.describe()}")
    if not verdict.ok:
        raise AssertionError("\n".join([f"kernel disagrees with the reference on "
                                        f"{case.describe()}"] +
                                       ["  " + line for line in verdict.lines()]))
    return verdict
