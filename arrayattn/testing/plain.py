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
           "forms_for", "logit_rounding_rms"]

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


def _scale_split(problem, work, *, lse=False, half=None):
    root = _scale(problem) ** 0.5
    q, k = ((x * root).astype(work) for x in (problem.q, problem.k))
    opts = cast_floating(dict(problem.options, scale=1.0), work)
    return _with_shift(_reference(problem, q, k, problem.v.astype(work), opts, lse=lse),
                       problem, lse)


def _online(problem, work, *, lse=False, half=None):
    return replace(problem, options=dict(problem.options, block_size=ONLINE_BLOCK)).evaluate(
        work, lse=lse)


def _shifts(problem) -> list:
    """The per-row constants the convention's forms add to exact attention's logits: the
    port's own (:attr:`Problem.lse_shift`, its lse includes it) and those of the forms its
    authors ship (:attr:`Problem.form_shifts`)."""
    if not _exact(problem):
        return []
    own = [] if problem.lse_shift is None else [problem.lse_shift]
    return own + [s for s in problem.form_shifts if s is not None]


def _shifted_logits(problem, shift):
    """The options with a per-row constant added as a bias: softmax-invariant, rounded at
    that size."""
    shift = np.asarray(shift, dtype=np.float64)[..., None]
    n, s = problem.q.shape[-2], problem.k.shape[-2]
    bias = problem.options.get("bias")
    shape = np.broadcast_shapes(shift.shape[:-2] + (n, s), problem.q.shape[:-2] + (n, s),
                                np.shape(bias) if bias is not None else ())
    full = np.broadcast_to(shift, shape) + (0.0 if bias is None else bias)
    return dict(problem.options, bias=np.ascontiguousarray(full))


def _lse_as_port(lse, problem, shift):
    """The lse of logits larger by ``shift`` as the port reports it (its own shift)."""
    own = 0.0 if problem.lse_shift is None else problem.lse_shift
    return lse - np.asarray(shift, dtype=np.float64) + own


def _library_bias(problem, work, *, lse=False, half=None):
    args = cast_floating({"q": problem.q, "k": problem.k, "v": problem.v}, work)
    for shift in _shifts(problem):
        opts = cast_floating(_shifted_logits(problem, shift), work)
        res = _reference(problem, args["q"], args["k"], args["v"], opts, lse=lse)
        res = _lse_as_port(res, problem, shift) if lse else res
        yield res


def _has_shift(problem) -> bool:
    return bool(_shifts(problem))


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


#: Where a plain half evaluation applies the scale: to the scores after the product
#: (``"after"``, rounded once), to ``q`` first (``attention_ref(upcast=False)``), to ``k``
#: first (its ``reorder_ops=True``), to the scores rounded after the product and again
#: after the scale (``"hf"``: Hugging Face's eager ``matmul(q, k^T) * scaling``); or
#: ``"fused"``: a fused kernel's float32 scores, probabilities and ``dP``, with the output
#: stored in the half dtype and ``D = rowsum(dO O)`` formed from it (FlashAttention-2).
ORDERS = ("after", "q", "k", "split", "hf", "fused")


