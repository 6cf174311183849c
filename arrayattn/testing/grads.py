r"""The gradient referee: another implementation's gradients against :func:`arrayattn.vjp`
in float64, per head and per argument."""
from __future__ import annotations

import numpy as np

from ..core.xp import to_numpy
from .assertions import check_tolerance
from .comparison import Comparison
from .measures import (EPS, Nudge, cast_floating, derived_tolerance, dtype_name, error_of,
                       head_errors, host64, is_array, own_head_error, round_to)
from .outputs import HALF, RULES, choose_rule, covers, jitter_scale, rule_factor
from .problem import prepare, to_bhnd
from . import plain, rounding
from .rounding import (JITTER_DRAWS, JITTER_SCALE, key_group, logit_rounding, logit_scale,
                       sensitivity)

__all__ = ["compare_grads", "assert_grads_match", "round_to", "GradComparison", "RULES",
           "reference_vjp", "host_problem"]

class GradComparison:
    """Per-argument :class:`~arrayattn.testing.Comparison` of gradients (``.items``, a dict
    name -> Comparison), with ``.ok``, ``.verdict()`` and ``.table()``."""

    def __init__(self, variant: str, items: dict, rule: str):
        self.variant, self.items, self.rule = variant, items, rule

    @property
    def ok(self) -> bool:
        """Whether every head of every gradient is within its tolerance."""
        return all(c.ok for c in self.items.values())

    def verdict(self) -> str:
        """One line: GRADIENTS MATCH or MISMATCH, with the worst head of the first failing
        gradient."""
        bad = [name for name, c in self.items.items() if not c.ok]
        names = ", ".join(f"d{name}" for name in self.items)
        if not bad:
            less = [f"d{name}" for name, c in self.items.items() if c.less_accurate]
            note = (f"; {', '.join(less)} LESS ACCURATE than 2x a plain half evaluation, "
                    "correct to the float64 rule" if less else "")
            return f"GRADIENTS MATCH: {self.variant} ({names}; rule {self.rule}{note})"
        worst = self.items[bad[0]]
        return (f"GRADIENTS MISMATCH: {self.variant}: {', '.join('d' + b for b in bad)} over "
                f"tolerance (rule {self.rule}); d{bad[0]} worst "
                f"{worst.head_line(worst.failing[0])}")

    def table(self) -> str:
        """One per-head table per gradient."""
        return "\n".join(f"d{name}:\n{c.table()}" for name, c in self.items.items())

    def __repr__(self) -> str:
        return f"<GradComparison {self.verdict()}>"


