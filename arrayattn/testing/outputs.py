"""The output referee: another implementation's output (and log-sum-exp) against
arrayattn's float64 reference, per head."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .assertions import check_tolerance
from .comparison import Comparison
from .measures import (EPS, TOLERANCE_FACTOR, Nudge, derived_tolerance, dtype_name, error_of,
                       head_errors, host64, own_head_error, round_to, working_dtype)
from .problem import floating_dtype, prepare, to_bhnd
from . import plain, rounding
from .rounding import HALF_JITTER_SCALE, JITTER_SCALE, logit_rounding, sensitivity

__all__ = ["compare_to_reference", "assert_matches_reference", "compare_lse", "RULES", "HALF",
           "choose_rule", "covers", "jitter_scale", "rule_factor"]


def compare_to_reference(out, variant, q, k, v, /, *, rtol=None, atol=0.0, layout=None,
                         profile=None, rule=None, factor: float = 2.0,
                         **params) -> Comparison:
    r"""Compare another implementation's ``out`` with arrayattn's float64 reference.

    The reference is the variant's reference form (:meth:`Variant.reference`, never an
    engine), ``variant(q, k, v, **params)`` evaluated by the registry record in
    float64 on the host, from the caller's own inputs (and the caller's own random
    matrices, passed as array ``params``; floating arrays are converted to float64,
    boolean masks are kept).

    Parameters
    ----------
    out : array, shape ``(..., n, dv)``
        The output under test, any supported array library.  Its dtype sets the
        tolerance.
    variant : str, Variant or None
        Registry name (see :func:`arrayattn.variants`); ``None`` with a ``profile``
        takes the profile's variant.
    q, k, v : array
        The inputs ``out`` was computed from.
    rtol : float, optional
        Override: allowed max-abs error of a head relative to the head's largest
        reference entry.  ``None`` derives the tolerance as below.  A finite number
        >= 0 (an infinite tolerance would pass a NaN output: refused).
    atol : float
        An absolute allowance added to each head's tolerance (default 0; finite, >= 0).
    layout : {"bhnd", "bnhd"}, optional
        Axis order of ``q``, ``k``, ``v`` and ``out``: ``"bhnd"`` (``(..., heads,
        tokens, dim)``, the default without a profile) or ``"bnhd"`` (``(batch, tokens,
        heads, dim)``, fla, flash-attn, fast-transformers; a ``key_mask`` is then
        ``(batch, s)``).  ``None``: the profile's layout, else ``"bhnd"``.  Heads are
        reported as ``(batch, head)`` in either layout.
    profile : str or Profile, optional
        A port's conventions (:data:`PROFILES`: ``"sdpa"``, ``"flash_attn"``,
        ``"flex_attention"``, ``"performer_pytorch"``, ``"lucidrains_nystrom"``,
        ``"hf_nystromformer"``, ``"fast_transformers"``, ``"fla"``).  ``**params`` are then the *port's* options (``is_causal=``,
        ``projection_matrix=``, ``res_conv_weight=`` ...), mapped onto the variant's:
        top-left causal masks, the port's scale, front padding, pinv init, conv skip.
        Deviations a profile cannot reproduce yet are listed in ``Comparison.notes``.
    **params
        Options of the variant (``causal=True``, ``num_features=64``, ``omega=...``), or
        of the port with a ``profile``.  With ``block_table`` and ``cache_seqlens`` the
        problem is a paged KV cache, judged against :func:`arrayattn.paged_attention`:
        ``k`` and ``v`` are then the caches ``(num_blocks, page, h_kv, d)`` (never
        transposed by ``layout``).

    Returns
    -------
    Comparison
        Per-head errors, tolerances and worst positions; ``.ok``, ``.verdict()``,
        ``.table()``; ``.rel`` (this output against float64) beside ``.own_rel`` (the
        float32 -- or float64 -- rounding baseline: what a faithful implementation
        achieves on these inputs), stated in the verdict by ``.precision()``.

    Notes
    -----
    **Tolerance.**  A head is the trailing ``(n, dv)`` block of ``out``; all leading
    dimensions index heads.  For head ``h`` with reference ``R_h`` the allowed
    max-abs error is

    .. math::

       \tau_h = F \cdot \max\bigl(e_h,\; \epsilon_{out} \|R_h\|_\infty\bigr),
       \qquad F = 8,

    where

    * :math:`e_h` is the max-abs error of *arrayattn's own* evaluation of the same
      variant in the working precision (float64 for a float64 output, float32
      otherwise: float16 and bfloat16 are computed in float32, as every arrayattn
      variant and every fused kernel does), on the inputs with a random relative
      perturbation of one unit roundoff of that precision.  It measures the rounding
      error that this variant incurs on *these* inputs: large logits, long sequences
      or an ill-conditioned pseudo-inverse all show up in it.  This is the criterion
      of FlashAttention's own test suite (error at most a small multiple of a plain
      implementation's error in the same precision);
    * the floor :math:`\epsilon_{out}\|R_h\|_\infty` (machine epsilon of the output dtype
      times the head's largest entry) is the rounding of the result itself: it is what
      counts for float16 and bfloat16 outputs, whose arithmetic is float32;
    * :math:`F = 8` allows a correct implementation to sum in another order (blocked
      or online softmax, fused kernels, another BLAS), whose rounding error is of
      the same order but not the same value (measured: torch's
      ``scaled_dot_product_attention``, blockwise softmax and a plain float32 port stay
      within 1.4 e_h at n = 256 ... 2048, d = 64, diffuse and sharp attention).

    For random-feature and random-pattern variants pass the matrix the other
    implementation used (e.g. ``omega=``, ``e=``, ``f=``): the reference then uses the
    same matrix, the comparison is deterministic and the same rounding-level tolerance
    applies.  Without it the reference draws its own from ``seed`` and only matches an
    implementation that drew the identical matrix.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import softmax_attention
    >>> from arrayattn.testing import compare_to_reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 3, 16, 8), dtype=np.float32) for _ in range(3))
    >>> out = softmax_attention(q, k, v, causal=True, block_size=4)  # "their" kernel
    >>> c = compare_to_reference(out, "softmax", q, k, v, causal=True)
    >>> c.ok, len(c.heads), c.heads[4]
    (True, 6, (1, 1))
    >>> bad = out.copy(); bad[1, 2] += 1e-3
    >>> compare_to_reference(bad, "softmax", q, k, v, causal=True).verdict()[:60]
    'MISMATCH: softmax, 1 of 6 head(s) over tolerance (float32 ou'
    """
    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    factor = check_tolerance("factor", factor, optional=False)
    dtype = floating_dtype(out, "out")
    strict = True     # an output less accurate than FlashAttention's 2x fails (its class)
    rule, half = choose_rule(rule, dtype, (q, k, v))
    problem = prepare(variant, q, k, v, layout=layout, profile=profile, params=params)
    theirs = to_bhnd({"out": host64(out)}, problem.layout, ("out",))["out"]
    ref = _reference_output(problem, theirs)
    errors = head_errors(error_of(theirs, ref, dtype), ref)
    own, notes = _baseline(problem, ref, dtype, len(errors.heads), rule=rule, half=half,
                           covered=covers(errors, dtype, rtol, atol, rule_factor(rule, factor)))
    notes += _upcast_note(dtype, (q, k, v))
    tol = derived_tolerance(errors, own, dtype, rtol=rtol, atol=atol,
                            factor=rule_factor(rule, factor))
    return Comparison.of(problem.name, dtype, errors, tol, own, problem.notes + notes,
                         problem.profile, rule, *_lenient(problem, ref, errors, tol, dtype,
                                                          rule, strict, rtol, atol))


def _lenient(problem, ref, errors, tol, dtype: str, rule: str, strict: bool, rtol, atol,
             *, lse: bool = False) -> tuple:
    """``(lenient, strict)`` of a :class:`Comparison`: under the ``same-dtype`` rule, for
    heads over ``tol``, the tolerance of the ``float64`` rule (``None`` where every head is
    within ``tol``, or under the ``float64`` rule)."""
    over = ~(np.isfinite(errors.max_abs) & (errors.max_abs <= tol))
    if rule != "same-dtype" or rtol is not None or not over.any():
        return None, strict
    own, _ = _baseline(problem, ref, dtype, len(errors.heads), lse=lse, rule="float64")
    return derived_tolerance(errors, own, dtype, rtol=None, atol=atol), strict


def _reference_output(problem, theirs: np.ndarray) -> np.ndarray:
    """The float64 reference, of the output's shape (ValueError naming both otherwise)."""
    ref = problem.evaluate()
    if theirs.shape != ref.shape:
        raise ValueError(f"out has shape {theirs.shape} but {problem.name} gives {ref.shape} "
                         f"for {problem.shapes()}")
    if theirs.ndim < 2:
        raise ValueError(f"out must have at least 2 dimensions (..., n, dv); got {theirs.shape}")
    return ref


