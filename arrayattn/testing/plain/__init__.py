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
  ``attention_ref``), its square root on ``q`` and on ``k`` (torch SDPA's math path), the
  logits larger by the per-row constant a convention forms them with (the kernel's causal
  ALiBi ``+slope j``, ``attention_ref``'s ``slope (j - s + 1)``:
  :attr:`Problem.lse_shift`, :attr:`Problem.form_shifts`), FlashAttention's online
  softmax in tiles of 16, and the sums accumulated key by key in float32 (a plain loop);
  for the gated family the recurrence beside the reference's chunk form, and the gate
  gradient as fla's chunk kernels form it, a reverse cumulative sum of :math:`q \odot dq -
  k \odot dk`.  The referee adds the logits' rounding by its standard deviation
  (:func:`logit_rounding_rms`) and the response to rounding where they are larger.
* **half** (the ``same-dtype`` rule, float16/bfloat16): inputs in the half dtype computed
  in float32 and rounded once (``attention_ref(upcast=True)``, a fused kernel); for exact
  attention also every intermediate rounded to the half dtype -- scores, probabilities
  (softmax computed in float32 between half matmuls), output, and in the backward ``dP``,
  ``dS`` and each gradient -- with the scale after the product, folded into ``q``
  (``attention_ref(upcast=False)``) or ``k`` (its ``reorder_ops``), split between them
  (SDPA's math path), or after a rounded product (Hugging Face's eager attention); and a
  fused float32 backward with ``D = rowsum(dO O)`` from the output stored in half.

Members run in order and stop as soon as every head is covered (more can only raise the
baseline).

:func:`output_baseline` and :func:`grad_baseline` return the elementwise worst error of
the ensemble against the float64 reference.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..measures import round_to
from .half import (all_half, all_half_grads, logit_rounding_rms, sequential, upcast)
from .problems import always, exact_float32, exact_host, has_shift, is_exact, is_gated
from .working import (ONLINE_BLOCK, gate_problem, grad_gate_cumsum, grad_library_bias,
                      grad_method, grad_online, grad_scale_first, grad_scale_split,
                      grad_textbook, library_bias, method, online, scale_first,
                      scale_split, textbook)

__all__ = ["Form", "OUTPUT_FORMS", "GRAD_FORMS", "output_baseline", "grad_baseline",
           "forms_for", "logit_rounding_rms", "ONLINE_BLOCK"]


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


# -- the ensembles --------------------------------------------------------------------------

OUTPUT_FORMS = (
    Form("textbook", "the reference form in the working precision, inputs perturbed by one "
         "unit roundoff", False, always, textbook),
    Form("scale first", "the scale folded into q before the product (attention_ref)",
         False, is_exact, scale_first),
    Form("scale split", "the scale's square root on q and on k (torch SDPA's math path)",
         False, is_exact, scale_split),
    Form("logits as formed", "the logits larger by the convention's per-row constant "
         "(causal ALiBi as slope (j - s + 1))", False, has_shift, library_bias),
    Form("online softmax", f"FlashAttention's online softmax in tiles of {ONLINE_BLOCK}",
         False, is_exact, online),
    Form("sequential sums", "the softmax's sum and P V accumulated key by key in float32 "
         "(a plain loop)", False, exact_float32, sequential),
    Form("recurrent", "the gated recurrence, one token at a time", False, is_gated,
         method("recurrent")),
    Form("upcast", "inputs in the half dtype, computed in float32, rounded once "
         "(attention_ref(upcast=True), a fused kernel)", True, always, upcast),
    Form("half", "every intermediate in the half dtype: scores, softmax in float32 "
         "between half matmuls, output", True, exact_host, all_half("after")),
    Form("half, scale first", "every intermediate in the half dtype, the scale folded "
         "into q first (attention_ref(upcast=False))", True, exact_host, all_half("q")),
    Form("half, scale on k", "the scale folded into k first (attention_ref(upcast=False, "
         "reorder_ops=True))", True, exact_host, all_half("k")),
    Form("half, scale split", "the scale's square root on q and on k, in the half dtype "
         "(torch SDPA's math path)", True, exact_host, all_half("split")),
    Form("half, scores then scale", "matmul(q, k^T) rounded, then times the scale "
         "(Hugging Face's eager attention)", True, exact_host, all_half("hf")),
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
    from .. import rounding
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


GRAD_FORMS = (
    Form("textbook", "the reference backward in the working precision, inputs perturbed",
         False, always, grad_textbook),
    Form("scale first", "the scale folded into q first", False, is_exact, grad_scale_first),
    Form("scale split", "the scale's square root on q and on k", False, is_exact,
         grad_scale_split),
    Form("logits as formed", "the logits larger by the convention's per-row constant",
         False, lambda p: has_shift(p) and p.rows is None, grad_library_bias),
    Form("online softmax", "FlashAttention-2's blockwise backward", False, is_exact,
         grad_online),
    Form("recurrent", "the gated recurrence's backward", False, is_gated,
         grad_method("recurrent")),
    Form("gate by cumulative sums", "dg = reverse cumsum(q dq - k dk), as fla's chunk "
         "kernels form it", False, gate_problem, grad_gate_cumsum),
    Form("half", "a plain half backward, D from the stored output (FlashAttention-2)",
         True, exact_host, all_half_grads("after")),
    Form("half, scale first", "autograd through attention_ref(upcast=False)", True,
         exact_host, all_half_grads("q")),
    Form("half, scale on k", "autograd through attention_ref(upcast=False, "
         "reorder_ops=True)", True, exact_host, all_half_grads("k")),
    Form("fused, stored output", "a fused kernel's float32 backward, D from the output "
         "stored in the half dtype (FlashAttention-2)", True, exact_host,
         all_half_grads("fused")),
    Form("half, scale split", "autograd through torch SDPA's math path in half", True,
         exact_host, all_half_grads("split")),
    Form("half, scores then scale", "autograd through Hugging Face's eager attention",
         True, exact_host, all_half_grads("hf")),
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
    from .. import rounding
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