def compare_grads(grads: dict, variant, q, k, v, do, /, *, rtol=None, atol=0.0, layout=None,
                  profile=None, rule=None, factor: float = 2.0, select=None,
                  **params) -> GradComparison:
    """Compare ``grads`` (``{"q": dq, "k": dk, "v": dv, <argument>: d<argument>}``, any
    array library) with arrayattn's float64 :func:`~arrayattn.vjp` of ``variant`` at
    ``(q, k, v, do, **params)``.

    Parameters
    ----------
    grads : dict
        The gradients under test, keyed like :func:`arrayattn.vjp`'s result; any subset.
    variant : str, Variant or None
        Registry name (``None`` with a ``profile``: the profile's).
    q, k, v, do : array
        The forward's inputs and the output cotangent the gradients were computed with.
    rtol : float, optional
        Override: allowed max-abs error of a head relative to its largest reference entry
        (finite, >= 0).
    atol : float
        Absolute allowance added to each head's tolerance (default 0; finite, >= 0).
    layout : {"bhnd", "bnhd"}, optional
        Axis order of q, k, v, do and their gradients (default: the profile's, else
        ``"bhnd"``).
    profile : str or Profile, optional
        A port's conventions, as in :func:`~arrayattn.testing.compare_to_reference`:
        ``**params`` are then the port's own options (``is_causal=``, ``enable_gqa=``,
        ``window_size=`` ...).  Key/value heads the profile repeats (SDPA's
        ``enable_gqa``) have their reference gradients summed over each group, as the
        kernel's autograd does.
    rule : {"float64", "same-dtype"}, optional
        The tolerance rule (Notes); default by the gradients' dtype.
    factor : float
        The multiple of the ``same-dtype`` rule (FlashAttention's tests use 2).
    select : dict, optional
        ``{name: index}``: judge only ``d<name>[index]`` (an index tuple into the reference
        gradient, layout ``"bhnd"``); ``grads[name]`` then holds just those entries.  The
        sampled judge's key columns (:mod:`arrayattn.testing.check.sampled_grads`).
    **params
        The forward's options (arrays as host data or any library).

    Returns
    -------
    GradComparison

    Notes
    -----
    Two rules set the tolerance of each head of each gradient:

    * ``"float64"`` (the default for float32 and float64 gradients): as for outputs
      (:func:`arrayattn.testing.compare_to_reference`), ``8 max(e, eps |R|_inf)`` with ``e``
      the larger of arrayattn's own gradient error in the working precision and the float64
      gradients' response to that precision's rounding of every input, ``do`` included
      (:mod:`arrayattn.testing.rounding`): it grows with the logits, the reduction lengths
      and the size of ``do``;
    * ``"same-dtype"`` (the default for float16 / bfloat16 gradients or inputs):
      FlashAttention's rule -- the kernel's error against the float64 reference may be at
      most ``factor`` (2) times the error of the computation done plainly in the inputs'
      dtype: the larger of the gradients from inputs rounded to the dtype, computed in
      float32 and rounded once, and the float64 gradients' response to the dtype's rounding
      of every input and intermediate.

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> from arrayattn.testing import compare_grads
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, do = (rng.standard_normal((2, 16, 8), dtype=np.float32) for _ in range(4))
    >>> mine = arrayattn.vjp("softmax", q, k, v, do, causal=True)   # "their" kernel
    >>> compare_grads(mine, "softmax", q, k, v, do, causal=True).ok
    True
    >>> mine["k"][1, 3, 2] += 1e-3
    >>> compare_grads(mine, "softmax", q, k, v, do, causal=True).verdict()[:35]
    'GRADIENTS MISMATCH: softmax: dk ove'
    """
    rtol, atol = check_tolerance("rtol", rtol), check_tolerance("atol", atol, optional=False)
    factor = check_tolerance("factor", factor, optional=False)
    if not grads:
        raise ValueError("grads is empty: give at least one of dq, dk, dv, ...")
    # a gradient less accurate than 2x a plain half evaluation passes, reported, unless
    # the same-dtype rule is asked for (the anchors' own gradient rules are 2x to 10x)
    strict = rule == "same-dtype"
    dtypes, rule, half = _dtypes_and_rule(grads, rule, (q, k, v, do))
    rec, args, options, theirs, how = host_problem(grads, variant, q, k, v, do, params,
                                                    layout, profile)
    full = reference_vjp(rec, args, options, "float64", how=how)
    select = select or {}

    def view(name: str, a: np.ndarray) -> np.ndarray:
        return a[select[name]] if name in select else a

    ref = {name: view(name, g) for name, g in full.items()}
    _check_shapes(rec.name, theirs, ref)
    errors = {name: head_errors(error_of(g, ref[name], dtype_name(grads[name])), ref[name])
              for name, g in theirs.items()}

    def own_error(name: str, own: dict) -> np.ndarray:
        return own_head_error(ref[name] + view(name, own[name]), ref[name],
                              len(errors[name].heads))[0]

    def covered(own: dict) -> bool:
        return all(covers(errors[name], dtype_name(grads[name]), rtol, atol, rule_factor(
            rule, factor))(own_error(name, own)) for name in theirs)

    own = _baseline(rec, args, options, dtypes, rule, half, full, how, covered)
    items, lenient = {}, None
    for name, g in theirs.items():
        dt = dtype_name(grads[name])
        own_err = own_error(name, own)
        tol = derived_tolerance(errors[name], own_err, dt, rtol=rtol, atol=atol,
                                factor=rule_factor(rule, factor))
        loose = None
        over = ~(np.isfinite(errors[name].max_abs) & (errors[name].max_abs <= tol))
        if rule == "same-dtype" and rtol is None and over.any():
            if lenient is None:     # the float64 rule's baseline, for the class between
                lenient = _baseline(rec, args, options, dtypes, "float64", None, full, how)
            loose = derived_tolerance(errors[name], own_error(name, lenient), dt, rtol=None,
                                      atol=atol)
        items[name] = Comparison.of(f"{rec.name} d{name}", dt, errors[name], tol, own_err,
                                    profile=None if profile is None else str(profile),
                                    rule=rule, lenient=loose, strict=strict)
    return GradComparison(rec.name, items, rule)


def _dtypes_and_rule(grads: dict, rule, inputs) -> tuple[set, str, str | None]:
    """The gradients' dtypes, the rule (``same-dtype`` for half precision by default) and
    the half dtype it refers to."""
    dtypes = {dtype_name(g) for g in grads.values()}
    for dt in dtypes:
        if dt not in EPS:
            raise TypeError(f"gradients must have a floating dtype; got {dt}")
    low = sorted(dtypes & set(HALF))
    rule, half = choose_rule(rule, low[0] if low else sorted(dtypes)[0], inputs)
    return dtypes, rule, half