def _half_logits(problem, half, order: str):
    """Exact attention's logits as a plain half evaluation forms them, from the inputs
    rounded to ``half`` (grouped heads split as the reference splits them): a dict with
    ``x`` (the scores: the product rounded as ``order`` rounds it, the soft cap as three
    half operations, then what the pipeline adds -- bias, ALiBi, masks -- added in half,
    or in float32 after ``attention_ref``'s float32 bias), ``allowed``, ``slope`` (``dx /
    d raw``), the float32 ``q, k, v`` the products read (the scaled one rounded),
    ``ungroup``, ``scale`` (the factor left on the product: 1 when folded into an input)."""
    from ..core.heads import group_heads
    from ..exact.checks import checked_call
    from ..reference.logits import tile_logits

    r = (lambda x: x) if order == "fused" else (lambda x: round_to(x, half))  # noqa: E731
    q, k, v = (round_to(x, half).astype(np.float32) for x in (problem.q, problem.k,
                                                              problem.v))
    options = cast_floating({key: val for key, val in problem.options.items()
                             if key not in ("return_lse", "block_size")}, "float32")
    grouped = group_heads(q, k, v, options)
    ungroup = None
    if grouped is not None:
        q, k, v, options, ungroup = grouped
    call = checked_call(q, k, v, **options)
    n, s = q.shape[-2], k.shape[-2]
    full, allowed, slope = tile_logits(call.logits, q, k, 0, n, 0, s, slope=True)
    full = np.asarray(full, dtype=np.float64)
    scale = call.logits.scale
    qs, ks = q, k
    if order == "q":
        qs = round_to(q * np.float32(scale), half).astype(np.float32)
    elif order == "k":
        ks = round_to(k * np.float32(scale), half).astype(np.float32)
    elif order == "split":
        root = np.float32(scale ** 0.5)
        qs, ks = (round_to(x * root, half).astype(np.float32) for x in (q, k))
    raw = (q @ np.swapaxes(k, -1, -2)).astype(np.float64)        # the exact product
    if order in ("q", "k", "split"):
        y = round_to((qs @ np.swapaxes(ks, -1, -2)).astype(np.float64), half)
    elif order == "hf":
        y = r(r(raw) * scale)
    else:
        y = r(raw * scale)
    cap = call.logits.softcap
    if cap:
        # three half operations; autograd's slope 1 - t^2 from the rounded tanh t (zero
        # where t rounds to 1: a saturated cap passes no gradient in half)
        t = r(np.tanh(r(y / cap)))
        y = r(t * cap)
        capped = cap * np.tanh(scale * raw / cap)
        if order != "fused" and call.logits.score_mod is None:
            slope = r(1.0 - r(t * t))
    else:
        capped = scale * raw
    shift, shifts = 0.0, _shifts(problem)
    if shifts:                                 # the logits as the convention forms them
        shift = np.broadcast_to(np.asarray(shifts[-1], dtype=np.float64),
                                problem.q.shape[:-1])[..., None]
        if grouped is not None:
            shift = shift.reshape(*full.shape[:-2], n, 1)
    with np.errstate(invalid="ignore"):
        rest = np.where(np.isfinite(full), full - capped, 0.0) + shift
    added = y + rest if order in ("q", "k", "split", "fused") else r(y + r(rest))
    x = np.where(np.isfinite(full), np.where(rest != 0, added, y), full)
    if order in ("q", "k", "split"):           # attention_ref adds a float32 bias
        x = np.where(rest != 0, x.astype(np.float32), x)
    allowed = (np.ones(x.shape, dtype=bool) if allowed is None
               else np.broadcast_to(np.asarray(allowed), x.shape))
    return dict(x=x, allowed=allowed, slope=slope, q=qs, k=ks, v=v, ungroup=ungroup,
                scale=1.0 if order in ("q", "k", "split") else scale, order=order,
                shift=shifts[-1] if shifts else None)


