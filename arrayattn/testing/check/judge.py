"""The checker's judge: the only place that calls the referee (the output, log-sum-exp and
gradient referees of ``validate``), on what a convention's call returned."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import grads as _grads
from .. import outputs as _outputs
from ..rounding import sensitivity
from ..measures import (EPS, Nudge, cast_floating, derived_tolerance, dtype_name, head_errors,
                        host64, own_head_error, working_dtype)
from ..comparison import Comparison
from ..problem import prepare
from .conventions.base import host

__all__ = ["Verdict", "judge", "judge_inputs", "grad_options", "ratio", "compare_state",
           "compare_port_grads"]


def ratio(c: Comparison) -> float:
    """The worst error / tolerance of a comparison (inf for a non-finite error), against
    the tolerance that decided each head: the float64 rule's for a gradient head that
    passes as LESS ACCURATE."""
    tol = c.tolerance
    if c.lenient is not None and not c.strict and c.less_accurate:
        tol = np.where(np.isin(np.arange(len(c.heads)), c.less_accurate), c.lenient, tol)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(np.isfinite(c.max_abs), c.max_abs / np.maximum(tol, 1e-300), np.inf)
    return float(np.max(r, initial=0.0))


@dataclass
class Verdict:
    """The comparisons of one case (``items``: ``[(label, Comparison)]``: ``out``, ``lse``,
    ``final_state``, ``dq`` ...) or the ``error`` the kernel raised."""

    items: list = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for _, c in self.items)

    @property
    def worst(self) -> float:
        """The largest error / tolerance over every comparison (inf after an error)."""
        if self.error is not None:
            return float("inf")
        return max((ratio(c) for _, c in self.items), default=0.0)

    def failing(self) -> list:
        return [(label, c) for label, c in self.items if not c.ok]

    def lines(self, limit: int = 3) -> list:
        """The failing comparisons, their worst heads (rows, error vs tolerance)."""
        if self.error is not None:
            return [self.error]
        out = []
        for label, c in self.failing():
            out.append(f"{label}: {c.verdict()}")
            out += [f"    {label} {c.head_line(i)}" for i in c.failing[:limit]]
        return out


def judge_inputs(call) -> dict:
    """q, k, v, do as the referee reads them (host float64, ``call.layout``)."""
    if call.inputs is not None:
        return call.inputs
    return {name: host(call.tensors[name]) for name in ("q", "k", "v", "do")}


def grad_options(call, x: dict) -> dict:
    """arrayattn's options for the gradient referee: the convention's, else the profile's
    mapping of the port's options (one line to drop once compare_grads takes profile=)."""
    if call.grad_params is not None:
        return call.grad_params
    problem = prepare(None, x["q"], x["k"], x["v"], layout=call.layout, profile=call.profile,
                      params=call.params)
    return dict(problem.options)  # with compare_grads(profile=): call.params


def compare_port_grads(grads: dict, profile, q, k, v, do, /, *, layout=None, **kwargs):
    """:func:`~arrayattn.testing.compare_grads` of a port's gradients, its options
    (``**kwargs`` besides ``rtol``, ``atol``, ``rule``, ``factor``) mapped onto arrayattn's
    by the ``profile`` (``validate --profile`` with gradients in the file)."""
    return _grads.compare_grads(grads, None, q, k, v, do, layout=layout, profile=profile,
                                **kwargs)


def _output_items(call, conv, x, results) -> list:
    variant = None if call.profile else call.variant
    kw = dict(layout=call.layout, profile=call.profile, **call.params)
    items = [("out", _outputs.compare_to_reference(conv.to_judge("out", results["out"]),
                                                   variant, x["q"], x["k"], x["v"], **kw))]
    if results.get("lse") is not None:
        items.append(("lse", _outputs.compare_lse(results["lse"], variant, x["q"], x["k"],
                                                  x["v"], **kw)))
    if call.state is not None:
        state = results.get("final_state")
        if state is None:
            raise ValueError("output_final_state=True but the kernel returned no final state")
        items.append(("final_state", compare_state(state, call.variant, x, call.state)))
    return items


def compare_state(theirs: np.ndarray, variant: str, x: dict, options: dict) -> Comparison:
    """The final state ``(..., dk, dv)`` against the variant's reference
    (``return_state=True``) in float64, the tolerance from arrayattn's own state in the
    working precision on inputs perturbed by one unit roundoff (as for outputs)."""
    from ...registry import get_variant

    return _state_comparison(get_variant(variant), theirs, x, options, dtype_name(theirs))


def _state_comparison(rec, theirs, x, options, dtype) -> Comparison:
    args = {k: x[k] for k in ("q", "k", "v")}

    def state(work, nudge=None, options_too=False):
        a = cast_floating(args, work, nudge)
        o = cast_floating(options, work, nudge if options_too else None)
        res = rec.reference(a["q"], a["k"], a["v"], return_state=True, **o)[1]
        return np.asarray(res, dtype=np.float64)

    ref = state("float64")
    theirs = host64(theirs)
    if theirs.shape != ref.shape:
        raise ValueError(f"final_state has shape {theirs.shape}; the reference's is {ref.shape}")
    errors = head_errors(np.abs(theirs - ref), ref)
    work = working_dtype(dtype)
    own, _ = own_head_error(state(work, Nudge(work)), ref, len(errors.heads))
    # the response to rounding, as for outputs (arrayattn.testing.rounding)
    jitter = sensitivity(lambda j: state("float64", j, options_too=True), ref, EPS[work])
    own = np.maximum(own, own_head_error(ref + jitter, ref, len(errors.heads))[0])
    tol = derived_tolerance(errors, own, dtype, rtol=None, atol=0.0)
    return Comparison.of(f"{rec.name} final_state", dtype, errors, tol, own)


def judge(call, conv, results: dict, grads: dict) -> Verdict:
    """The verdict on one call: output, lse, final state, gradients (the kernel's own
    arrays: their dtype sets the tolerance)."""
    x = judge_inputs(call)
    items = _output_items(call, conv, x, results)
    if grads:
        theirs = {call.rename.get(k, k): conv.to_judge(k, g)
                  for k, g in grads.items()}
        if call.grad_params is None and call.profile is not None:
            gc = _grads.compare_grads(theirs, None, x["q"], x["k"], x["v"], x["do"],
                                      layout=call.layout, profile=call.profile, **call.params)
        else:
            gc = _grads.compare_grads(theirs, call.variant, x["q"], x["k"], x["v"], x["do"],
                                      layout=call.layout, **grad_options(call, x))
        items += [(f"d{name}", c) for name, c in gc.items.items()]
    return Verdict(items)