def host_problem(grads, variant, q, k, v, do, params, layout, profile):
    """``(record, q k v do, options, the gradients, how)`` as host arrays in arrayattn's
    layout and option names (a profile's mapping applied); ``how`` holds ``groups``, the
    query heads per key/value head that the profile repeated (1: none), and the profile's
    ``convert`` (hooks written with torch operations get torch tensors)."""
    from ..registry import get_variant

    problem = prepare(variant, q, k, v, layout=layout, profile=profile, params=params)
    if problem.rows is not None or problem.name == "paged_attention":
        raise ValueError(f"gradients are judged where the problem maps the port's tensors "
                         f"one to one; not for {problem.name} with profile {problem.profile}")
    args = {"q": problem.q, "k": problem.k, "v": problem.v,
            "do": to_bhnd({"do": host64(do)}, problem.layout, ("do",))["do"]}
    theirs = to_bhnd({name: host64(g) for name, g in grads.items()}, problem.layout,
                     ("q", "k", "v"))
    unknown = sorted(set(theirs) - set(args) - set(problem.options))
    if unknown:
        raise ValueError(f"grads has {', '.join(unknown)}, not arguments of this call")
    given_k = np.shape(host64(k))
    heads = given_k[-3] if len(given_k) >= 3 and problem.layout == "bhnd" else (
        given_k[-2] if len(given_k) >= 3 else None)
    groups = 1
    if heads and problem.k.ndim >= 3 and problem.k.shape[-3] != heads:
        groups = problem.k.shape[-3] // heads
    return (get_variant(problem.name), args, problem.options, theirs,
            {"groups": groups, "convert": problem.convert, "problem": problem,
             "shift": problem.lse_shift if problem.name == "softmax" else None})


def reference_vjp(rec, args: dict, options: dict, dtype: str, nudge=None, *, how=None,
         options_too: bool = True) -> dict:
    """:func:`arrayattn.vjp` by the reference form in ``dtype`` (floating arrays perturbed by
    ``nudge`` first), as host float64 arrays; the gradients of key/value heads a profile
    repeated ``how["groups"]`` times summed back over each group."""
    from ..core.engine import use_engine
    from ..backward import vjp

    how = how or {}
    groups, convert = how.get("groups", 1), how.get("convert")
    a = cast_floating(args, dtype, nudge)
    p = cast_floating(options, dtype, nudge if options_too else None)
    if convert is not None:
        a, p = ({key: convert(val) if is_array(val) else val for key, val in d.items()}
                for d in (a, p))
    with use_engine("reference"):
        res = vjp(rec, a["q"], a["k"], a["v"], a["do"], **p)
    res = {name: np.asarray(to_numpy(g), dtype=np.float64) for name, g in res.items()}
    if groups > 1:
        for name in ("k", "v"):
            g = res[name]
            res[name] = g.reshape(*g.shape[:-3], g.shape[-3] // groups, groups,
                                  *g.shape[-2:]).sum(axis=-3)
    return res


def _check_shapes(name: str, theirs: dict, ref: dict) -> None:
    missing = sorted(set(theirs) - set(ref))
    if missing:
        raise ValueError(f"{name} has no gradient for {', '.join(missing)} in this call")
    for key, g in theirs.items():
        if g.shape != ref[key].shape:
            raise ValueError(f"grads[{key!r}] has shape {g.shape} but d{key} has shape "
                             f"{ref[key].shape}")