def _half_forward(problem, half, order: str):
    r = lambda a: round_to(a, half)                               # noqa: E731
    f = _half_logits(problem, half, order)
    xs = np.where(f["allowed"], f["x"], -np.inf).astype(np.float32)
    m = np.max(xs, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    e = np.exp(xs - np.where(seen, m, 0.0).astype(np.float32))
    l = np.sum(e, axis=-1, keepdims=True, dtype=np.float32)
    p = np.where(seen, e / np.where(l > 0, l, 1), 0.0)            # float32 softmax
    p = p if order == "fused" else r(p)                             # half P
    f["out"] = r(p.astype(np.float32) @ f["v"])
    with np.errstate(divide="ignore"):
        f["lse"] = np.where(seen, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    f["p"] = p
    return f


#: Elements of the products a sequential sum holds at once (rows are taken in blocks).
SEQUENTIAL_BLOCK = 2 ** 22


def _sequential(problem, work, *, lse=False, half=None):
    """Exact attention with the softmax's row sum and every ``P V`` sum accumulated key by
    key in float32 (``np.cumsum`` adds left to right), as a plain loop or a kernel without
    pairwise or blocked reduction does: its error grows with the number of keys where a
    BLAS product's partial sums keep it small.  (A float64 result: the textbook form.)"""
    if work != "float32":
        return _textbook(problem, work, lse=lse)
    f = _half_logits(problem, "float32", "fused")
    xs = np.where(f["allowed"], f["x"], -np.inf).astype(np.float32)
    m = np.max(xs, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    e = np.exp(xs - np.where(seen, m, 0.0).astype(np.float32))
    l = np.cumsum(e, axis=-1, dtype=np.float32)[..., -1:]
    p = np.where(seen, e / np.where(l > 0, l, 1), 0.0).astype(np.float32)
    v = np.broadcast_to(f["v"], p.shape[:-2] + f["v"].shape[-2:])
    n, s, dv = p.shape[-2], p.shape[-1], v.shape[-1]
    step = max(1, SEQUENTIAL_BLOCK // max(1, s * dv * int(np.prod(p.shape[:-2]))))
    out = np.concatenate([np.cumsum(p[..., i:i + step, :, None] * v[..., None, :, :],
                                    axis=-2, dtype=np.float32)[..., -1, :]
                          for i in range(0, n, step)] or [np.zeros(p.shape[:-1] + (dv,))],
                         axis=-2)
    with np.errstate(divide="ignore"):
        l_out = np.where(seen, m + np.log(np.where(l > 0, l, 1)), -np.inf)[..., 0]
    out, l_out = _ungroup(f, out.astype(np.float64), l_out.astype(np.float64))
    if problem.rows is not None:
        out, l_out = out[..., problem.rows, :], l_out[..., problem.rows]
    if not lse:
        return out
    return (_with_shift(l_out, problem, True) if f["shift"] is None
            else _lse_as_port(l_out, problem, f["shift"]))


#: The rounding of each logit a plain evaluation forms, in units of the working
#: precision's epsilon: the scale applied to q, to k or to both (rounded), the dot product,
#: the result (torch SDPA's math path rounds q sqrt(scale) and k sqrt(scale)).
LOGIT_ROUNDINGS = 2.0


def logit_rounding_rms(problem, eps: float, *, lse: bool = False):
    r"""The output's (or lse's) error from rounding every logit a plain evaluation forms,
    by its standard deviation: with independent roundings :math:`\delta x_{ij}` of size
    :math:`c\,\epsilon\,|x_{ij} + \mathrm{shift}_i|`, to first order :math:`\delta o_{ic} =
    \sum_j P_{ij}\,\delta x_{ij}\,(v_{jc} - o_{ic})` and :math:`\delta L_i = \sum_j P_{ij}
    \delta x_{ij}`, whose standard deviations are
    :math:`igl(\sum_j P_{ij}^2 c^2\epsilon^2 |x_{ij}|^2 (v_{jc} - o_{ic})^2igr)^{1/2}` and
    the same without the value term.  Deterministic (no sampled perturbation to be lucky
    with): where a row's error rests on two or three large logits (far below zero, few
    keys) one sampled rounding pattern may sit far below the kernel's.  Exact attention
    only (``None`` otherwise)."""
    if not _exact_host(problem):
        return None
    f = _half_logits(problem, "float64", "fused")
    x = np.where(f["allowed"], f["x"], -np.inf)
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    e = np.exp(x - np.where(seen, m, 0.0))
    p = np.where(seen, e / np.where(seen, e.sum(axis=-1, keepdims=True), 1.0), 0.0)
    size = LOGIT_ROUNDINGS * eps * np.where(np.isfinite(x), np.abs(x), 0.0)
    w = (p * size) ** 2                                        # (..., n, s)
    if lse:
        res = np.sqrt(w.sum(axis=-1))
        return _ungroup(f, np.zeros(res.shape + (1,)), res)[1][..., problem.rows or
                                                               slice(None)]
    v = np.broadcast_to(f["v"].astype(np.float64), p.shape[:-2] + f["v"].shape[-2:])
    o = p @ v
    n, s_, dv = p.shape[-2], p.shape[-1], v.shape[-1]
    step = max(1, SEQUENTIAL_BLOCK // max(1, s_ * dv * int(np.prod(p.shape[:-2]))))
    out = np.concatenate([np.sqrt(np.einsum("...is,...isc->...ic", w[..., i:i + step, :], (
        v[..., None, :, :] - o[..., i:i + step, None, :]) ** 2))
        for i in range(0, n, step)] or [np.zeros(p.shape[:-1] + (dv,))], axis=-2)
    out = _ungroup(f, out, np.zeros(out.shape[:-1]))[0]
    return out if problem.rows is None else out[..., problem.rows, :]


def _exact_float32(problem) -> bool:
    return _exact_host(problem) and all(np.asarray(x).dtype.kind == "f"
                                        for x in (problem.q, problem.k, problem.v))


def _ungroup(f, out, lse):
    if f["ungroup"] is None:
        return out, lse
    o, l = f["ungroup"]((out, lse))
    return np.asarray(o), np.asarray(l)


def _sum_to(g, shape: tuple):
    """``g`` summed over the axes an argument of ``shape`` was broadcast along."""
    g = np.asarray(g, dtype=np.float64)
    if g.ndim > len(shape):
        g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, g.shape)) if a == 1 and b != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _all_half(order: str):
    def evaluate(problem, work, *, lse=False, half=None):
        f = _half_forward(problem, half, order)
        out, l = _ungroup(f, f["out"], f["lse"])
        if problem.rows is not None:
            out, l = out[..., problem.rows, :], l[..., problem.rows]
        if not lse:
            return out
        # the lse of the logits as formed, reported as the port reports its own
        return (_with_shift(l, problem, True) if f["shift"] is None
                else _lse_as_port(l, problem, f["shift"]))
    return evaluate


def _all_half_grads(order: str):
    """The backward of :func:`_half_forward` as a plain half evaluation computes it
    (autograd through half operations: each product rounded to ``half``)."""
    def evaluate(problem, do, half):
        r = lambda a: round_to(a, half)                           # noqa: E731
        f = _half_forward(problem, half, order)
        p, q, k, v = f["p"], f["q"], f["k"], f["v"]
        do = r(do).astype(np.float32)
        if f["ungroup"] is not None:          # do in the grouped layout of q
            do = do.reshape(q.shape[:-1] + (do.shape[-1],))
        mid = (lambda a: a) if order == "fused" else r    # intermediates rounded
        vt = np.broadcast_to(v, p.shape[:-2] + v.shape[-2:])
        dp = mid(do @ np.swapaxes(vt, -1, -2).astype(np.float32))
        # D as FlashAttention-2 forms it from the stored half output (the textbook and
        # fused forms), as autograd through softmax forms it from dP and P (the others)
        delta = (np.sum(do * f["out"], axis=-1, keepdims=True, dtype=np.float32)
                 if order in ("after", "fused") else
                 np.sum(dp * p, axis=-1, keepdims=True, dtype=np.float32))
        ds = mid(np.where(f["allowed"], p * (dp - delta), 0.0))
        if f["slope"] is not None:
            ds = mid(ds * np.asarray(f["slope"], dtype=np.float64))
        if order == "hf":               # through r(raw * scale): d raw = r(ds scale)
            ds = r(ds * f["scale"])
        ds32 = ds.astype(np.float32)
        kt = np.broadcast_to(k, p.shape[:-2] + k.shape[-2:]).astype(np.float32)
        dq = mid(ds32 @ kt)
        dk = mid(np.swapaxes(ds32, -1, -2) @ q.astype(np.float32))
        dv = mid(np.swapaxes(p, -1, -2).astype(np.float32) @ do)
        scale = f["scale"] if order in ("after", "fused") else _scale(problem)
        if order == "q":                # d(q scale) -> dq; k saw q already scaled
            dq = r(dq * scale)
        elif order == "k":
            dk = r(dk * scale)
        elif order == "split":
            dq, dk = r(dq * scale ** 0.5), r(dk * scale ** 0.5)
        elif order in ("after", "fused"):
            dq, dk = r(dq * scale), r(dk * scale)
        if order == "fused":
            dv = r(dv)
        if f["ungroup"] is not None:    # k, v broadcast over the group axis: sum it
            dk, dv = (np.sum(g, axis=-3) for g in (dk, dv))
            dq = dq.reshape(problem.q.shape)
        # arguments that broadcast (one key head for all): their gradient summed back
        return {"q": _sum_to(dq, problem.q.shape), "k": _sum_to(dk, problem.k.shape),
                "v": _sum_to(dv, problem.v.shape)}
    return evaluate


# -- the ensembles --------------------------------------------------------------------------

OUTPUT_FORMS = (
    Form("textbook", "the reference form in the working precision, inputs perturbed by one "
         "unit roundoff", False, _always, _textbook),
    Form("scale first", "the scale folded into q before the product (attention_ref)",
         False, _exact, _scale_first),
    Form("scale split", "the scale's square root on q and on k (torch SDPA's math path)",
         False, _exact, _scale_split),
    Form("logits as formed", "the logits larger by the convention's per-row constant "
         "(causal ALiBi as slope (j - s + 1))", False, _has_shift, _library_bias),
    Form("online softmax", f"FlashAttention's online softmax in tiles of {ONLINE_BLOCK}",
         False, _exact, _online),
    Form("sequential sums", "the softmax's sum and P V accumulated key by key in float32 "
         "(a plain loop)", False, _exact_float32, _sequential),
    Form("recurrent", "the gated recurrence, one token at a time", False, _gated,
         _method("recurrent")),
    Form("upcast", "inputs in the half dtype, computed in float32, rounded once "
         "(attention_ref(upcast=True), a fused kernel)", True, _always, _upcast),
    Form("half", "every intermediate in the half dtype: scores, softmax in float32 "
         "between half matmuls, output", True, _exact_host, _all_half("after")),
    Form("half, scale first", "every intermediate in the half dtype, the scale folded "
         "into q first (attention_ref(upcast=False))", True, _exact_host, _all_half("q")),
    Form("half, scale on k", "the scale folded into k first (attention_ref(upcast=False, "
         "reorder_ops=True))", True, _exact_host, _all_half("k")),
    Form("half, scale split", "the scale's square root on q and on k, in the half dtype "
         "(torch SDPA's math path)", True, _exact_host, _all_half("split")),
    Form("half, scores then scale", "matmul(q, k^T) rounded, then times the scale "
         "(Hugging Face's eager attention)", True, _exact_host, _all_half("hf")),
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
        results = form.evaluate(problem, work, lse=lse, half=half)
        for res in (results if inspect.isgenerator(results) else [results]):
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


def _grad_scale_split(vjp, args, options, work, how, problem):
    scale = float(options["scale"]) if options.get("scale") is not None else \
        args["q"].shape[-1] ** -0.5
    root = scale ** 0.5
    res = vjp(dict(args, q=args["q"] * root, k=args["k"] * root), dict(options, scale=1.0),
              work, None)
    return dict(res, q=res["q"] * root, k=res["k"] * root)


def _grad_online(vjp, args, options, work, how, problem):
    return vjp(args, dict(options, block_size=ONLINE_BLOCK), work, None)


def _grad_library_bias(vjp, args, options, work, how, problem):
    for shift in _shifts(problem):
        p = replace(problem, options=options)
        yield vjp(args, _shifted_logits(p, shift), work, None)


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
    Form("scale split", "the scale's square root on q and on k", False, _exact,
         _grad_scale_split),
    Form("logits as formed", "the logits larger by the convention's per-row constant",
         False, lambda p: _has_shift(p) and p.rows is None, _grad_library_bias),
    Form("online softmax", "FlashAttention-2's blockwise backward", False, _exact,
         _grad_online),
    Form("recurrent", "the gated recurrence's backward", False, _gated,
         _grad_method("recurrent")),
    Form("gate by cumulative sums", "dg = reverse cumsum(q dq - k dk), as fla's chunk "
         "kernels form it", False, _gate_problem, _grad_gate_cumsum),
    Form("half", "a plain half backward, D from the stored output (FlashAttention-2)",
         True, _exact_host, _all_half_grads("after")),
    Form("half, scale first", "autograd through attention_ref(upcast=False)", True,
         _exact_host, _all_half_grads("q")),
    Form("half, scale on k", "autograd through attention_ref(upcast=False, "
         "reorder_ops=True)", True, _exact_host, _all_half_grads("k")),
    Form("fused, stored output", "a fused kernel's float32 backward, D from the output "
         "stored in the half dtype (FlashAttention-2)", True, _exact_host,
         _all_half_grads("fused")),
    Form("half, scale split", "autograd through torch SDPA's math path in half", True,
         _exact_host, _all_half_grads("split")),
    Form("half, scores then scale", "autograd through Hugging Face's eager attention",
         True, _exact_host, _all_half_grads("hf")),
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
        for one in (res if inspect.isgenerator(res) else [res]):
            for name, g in one.items():
                if name in worst and np.shape(g) == np.shape(ref[name]):
                    worst[name] = np.maximum(worst[name], _worst([g], ref[name]))
        if covered is not None and not rounding.MEASURE_ALWAYS and covered(worst):
            break
    return worst
