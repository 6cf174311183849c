r"""Plain evaluations: the rounding baseline of the referees, taken the anchors' way (issue
#48).

FlashAttention's tests accept a kernel whose error against a float32 reference is at most
twice that of ``attention_ref(upcast=False)``, a plain PyTorch evaluation of the same
formula in the kernel's dtype; fla's tests compare with its naive recurrent and chunk
forms.  Correct evaluations round differently -- a bias added before the max shift, half
matmuls around a float32 softmax, cumulative-sum differences that cancel, an online
softmax in tiles -- so the baseline here is the **worst of a small ensemble** of plain
evaluations of the convention's own forms, in the result's precision, each an evaluation
of arrayattn's reference forms (or of their logits pipeline) on the referee's host
arrays, not a kernel of its own.

Each :class:`Form` is data: a name, a sentence, which problems it applies to, and how it
evaluates the output (``out``, ``lse``) or the gradients.  Two ensembles:

* **working** (the ``float64`` rule, float32 or float64 results): the reference form in
  the working precision on inputs perturbed by one unit roundoff (the textbook order);
  for exact attention also the scale folded into ``q`` first (FlashAttention's
  ``attention_ref``), FlashAttention's online softmax in tiles of 16, and the logits
  formed larger by a per-row constant as a convention forms them (FlashAttention's
  causal ALiBi ``slope (j - s + 1)``: :attr:`Problem.lse_shift`); for the gated family
  the recurrence beside the reference's chunk form, and the gate gradient as fla's chunk
  kernels form it, a reverse cumulative sum of :math:`q \odot dq - k \odot dk`.
* **half** (the ``same-dtype`` rule, float16/bfloat16): inputs in the half dtype computed
  in float32 and rounded once (``attention_ref(upcast=True)``, a fused kernel); for exact
  attention also every intermediate rounded to the half dtype -- scores, probabilities
  (softmax computed in float32 between half matmuls, Hugging Face's eager attention),
  output, and in the backward ``dP``, ``dS`` and each gradient -- with the scale applied
  after the product or folded into ``q`` first (``attention_ref(upcast=False)``).

:func:`output_baseline` and :func:`grad_baseline` return the elementwise worst error of
the ensemble against the float64 reference.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .measures import EPS, Nudge, cast_floating, round_to

__all__ = ["Form", "OUTPUT_FORMS", "GRAD_FORMS", "output_baseline", "grad_baseline",
           "forms_for"]

#: FlashAttention's tiles are 64-128 rows; 16 makes the online softmax merge several
#: tiles on the checker's small cases too.
ONLINE_BLOCK = 16


@dataclass(frozen=True)
class Form:
    """One plain evaluation: ``name``, ``sentence`` (what it stands for), ``half``
    (an evaluation in the half dtype, for the ``same-dtype`` rule; else in the working
    precision), ``applies(problem) -> bool`` and ``evaluate(problem, dtype, **kw)``."""

    name: str
    sentence: str
    half: bool
    applies: Callable
    evaluate: Callable


# -- what a problem is -------------------------------------------------------------------

def _exact(problem) -> bool:
    return problem.name == "softmax"


def _gated(problem) -> bool:
    from ..registry import get_variant
    try:
        rec = get_variant(problem.name)
    except (ValueError, KeyError):
        return False
    return rec.family == "gated" and "method" in inspect.signature(rec.fn).parameters


def _gate_name(problem):
    """The log-gate option of a gated problem that enters as ``exp`` of its cumulative sum
    (GLA's ``g (..., n, K)``, SSD's ``a (..., n)``), or ``None``."""
    for name in ("g", "a"):
        if problem.name in ("gla", "ssd") and problem.options.get(name) is not None:
            return name
    return None


def _always(problem) -> bool:
    return True


def _scale(problem) -> float:
    scale = problem.options.get("scale")
    return float(scale) if scale is not None else problem.q.shape[-1] ** -0.5


def _reference(problem, q, k, v, options, *, lse: bool):
    """``problem.reference`` on host arrays (its rows taken), as float64."""
    from ..core.xp import to_numpy
    if problem.convert is not None:
        q, k, v = (problem.convert(x) for x in (q, k, v))
        options = {key: problem.convert(val) if hasattr(val, "shape") else val
                   for key, val in options.items()}
    if lse:
        options = dict(options, return_lse=True)
    res = problem.reference(q, k, v, **options)
    res = np.asarray(to_numpy(res[1] if lse else res), dtype=np.float64)
    if problem.rows is not None:
        res = res[..., problem.rows] if lse else res[..., problem.rows, :]
    return res


def _with_shift(res, problem, lse: bool):
    return res + problem.lse_shift if lse and problem.lse_shift is not None else res


# -- working-precision forms (the float64 rule) -------------------------------------------

def _textbook(problem, work, *, lse=False, half=None):
    return problem.evaluate(work, Nudge(work), lse=lse)


def _scale_first(problem, work, *, lse=False, half=None):
    q = (problem.q * _scale(problem)).astype(work)
    args = cast_floating({"k": problem.k, "v": problem.v}, work)
    opts = cast_floating(dict(problem.options, scale=1.0), work)
    return _with_shift(_reference(problem, q, args["k"], args["v"], opts, lse=lse),
                       problem, lse)


def _online(problem, work, *, lse=False, half=None):
    return replace(problem, options=dict(problem.options, block_size=ONLINE_BLOCK)).evaluate(
        work, lse=lse)


def _shifted_logits(problem):
    """The options with the per-row constant a convention adds to its logits (the lse
    shift) added as a bias: softmax-invariant, rounded at that size."""
    shift = np.asarray(problem.lse_shift, dtype=np.float64)[..., None]
    n, s = problem.q.shape[-2], problem.k.shape[-2]
    bias = problem.options.get("bias")
    shape = np.broadcast_shapes(shift.shape[:-2] + (n, s), problem.q.shape[:-2] + (n, s),
                                np.shape(bias) if bias is not None else ())
    full = np.broadcast_to(shift, shape) + (0.0 if bias is None else bias)
    return dict(problem.options, bias=np.ascontiguousarray(full))


def _library_bias(problem, work, *, lse=False, half=None):
    args = cast_floating({"q": problem.q, "k": problem.k, "v": problem.v}, work)
    opts = cast_floating(_shifted_logits(problem), work)
    # the lse of the larger logits is the port's own (the reference's plus the shift)
    return _reference(problem, args["q"], args["k"], args["v"], opts, lse=lse)


def _has_shift(problem) -> bool:
    return _exact(problem) and problem.lse_shift is not None


def _exact_host(problem) -> bool:
    """Exact attention whose options are host data (no torch-written ``score_mod``)."""
    return _exact(problem) and problem.convert is None


def _method(method, chunk=None):
    def evaluate(problem, work, *, lse=False, half=None):
        opts = dict(problem.options, method=method)
        if chunk is not None:
            opts["chunk_size"] = chunk
        return replace(problem, options=opts).evaluate(work, lse=lse)
    return evaluate


# -- half-precision forms (the same-dtype rule) ------------------------------------------

def _upcast(problem, work, *, lse=False, half=None):
    own = problem.evaluate("float32", lambda x: round_to(x, half), lse=lse)
    return own if lse else round_to(own, half)   # an lse stays float32 in every kernel


def _half_logits(problem, half, scale_first: bool):
    """``(x, allowed, slope, q, k, v, options, ungroup, scale)``: exact attention's logits
    in float32 from the inputs rounded to ``half`` (grouped heads split as the reference
    splits them), the scores rounded to ``half`` as a plain evaluation stores them."""
    from ..core.heads import group_heads
    from ..exact.checks import checked_call
    from ..reference.logits import tile_logits

    r = lambda x: round_to(x, half)                               # noqa: E731
    q, k, v = (r(x).astype(np.float32) for x in (problem.q, problem.k, problem.v))
    options = cast_floating({key: val for key, val in problem.options.items()
                             if key not in ("return_lse", "block_size")}, "float32")
    scale = _scale(problem)
    if scale_first:
        q, options = r(q * np.float32(scale)).astype(np.float32), dict(options, scale=1.0)
    grouped = group_heads(q, k, v, options)
    ungroup = None
    if grouped is not None:
        q, k, v, options, ungroup = grouped
    call = checked_call(q, k, v, **options)
    n, s = q.shape[-2], k.shape[-2]
    x, allowed, slope = tile_logits(call.logits, q, k, 0, n, 0, s, slope=True)
    shift = 0.0
    if _has_shift(problem):                    # the logits as the convention forms them
        shift = np.asarray(problem.lse_shift, dtype=np.float64)[..., None]
        if grouped is not None:
            shift = shift.reshape(*x.shape[:-2], n, 1)
    x = r(np.asarray(x, dtype=np.float64) + shift)
    if allowed is not None:
        allowed = np.broadcast_to(np.asarray(allowed), x.shape)
    else:
        allowed = np.ones(x.shape, dtype=bool)
    return x, allowed, slope, q, k, v, ungroup, (1.0 if scale_first else scale), shift


def _half_forward(problem, half, scale_first):
    r = lambda a: round_to(a, half)                               # noqa: E731
    x, allowed, slope, q, k, v, ungroup, scale, shift = _half_logits(problem, half,
                                                                     scale_first)
    xs = np.where(allowed, x, -np.inf).astype(np.float32)
    m = np.max(xs, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    e = np.exp(xs - np.where(seen, m, 0.0).astype(np.float32))
    l = np.sum(e, axis=-1, keepdims=True, dtype=np.float32)
    p = r(np.where(seen, e / np.where(l > 0, l, 1), 0.0))        # float32 softmax, half P
    out = r(p.astype(np.float32) @ v)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    return dict(out=out, lse=lse, p=p, x=x, allowed=allowed, slope=slope, q=q, k=k, v=v,
                ungroup=ungroup, scale=scale, shift=shift)


def _ungroup(f, out, lse):
    if f["ungroup"] is None:
        return out, lse
    o, l = f["ungroup"]((out, lse))
    return np.asarray(o), np.asarray(l)


def _all_half(scale_first: bool):
    def evaluate(problem, work, *, lse=False, half=None):
        f = _half_forward(problem, half, scale_first)
        out, l = _ungroup(f, f["out"], f["lse"])
        if problem.rows is not None:
            out, l = out[..., problem.rows, :], l[..., problem.rows]
        if not lse:
            return out
        # the lse of the logits as formed: the convention's own (shift included), else
        # the plain one with the profile's shift added exactly
        return l if _has_shift(problem) else _with_shift(l, problem, True)
    return evaluate


def _all_half_grads(scale_first: bool):
    """The backward of :func:`_half_forward` as a plain half evaluation computes it
    (autograd through half operations: each product rounded to ``half``)."""
    def evaluate(problem, do, half):
        r = lambda a: round_to(a, half)                           # noqa: E731
        f = _half_forward(problem, half, scale_first)
        p, q, k, v = f["p"], f["q"], f["k"], f["v"]
        do = r(do).astype(np.float32)
        if f["ungroup"] is not None:          # do in the grouped layout of q
            do = do.reshape(q.shape[:-1] + (do.shape[-1],))
        vt = np.broadcast_to(v, p.shape[:-2] + v.shape[-2:])
        dp = r(do @ np.swapaxes(vt, -1, -2).astype(np.float32))
        # D as FlashAttention-2 forms it from the stored half output (the textbook form),
        # as autograd through softmax forms it from dP and P (attention_ref's)
        delta = (np.sum(dp * p, axis=-1, keepdims=True, dtype=np.float32) if scale_first
                 else np.sum(do * f["out"], axis=-1, keepdims=True, dtype=np.float32))
        ds = r(np.where(f["allowed"], p * (dp - delta), 0.0))
        if f["slope"] is not None:
            ds = r(ds * np.asarray(f["slope"], dtype=np.float64))
        ds32 = ds.astype(np.float32)
        kt = np.broadcast_to(k, p.shape[:-2] + k.shape[-2:]).astype(np.float32)
        dq = r(ds32 @ kt)
        dk = r(np.swapaxes(ds32, -1, -2) @ q.astype(np.float32))
        dv = r(np.swapaxes(p, -1, -2).astype(np.float32) @ do)
        if scale_first:                 # d(q scale) -> dq; k saw q already scaled
            dq = r(dq * _scale(problem))
        else:
            dq, dk = r(dq * f["scale"]), r(dk * f["scale"])
        if f["ungroup"] is not None:    # k, v broadcast over the group axis: sum it
            dk, dv = (np.sum(g, axis=-3) for g in (dk, dv))
            dq = dq.reshape(problem.q.shape)
        return {"q": dq, "k": dk, "v": dv}
    return evaluate


# -- the ensembles --------------------------------------------------------------------------

OUTPUT_FORMS = (
    Form("textbook", "the reference form in the working precision, inputs perturbed by one "
         "unit roundoff", False, _always, _textbook),
    Form("scale first", "the scale folded into q before the product (attention_ref)",
         False, _exact, _scale_first),
    Form("logits as formed", "the logits larger by the convention's per-row constant "
         "(causal ALiBi as slope (j - s + 1))", False, _has_shift, _library_bias),
    Form("online softmax", f"FlashAttention's online softmax in tiles of {ONLINE_BLOCK}",
         False, _exact, _online),
    Form("recurrent", "the gated recurrence, one token at a time", False, _gated,
         _method("recurrent")),
    Form("upcast", "inputs in the half dtype, computed in float32, rounded once "
         "(attention_ref(upcast=True), a fused kernel)", True, _always, _upcast),
    Form("half", "every intermediate in the half dtype: scores, softmax in float32 "
         "between half matmuls, output (Hugging Face's eager attention)", True, _exact_host,
         _all_half(False)),
    Form("half, scale first", "every intermediate in the half dtype, the scale folded "
         "into q first (attention_ref(upcast=False))", True, _exact_host,
         _all_half(True)),
)


def forms_for(problem, half: bool) -> list:
    """The forms of :data:`OUTPUT_FORMS` that apply to ``problem`` in that ensemble."""
    return [f for f in OUTPUT_FORMS if f.half == half and f.applies(problem)]


def _worst(results, ref) -> np.ndarray:
    worst = np.zeros(np.shape(ref))
    seen = np.isfinite(ref)
    for res in results:
        res = np.asarray(res, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            err = np.where(seen & np.isfinite(res),
                           np.abs(np.where(seen, res, 0.0) - np.where(seen, ref, 0.0)), 0.0)
        worst = np.maximum(worst, err)
    return worst


def output_baseline(problem, ref, *, dtype: str, half: str | None, lse: bool = False,
                    covered=None):
    """``(worst |form - ref| elementwise, all finite)`` over the ensemble: the half forms
    (``half`` given: the ``same-dtype`` rule) or the working-precision ones (float32, or
    float64 for a float64 result).  ``covered(worst)``: whether the verdict is already a
    match with the worst so far -- then the remaining forms, which can only raise it, are
    not evaluated (unless :data:`~arrayattn.testing.rounding.MEASURE_ALWAYS`)."""
    from . import rounding
    work = "float64" if dtype == "float64" else "float32"
    worst, finite = np.zeros(np.shape(ref)), True
    for form in forms_for(problem, half is not None):
        res = form.evaluate(problem, work, lse=lse, half=half)
        res = np.asarray(res, dtype=np.float64)
        if res.shape != np.shape(ref):
            continue
        finite &= bool(np.all(np.isfinite(res) | ~np.isfinite(ref)))
        worst = np.maximum(worst, _worst([res], ref))
        if covered is not None and not rounding.MEASURE_ALWAYS and covered(worst):
            break
    return worst, finite


# -- gradients ---------------------------------------------------------------------------------

def _grad_textbook(vjp, args, options, work, how, problem):
    return vjp(args, options, work, Nudge(work))


def _grad_scale_first(vjp, args, options, work, how, problem):
    scale = float(options["scale"]) if options.get("scale") is not None else \
        args["q"].shape[-1] ** -0.5
    res = vjp(dict(args, q=args["q"] * scale), dict(options, scale=1.0), work, None)
    return dict(res, q=res["q"] * scale)


def _grad_online(vjp, args, options, work, how, problem):
    return vjp(args, dict(options, block_size=ONLINE_BLOCK), work, None)


def _grad_method(method, chunk=None):
    def evaluate(vjp, args, options, work, how, problem):
        opts = dict(options, method=method)
        if chunk is not None:
            opts["chunk_size"] = chunk
        return vjp(args, opts, work, None)
    return evaluate


def _grad_gate_cumsum(vjp, args, options, work, how, problem):
    r"""fla's chunk kernels form the log-gate gradient from the other two: with
    ``G = cumsum g`` entering as ``q e^G`` and ``k e^-G``, :math:`\partial L / \partial
    G_t = q_t \odot dq_t - k_t \odot dk_t` and ``dg`` is its reverse cumulative sum
    (summed over features for a scalar gate) -- O(1) terms cancelling in the working
    precision where the exact gradient is tiny."""
    name = _gate_name(problem)
    res = vjp(args, options, work, Nudge(work))     # the textbook form's, cached
    dt = np.float32 if work == "float32" else np.float64
    q, k = (args[x].astype(dt) for x in ("q", "k"))
    term = q * res["q"].astype(dt) - k * res["k"].astype(dt)
    if name == "a":
        term = np.sum(term, axis=-1, dtype=dt)
    dg = np.flip(np.cumsum(np.flip(term, axis=-2 if name == "g" else -1),
                           axis=-2 if name == "g" else -1, dtype=dt),
                 axis=-2 if name == "g" else -1)
    return {name: dg.astype(np.float64)}


def _gate_problem(problem) -> bool:
    return _gate_name(problem) is not None and problem.options.get("key_mask") is None


GRAD_FORMS = (
    Form("textbook", "the reference backward in the working precision, inputs perturbed",
         False, _always, _grad_textbook),
    Form("scale first", "the scale folded into q first", False, _exact, _grad_scale_first),
    Form("online softmax", "FlashAttention-2's blockwise backward", False, _exact,
         _grad_online),
    Form("recurrent", "the gated recurrence's backward", False, _gated,
         _grad_method("recurrent")),
    Form("gate by cumulative sums", "dg = reverse cumsum(q dq - k dk), as fla's chunk "
         "kernels form it", False, _gate_problem, _grad_gate_cumsum),
    Form("half", "autograd through a plain half evaluation", True, _exact_host,
         _all_half_grads(False)),
    Form("half, scale first", "autograd through attention_ref(upcast=False)", True,
         _exact_host, _all_half_grads(True)),
)


def grad_baseline(problem, vjp, args: dict, options: dict, ref: dict, *, work: str,
                  half: str | None, how: dict, start: dict | None = None,
                  covered=None) -> dict:
    """Per gradient name, the elementwise worst ``|form - ref|`` over the gradient
    ensemble (half forms with ``half``, working-precision ones otherwise), from ``start``
    (errors already measured).  ``vjp(args, options, dtype, nudge)`` is the referee's
    backward (key heads a profile repeated summed back); ``problem`` the forward problem
    (what the forms apply to); ``covered(worst)`` stops the ensemble once the verdict is a
    match (as in :func:`output_baseline`)."""
    from . import rounding
    worst = {name: np.zeros(np.shape(r)) for name, r in ref.items()}
    for name, err in (start or {}).items():
        if name in worst:
            worst[name] = np.maximum(worst[name], err)
    memo = {}

    def backward(a, o, dtype, nudge):      # the textbook result serves the gate's form too
        key = (id(a), id(o), dtype, type(nudge).__name__)
        if key not in memo:
            memo[key] = vjp(a, o, dtype, nudge)
        return memo[key]

    for form in GRAD_FORMS:
        if form.half != (half is not None) or not form.applies(problem):
            continue
        if form.half:
            res = form.evaluate(problem, args["do"], half)
            groups = how.get("groups", 1)
            for name in ("k", "v"):       # key heads a profile repeated: summed back
                g = res[name]
                if groups > 1:
                    res[name] = round_to(g.reshape(*g.shape[:-3], g.shape[-3] // groups,
                                                   groups, *g.shape[-2:]).sum(axis=-3), half)
        else:
            res = form.evaluate(backward, args, options, work, how, problem)
        for name, g in res.items():
            if name in worst and np.shape(g) == np.shape(ref[name]):
                worst[name] = np.maximum(worst[name], _worst([g], ref[name]))
        if covered is not None and not rounding.MEASURE_ALWAYS and covered(worst):
            break
    return worst