def _baseline(rec, args: dict, options: dict, dtypes: set, rule: str, half, ref: dict,
              how: dict, covered=None) -> dict:
    """The baseline error of each gradient (elementwise): the worst of the plain
    evaluations of the convention's forms (:mod:`arrayattn.testing.plain`) -- under
    ``same-dtype`` the half ensemble (from inputs rounded to the half dtype, in float32,
    each gradient rounded once; every product rounded to the half dtype) and nothing else,
    FlashAttention's rule; under ``float64`` the working-precision ensemble (inputs
    perturbed by one unit roundoff, the scale first, blockwise, the gated chunk forms)
    and, where that does not already cover every head, the float64 gradients' response to
    rounding (:func:`~arrayattn.testing.rounding.sensitivity`), kept where larger.  Rows
    whose softmax gradient cancels get :func:`_cancellation_floor` in both."""
    def backward(a, o, dtype, nudge):
        return reference_vjp(rec, a, o, dtype, nudge, how=how, options_too=False)

    problem = how.get("problem")
    start = {}
    if rule == "same-dtype":
        own = reference_vjp(rec, args, options, "float32", lambda x: round_to(x, half), how=how,
                   options_too=False)
        for name, g in own.items():
            if name in ref:
                with np.errstate(invalid="ignore"):
                    err = np.abs(np.where(np.isfinite(ref[name]),
                                          round_to(g, half) - ref[name], 0.0))
                start[name] = np.where(np.isfinite(err), err, 0.0)
        eps, work = EPS[half], "float32"
    else:
        work = "float64" if dtypes == {"float64"} else "float32"
        eps = EPS[work]
    # the half forms carry a cancelling row's rounding themselves (D from the stored output)
    floor = {} if rule == "same-dtype" else _cancellation_floor(rec, args, options, eps)

    def floored(errors: dict) -> dict:
        res = dict(errors)
        for name in floor:     # rows that cancel: every entry below the terms' rounding
            if name in res:
                fin = np.where(np.isfinite(ref[name]), np.abs(ref[name]), 0.0)
                cancelled = fin.max(axis=-1, keepdims=True, initial=0.0) <= floor[name]
                res[name] = np.where(cancelled, np.maximum(res[name], floor[name]), res[name])
        return res

    res = floored(plain.grad_baseline(
        problem, backward, args, options, ref, work=work, half=half if rule == "same-dtype"
        else None, how=how, start=start,
        covered=None if covered is None else (lambda worst: covered(floored(worst)))))
    if rule == "same-dtype":
        return res
    if covered is not None and not rounding.MEASURE_ALWAYS and covered(res):
        return res     # the response to rounding can only raise the tolerance
    row = _row_jitter(rec, args, options, how, eps * jitter_scale(rule) / JITTER_SCALE)

    def jittered(j):
        perturbed = dict(args, do=row(args["do"], j.rng)) if row is not None else args
        opts = options if rec.family != "exact" else logit_rounding(
            options, args["q"], args["k"], j, how.get("shift"))
        return reference_vjp(rec, perturbed, opts, "float64", j, how=how)

    jitter = sensitivity(jittered, ref, eps, scale=jitter_scale(rule))
    stored = _stored_output_rounding(rec, args, options, how, eps * jitter_scale(rule) / 2,
                                     ref["k"].shape if "k" in ref else ())
    return {name: np.maximum(np.maximum(res[name], jitter[name]), stored.get(name, 0.0))
            for name in ref}


def _stored_output_rounding(rec, args: dict, options: dict, how: dict, u: float,
                            k_shape: tuple) -> dict:
    r"""Softmax attention's backward forms :math:`D_i = do_i \cdot o_i` from the output as
    the forward stored it, rounded to its dtype (FlashAttention-2; a plain evaluation
    rounds that sum as well): :math:`\delta D_i = u \sum_c |do_{ic}\, o_{ic}|` moves
    :math:`dS_{ij} = P_{ij}(dP_{ij} - D_i)` by :math:`-P_{ij}\, \delta D_i`, which no
    perturbation of the inputs reproduces (it keeps :math:`D_i` and :math:`dP_{ij}`
    consistent) and which is the whole error where they cancel (a row that sees one key,
    a one-hot row).  Its effect, elementwise: ``dq_i`` by :math:`\mathrm{scale}\,
    \delta D_i\, |(P k)_i|`, ``dk_j`` by :math:`\mathrm{scale}\, |\sum_i P_{ij}\,
    \delta D_i\, q_i|` with random signs (the largest of
    :data:`~arrayattn.testing.rounding.JITTER_DRAWS`), summed over a profile's repeated
    key heads (or broadcast ones: ``k_shape``, the reference ``dk``'s).  ``{}`` for other
    variants."""
    from ..core.engine import use_engine

    if rec.family != "exact":
        return {}
    q, k, v, do = (np.nan_to_num(args[x], nan=0.0, posinf=0.0, neginf=0.0)
                   for x in ("q", "k", "v", "do"))
    group = key_group(q, k)          # grouped key heads taken natively
    s = k.shape[-2]
    a = dict(args, v=np.broadcast_to(np.eye(s), (*args["k"].shape[:-2], s, s)))
    convert = how.get("convert")
    opts = options
    if convert is not None:
        a = {key: convert(val) for key, val in a.items()}
        opts = {key: convert(val) if is_array(val) else val for key, val in options.items()}
    with use_engine("reference"):
        p = np.asarray(to_numpy(rec.reference(a["q"], a["k"], a["v"], **opts)),
                       dtype=np.float64)
    p = np.where(np.isfinite(p), p, 0.0)
    k, v = (np.repeat(x, group, axis=-3) for x in (k, v))
    scale = logit_scale(options, q.shape[-1])
    delta = u * np.sum(np.abs(do * (p @ v)), axis=-1, keepdims=True)      # (..., n, 1)
    res = {"q": scale * delta * np.abs(p @ k)}
    rng, dk = np.random.default_rng(0), 0.0
    for _ in range(JITTER_DRAWS):
        signs = rng.choice([-1.0, 1.0], size=delta.shape)
        g = scale * (np.swapaxes(p, -1, -2) @ (signs * delta * q))
        for size in (group, how.get("groups", 1)):    # native groups, then a profile's
            if size > 1:
                g = g.reshape(*g.shape[:-3], g.shape[-3] // size, size,
                              *g.shape[-2:]).sum(axis=-3)
        while g.ndim > len(k_shape):                  # broadcast key heads / batch
            g = g.sum(axis=0)
        g = np.sum(g, axis=tuple(i for i, (a, b) in enumerate(zip(g.shape, k_shape))
                                 if b == 1 and a != 1), keepdims=True)
        dk = np.maximum(dk, np.abs(g))
    res["k"] = dk
    return res