#: The tolerance rules: ``"float64"`` (a float32 or float64 result: a multiple of what a
#: plain evaluation in its working precision errs by) and ``"same-dtype"``
#: (FlashAttention's rule for half precision: at most ``factor`` times the error of the
#: computation done plainly in the inputs' dtype).
RULES = ("float64", "same-dtype")
HALF = ("float16", "bfloat16")


def choose_rule(rule, dtype: str, inputs) -> tuple[str, str | None]:
    """``(rule, half dtype or None)``: ``same-dtype`` by default when the result or an input
    is float16/bfloat16 (the lse of a half-precision kernel is float32: its problem is still
    a half-precision one)."""
    halves = sorted(({dtype} | {dtype_name(x) for x in inputs if hasattr(x, "dtype")})
                    & set(HALF))
    if rule is None:
        rule = "same-dtype" if halves else "float64"
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}; got {rule!r}")
    if rule == "same-dtype" and not halves:
        halves = [dtype if dtype in EPS else "float32"]
    return rule, (halves[0] if rule == "same-dtype" else None)


def covers(errors, dtype: str, rtol, atol, factor: float):
    """``covered(baseline)``: whether every head is within the tolerance that ``baseline``
    (per head) gives -- then a larger baseline changes no verdict."""
    def covered(baseline) -> bool:
        tol = derived_tolerance(errors, baseline, dtype, rtol=rtol, atol=atol, factor=factor)
        return bool(np.all(np.isfinite(errors.max_abs) & (errors.max_abs <= tol)))
    return covered


