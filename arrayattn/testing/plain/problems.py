"""What a problem is, for the plain evaluations (:mod:`arrayattn.testing.plain`): exact
or gated, its scale, its reference on host arrays, the per-row constants a convention adds
to its logits."""
from __future__ import annotations

import inspect

import numpy as np

__all__ = ["always", "exact_float32", "exact_host", "gate_name", "has_shift", "is_exact",
           "is_gated", "logit_scale_of", "lse_as_port", "shifted_logits",
           "shifts", "with_shift"]

# -- what a problem is -------------------------------------------------------------------

def is_exact(problem) -> bool:
    return problem.name == "softmax"


def is_gated(problem) -> bool:
    from ...registry import get_variant
    try:
        rec = get_variant(problem.name)
    except (ValueError, KeyError):
        return False
    return rec.family == "gated" and "method" in inspect.signature(rec.fn).parameters


def gate_name(problem):
    """The log-gate option of a gated problem that enters as ``exp`` of its cumulative sum
    (GLA's ``g (..., n, K)``, SSD's ``a (..., n)``), or ``None``."""
    for name in ("g", "a"):
        if problem.name in ("gla", "ssd") and problem.options.get(name) is not None:
            return name
    return None


def always(problem) -> bool:
    return True


def logit_scale_of(problem) -> float:
    scale = problem.options.get("scale")
    return float(scale) if scale is not None else problem.q.shape[-1] ** -0.5


def with_shift(res, problem, lse: bool):
    return res + problem.lse_shift if lse and problem.lse_shift is not None else res


def shifts(problem) -> list:
    """The per-row constants the convention's forms add to exact attention's logits: the
    port's own (:attr:`Problem.lse_shift`, its lse includes it) and those of the forms its
    authors ship (:attr:`Problem.form_shifts`)."""
    if not is_exact(problem):
        return []
    own = [] if problem.lse_shift is None else [problem.lse_shift]
    return own + [s for s in problem.form_shifts if s is not None]


def shifted_logits(problem, shift):
    """The options with a per-row constant added as a bias: softmax-invariant, rounded at
    that size."""
    shift = np.asarray(shift, dtype=np.float64)[..., None]
    n, s = problem.q.shape[-2], problem.k.shape[-2]
    bias = problem.options.get("bias")
    shape = np.broadcast_shapes(shift.shape[:-2] + (n, s), problem.q.shape[:-2] + (n, s),
                                np.shape(bias) if bias is not None else ())
    full = np.broadcast_to(shift, shape) + (0.0 if bias is None else bias)
    return dict(problem.options, bias=np.ascontiguousarray(full))


def lse_as_port(lse, problem, shift):
    """The lse of logits larger by ``shift`` as the port reports it (its own shift)."""
    own = 0.0 if problem.lse_shift is None else problem.lse_shift
    return lse - np.asarray(shift, dtype=np.float64) + own


def has_shift(problem) -> bool:
    return bool(shifts(problem))


def exact_host(problem) -> bool:
    """Exact attention whose options are host data (no torch-written ``score_mod``)."""
    return is_exact(problem) and problem.convert is None and \
        problem.options.get("dropout_mask") is None



def exact_float32(problem) -> bool:
    return exact_host(problem) and all(np.asarray(x).dtype.kind == "f"
                                        for x in (problem.q, problem.k, problem.v))
