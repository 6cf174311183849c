"""The plain evaluations in the working precision (the ``float64`` rule): the reference
forms in other orders -- the scale first or split, an online softmax, the logits as a
convention forms them, the gated recurrence -- forward and backward."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..measures import Nudge
from .problems import gate_name, lse_as_port, logit_scale_of, shifted_logits, shifts

#: FlashAttention's tiles are 64-128 rows; 16 makes the online softmax merge several
#: tiles on the checker's small cases too.
ONLINE_BLOCK = 16

__all__ = ["ONLINE_BLOCK", "gate_problem", "grad_gate_cumsum", "grad_library_bias",
           "grad_method", "grad_online", "grad_scale_first", "grad_scale_split",
           "grad_textbook", "library_bias", "method", "online", "scale_first",
           "scale_split", "textbook"]

# -- working-precision forms (the float64 rule) -------------------------------------------

def textbook(problem, work, *, lse=False, half=None):
    return problem.evaluate(work, Nudge(work), lse=lse)


def scale_first(problem, work, *, lse=False, half=None):
    scale = logit_scale_of(problem)
    return replace(problem, q=problem.q * scale,
                   options=dict(problem.options, scale=1.0)).evaluate(work, lse=lse)


def scale_split(problem, work, *, lse=False, half=None):
    root = logit_scale_of(problem) ** 0.5
    return replace(problem, q=problem.q * root, k=problem.k * root,
                   options=dict(problem.options, scale=1.0)).evaluate(work, lse=lse)


def online(problem, work, *, lse=False, half=None):
    return replace(problem, options=dict(problem.options, block_size=ONLINE_BLOCK)).evaluate(
        work, lse=lse)


def library_bias(problem, work, *, lse=False, half=None):
    for shift in shifts(problem):
        # the logits larger by the shift; their lse as the port reports its own
        res = replace(problem, options=shifted_logits(problem, shift),
                      lse_shift=None).evaluate(work, lse=lse)
        yield lse_as_port(res, problem, shift) if lse else res


def method(method, chunk=None):
    def evaluate(problem, work, *, lse=False, half=None):
        opts = dict(problem.options, method=method)
        if chunk is not None:
            opts["chunk_size"] = chunk
        return replace(problem, options=opts).evaluate(work, lse=lse)
    return evaluate


# -- gradients ---------------------------------------------------------------------------------

def grad_textbook(vjp, args, options, work, how, problem):
    return vjp(args, options, work, Nudge(work))


def grad_scale_first(vjp, args, options, work, how, problem):
    scale = float(options["scale"]) if options.get("scale") is not None else \
        args["q"].shape[-1] ** -0.5
    res = vjp(dict(args, q=args["q"] * scale), dict(options, scale=1.0), work, None)
    return dict(res, q=res["q"] * scale)


def grad_scale_split(vjp, args, options, work, how, problem):
    scale = float(options["scale"]) if options.get("scale") is not None else \
        args["q"].shape[-1] ** -0.5
    root = scale ** 0.5
    res = vjp(dict(args, q=args["q"] * root, k=args["k"] * root), dict(options, scale=1.0),
              work, None)
    return dict(res, q=res["q"] * root, k=res["k"] * root)


def grad_online(vjp, args, options, work, how, problem):
    return vjp(args, dict(options, block_size=ONLINE_BLOCK), work, None)


def grad_library_bias(vjp, args, options, work, how, problem):
    for shift in shifts(problem):
        p = replace(problem, options=options)
        yield vjp(args, shifted_logits(p, shift), work, None)


def grad_method(method, chunk=None):
    def evaluate(vjp, args, options, work, how, problem):
        opts = dict(options, method=method)
        if chunk is not None:
            opts["chunk_size"] = chunk
        return vjp(args, opts, work, None)
    return evaluate


def grad_gate_cumsum(vjp, args, options, work, how, problem):
    r"""fla's chunk kernels form the log-gate gradient from the other two: with
    ``G = cumsum g`` entering as ``q e^G`` and ``k e^-G``, :math:`\partial L / \partial
    G_t = q_t \odot dq_t - k_t \odot dk_t` and ``dg`` is its reverse cumulative sum
    (summed over features for a scalar gate) -- O(1) terms cancelling in the working
    precision where the exact gradient is tiny."""
    name = gate_name(problem)
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


def gate_problem(problem) -> bool:
    return gate_name(problem) is not None and problem.options.get("key_mask") is None