def jitter_scale(rule: str) -> float:
    """The rounding a rule's baseline stands for, in units of the precision's roundoff."""
    return HALF_JITTER_SCALE if rule == "same-dtype" else JITTER_SCALE


def rule_factor(rule: str, factor: float) -> float:
    """The multiple of the baseline: :data:`TOLERANCE_FACTOR` (8) for ``float64``,
    ``factor`` (FlashAttention's 2) for ``same-dtype``."""
    return factor if rule == "same-dtype" else TOLERANCE_FACTOR


def _baseline(problem, ref: np.ndarray, dtype: str, count: int, *, lse: bool = False,
              rule: str = "float64", half: str | None = None, covered=None):
    """``(baseline error per head, notes)``: the worst of the plain evaluations of the
    convention's forms (:mod:`arrayattn.testing.plain`) in the result's precision.

    ``same-dtype`` rule: the half ensemble alone (FlashAttention's rule: a multiple of what
    a plain evaluation in the half dtype errs by, nothing added).  ``float64`` rule: the
    working-precision ensemble, and where that does not already cover every head
    (``covered(baseline)``) the reference's response to rounding
    (:func:`~.rounding.sensitivity`), kept where it is larger: it costs
    :data:`~.rounding.JITTER_DRAWS` float64 evaluations and can only raise the
    tolerance."""
    same = rule == "same-dtype"
    per_head = None if covered is None else (
        lambda worst: covered(own_head_error(ref + worst, ref, count)[0]))
    own, finite = plain.output_baseline(problem, ref, dtype=dtype,
                                        half=half if same else None, lse=lse,
                                        covered=per_head)
    err, _ = own_head_error(ref + own, ref, count)
    if not same and (covered is None or rounding.MEASURE_ALWAYS or not covered(err)):
        work = working_dtype(dtype)
        eps = EPS[work]
        rms = plain.logit_rounding_rms(problem, eps, lse=lse)
        if rms is not None and np.shape(rms) == np.shape(ref):
            err = np.maximum(err, own_head_error(ref + rms, ref, count)[0])
        jitter = sensitivity(lambda j: _convention(problem, j, eps).evaluate(
            "float64", j, lse=lse, options_too=True), ref, eps, scale=jitter_scale(rule))
        response, _ = own_head_error(ref + jitter, ref, count)
        err = np.maximum(err, response)
    work = half if same else working_dtype(dtype)
    return err, ([] if finite or lse else [
        f"a plain {work} evaluation is not finite on these inputs; the tolerance rests on "
        "the finite ones and the reference's response to rounding"])


def _convention(problem, jitter, eps: float):
    """The problem as the jittered evaluation sees it: exact attention's logits rounded at
    their own size (:func:`~.rounding.logit_rounding`), with the per-row shift of a
    convention that forms larger ones (FlashAttention's causal ALiBi, ``+slope j``:
    :attr:`Problem.lse_shift`)."""
    if problem.name not in ("softmax", "paged_attention"):
        return problem
    return replace(problem, options=logit_rounding(problem.options, problem.q, problem.k,
                                                   jitter, problem.lse_shift))


def _upcast_note(dtype: str, inputs) -> list:
    low = sorted({dtype_name(x) for x in inputs} & {"float32", "float16", "bfloat16"})
    if dtype != "float64" or not low:
        return []
    return [f"out is float64 but the inputs are {'/'.join(low)}: the tolerance is a float64 "
            "computation's; if the kernel computed in float32 and cast its result up, pass "
            "out in the dtype it computed in"]