def _cancellation_floor(rec, args: dict, options: dict, eps: float) -> dict:
    """Softmax attention's ``dS = P (dP - D)`` cancels exactly where a row sees one key (or
    its probabilities are one-hot): the reference's ``dq`` is then 0 and no perturbation
    moves it, while a kernel's ``dP_ij = do_i . v_j`` and ``D_i = do_i . o_i`` each round
    by ``u |do| |v|``.  The floor is that rounding carried through ``dq = scale dS k`` and
    ``dk = scale dS^T q``: ``eps |scale| max|do| max|v| max|k|`` (``max|q|`` for dk),
    applied to the rows whose every reference entry is below it."""
    if rec.family != "exact":
        return {}
    q, k, v, do = (np.abs(np.nan_to_num(args[x], posinf=0.0, neginf=0.0))
                   for x in ("q", "k", "v", "do"))
    base = eps * logit_scale(options, q.shape[-1]) * float(do.max(initial=0.0)) * float(v.max(initial=0.0))
    return {"q": base * float(k.max(initial=0.0)), "k": base * float(q.max(initial=0.0))}


def _row_jitter(rec, args: dict, options: dict, how: dict, eps: float):
    """For softmax attention, the backward's coherent rounding: a kernel recomputes
    ``P = exp(S - lse)`` from a stored log-sum-exp rounded by ``u |lse_i|``, which scales
    row ``i`` of ``P`` -- and so its share of every gradient -- as a relative change of
    ``do_i`` would.  Returns ``f(do, rng)`` applying that random per-row factor, or
    ``None`` for a variant without a log-sum-exp."""
    from ..core.engine import use_engine

    if rec.family != "exact":
        return None
    a = args if how.get("convert") is None else {
        key: how["convert"](val) for key, val in args.items()}
    opts = options if how.get("convert") is None else {
        key: how["convert"](val) if is_array(val) else val for key, val in options.items()}
    with use_engine("reference"):
        _, lse = rec.reference(a["q"], a["k"], a["v"], **opts, return_lse=True)
    lse = np.asarray(to_numpy(lse), dtype=np.float64)
    size = JITTER_SCALE * eps / 2 * np.where(np.isfinite(lse), np.abs(lse), 0.0)[..., None]

    def apply(do, rng):
        return do * (1.0 + size * rng.choice([-1.0, 1.0], size=size.shape))
    return apply


def assert_grads_match(grads: dict, variant, q, k, v, do, /, **kwargs) -> None:
    """Assert that ``grads`` equal arrayattn's float64 :func:`~arrayattn.vjp` per head and
    argument (:func:`compare_grads`; same keywords); ``AssertionError`` names the worst.
    A NaN or inf gradient where the reference is finite never passes; a negative or
    non-finite ``rtol`` / ``atol`` is a ``ValueError``.

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> from arrayattn.testing import assert_grads_match
    >>> rng = np.random.default_rng(1)
    >>> q, k, v, do = (rng.standard_normal((3, 12, 8)) for _ in range(4))
    >>> assert_grads_match(arrayattn.vjp("softmax", q, k, v, do), "softmax", q, k, v, do)
    """
    c = compare_grads(grads, variant, q, k, v, do, **kwargs)
    if not c.ok:
        lines = [c.verdict()]
        for name, item in c.items.items():
            lines += [f"  d{name} " + item.head_line(i) for i in item.failing[:3]]
        raise AssertionError("\n".join(lines))