def assert_matches_reference(out, variant, q, k, v, /, *, rtol=None, atol=0.0, layout=None,
                             profile=None, **params) -> None:
    """Assert that ``out`` equals arrayattn's float64 reference to rounding, per head.

    Runs :func:`compare_to_reference` (see there for the tolerance derivation) and
    raises ``AssertionError`` naming the worst heads, their largest errors and the
    positions (query, output feature) where they occur.

    Parameters
    ----------
    out : array, shape ``(..., n, dv)``
        The output under test.
    variant : str, Variant or None
        Registry name of the reference (``None`` with a ``profile``: the profile's).
    q, k, v : array
        The inputs ``out`` was computed from.
    rtol : float, optional
        Override of the derived tolerance (max-abs error relative to the head's largest
        reference entry); finite, >= 0.
    atol : float
        Absolute allowance added to each head's tolerance (default 0); finite, >= 0.
    layout : {"bhnd", "bnhd"}, optional
        Axis order of ``q``, ``k``, ``v``, ``out`` (see :func:`compare_to_reference`).
    profile : str, optional
        A port's conventions (see :data:`PROFILES`); ``**params`` are then the port's
        own options.
    **params
        Options of the variant, including the random matrices the other implementation
        used (``omega=``, ``e=``, ``f=`` ...).

    Raises
    ------
    AssertionError
        When a head's max-abs error exceeds its tolerance, or the output holds a NaN or
        inf where the reference is finite (whatever the tolerance).
    ValueError, TypeError
        A negative, infinite or NaN ``rtol`` / ``atol`` (or one that is not a number).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.testing import assert_matches_reference
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal((4, 32, 16)) for _ in range(3))
    >>> w = np.exp(q @ k.swapaxes(-1, -2) / 4.0)
    >>> mine = (w / w.sum(-1, keepdims=True)) @ v         # a plain float64 port
    >>> assert_matches_reference(mine, "softmax", q, k, v)  # passes silently
    >>> mine[2, 7, 3] += 1e-6
    >>> assert_matches_reference(mine, "softmax", q, k, v)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: MISMATCH: softmax, 1 of 4 head(s) over tolerance (float64 output); worst (by error / tolerance) head (2,): max abs error 1e-06 at query 7, output feature 3 ...
    """
    c = compare_to_reference(out, variant, q, k, v, rtol=rtol, atol=atol, layout=layout,
                             profile=profile, **params)
    if not c.ok:
        raise AssertionError(c.report())


def compare_lse(lse, variant, q, k, v, /, *, rtol=None, atol=0.0, layout=None, profile=None,
                rule=None, factor: float = 2.0, **params) -> Comparison:
    """Compare a kernel's log-sum-exp ``lse (..., heads, n)`` (FlashAttention's
    ``softmax_lse``, in either layout of q, k, v) with the reference's
    (``return_lse=True``), one head per row.  A row with no visible key agrees when both
    are infinite (arrayattn stores ``-inf``, FlashAttention ``+inf``).  Tolerance
    ``8 max(e, eps |L|_inf)`` with ``e`` arrayattn's own float32 (or float64) error.
    ``profile`` and ``**params`` as in :func:`compare_to_reference` (the ``flash_attn``
    profile shifts the reference where the kernel's lse differs by a constant per row).

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> from arrayattn.testing import compare_lse
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    >>> _, lse = arrayattn.softmax_attention(q, k, v, causal=True, return_lse=True)
    >>> compare_lse(lse, "softmax", q, k, v, causal=True).ok
    True
    """
    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    factor = check_tolerance("factor", factor, optional=False)
    dtype = floating_dtype(lse, "lse")
    strict = True     # an output less accurate than FlashAttention's 2x fails (its class)
    rule, half = choose_rule(rule, dtype, (q, k, v))
    problem = prepare(variant, q, k, v, layout=layout, profile=profile, params=params)
    ref, theirs = problem.evaluate(lse=True), host64(lse)
    if theirs.shape != ref.shape:
        raise ValueError(f"lse has shape {theirs.shape} but the reference's is {ref.shape}")
    errors = head_errors(_lse_error(theirs, ref), ref, event=1)
    own, _ = _baseline(problem, ref, dtype, len(errors.heads), lse=True, rule=rule, half=half,
                       covered=covers(errors, dtype, rtol, atol, rule_factor(rule, factor)))
    tol = derived_tolerance(errors, own, dtype, rtol=rtol, atol=atol,
                            factor=rule_factor(rule, factor))
    return Comparison.of(f"{problem.name} lse", dtype, errors, tol, own, problem.notes,
                         problem.profile, rule, *_lenient(problem, ref, errors, tol, dtype,
                                                          rule, strict, rtol, atol, lse=True))


def _lse_error(theirs: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """``|theirs - ref|``, 0 where both are infinite (a row with no key), infinite where
    only one is."""
    empty = np.isinf(ref)
    with np.errstate(invalid="ignore"):
        err = np.abs(np.where(np.isinf(theirs), np.inf, theirs) - np.where(empty, 0.0, ref))
    return np.where(empty, np.where(np.isinf(theirs), 0.0, np.inf), err)
