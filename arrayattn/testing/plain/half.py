"""Plain evaluations of exact attention from its logits pipeline in a low precision: every
intermediate rounded to the half dtype as FlashAttention's ``attention_ref(upcast=False)``,
Hugging Face's eager attention and torch SDPA's math path round them (forward, and
backward as autograd computes it), a fused kernel's float32 backward with the output
stored in half, float32 sums accumulated key by key, and the logits' rounding by its
standard deviation."""
from __future__ import annotations

import numpy as np

from ..measures import cast_floating, round_to
from .problems import exact_host, lse_as_port, logit_scale_of, shifts, with_shift
from .working import textbook

__all__ = ["LOGIT_ROUNDINGS", "ORDERS", "SEQUENTIAL_BLOCK", "all_half", "all_half_grads",
           "as_port", "port_rows", "half_forward", "half_logits", "logit_rounding_rms",
           "sequential", "sum_to", "ungroup", "upcast"]

# -- half-precision forms (the same-dtype rule) ------------------------------------------

def upcast(problem, work, *, lse=False, half=None):
    own = problem.evaluate("float32", lambda x: round_to(x, half), lse=lse)
    return own if lse else round_to(own, half)   # an lse stays float32 in every kernel


#: Where a plain half evaluation applies the scale: to the scores after the product
#: (``"after"``, rounded once), to ``q`` first (``attention_ref(upcast=False)``), to ``k``
#: first (its ``reorder_ops=True``), to the scores rounded after the product and again
#: after the scale (``"hf"``: Hugging Face's eager ``matmul(q, k^T) * scaling``), its
#: square root on both (``"split"``: torch SDPA's math path); or
#: ``"fused"``: a fused kernel's float32 scores, probabilities and ``dP``, with the output
#: stored in the half dtype and ``D = rowsum(dO O)`` formed from it (FlashAttention-2).
ORDERS = ("after", "q", "k", "split", "hf", "fused")


def half_logits(problem, half, order: str):
    """Exact attention's logits as a plain half evaluation forms them, from the inputs
    rounded to ``half`` (grouped heads split as the reference splits them): a dict with
    ``x`` (the scores: the product rounded as ``order`` rounds it, the soft cap as three
    half operations, then what the pipeline adds -- bias, ALiBi, masks -- added in half,
    or in float32 after ``attention_ref``'s float32 bias), ``allowed``, ``slope`` (``dx /
    d raw``), the float32 ``q, k, v`` the products read (the scaled one rounded),
    ``ungroup``, ``scale`` (the factor left on the product: 1 when folded into an input)."""
    from ...core.heads import group_heads
    from ...exact.checks import checked_call
    from ...reference.logits import tile_logits

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
    full, allowed, slope = tile_logits(call.logits, q, k, 0, q.shape[-2], 0, k.shape[-2],
                                       slope=True)
    full = np.asarray(full, dtype=np.float64)
    qs, ks, raw, y = _scores(q, k, call.logits.scale, order, half, r)
    y, capped, slope = _soft_cap(y, raw, call.logits, order, r, slope)
    formed = shifts(problem)
    x = _added(full, y, capped, _row_shift(problem, formed, full.shape), order, r)
    allowed = (np.ones(x.shape, dtype=bool) if allowed is None
               else np.broadcast_to(np.asarray(allowed), x.shape))
    return dict(x=x, allowed=allowed, slope=slope, q=qs, k=ks, v=v, ungroup=ungroup,
                scale=1.0 if order in ("q", "k", "split") else call.logits.scale,
                order=order, shift=formed[-1] if formed else None)


def _scores(q, k, scale, order, half, r):
    """``(q, k as the product reads them, the exact product, the scores as formed)``."""
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
    return qs, ks, raw, y


def _soft_cap(y, raw, logits, order, r, slope):
    """``(scores capped, the exact capped scores, slope)``: three half operations;
    autograd's slope ``1 - t^2`` from the rounded tanh ``t`` (zero where ``t`` rounds to
    1: a saturated cap passes no gradient in half)."""
    cap, scale = logits.softcap, logits.scale
    if not cap:
        return y, scale * raw, slope
    t = r(np.tanh(r(y / cap)))
    if order != "fused" and logits.score_mod is None:
        slope = r(1.0 - r(t * t))
    return r(t * cap), cap * np.tanh(scale * raw / cap), slope


def _row_shift(problem, formed, shape):
    """The per-row constant of the logits as the convention forms them, ``(..., n, 1)``."""
    if not formed:
        return 0.0
    shift = np.broadcast_to(np.asarray(formed[-1], dtype=np.float64),
                            problem.q.shape[:-1])[..., None]
    return shift.reshape(*shape[:-2], shape[-2], 1)


def _added(full, y, capped, shift, order, r):
    """The scores with what the pipeline adds after them (bias, ALiBi, masks: ``full -
    capped``) added in half, or in float32 after ``attention_ref``'s float32 bias."""
    with np.errstate(invalid="ignore"):
        rest = np.where(np.isfinite(full), full - capped, 0.0) + shift
    added = y + rest if order in ("q", "k", "split", "fused") else r(y + r(rest))
    x = np.where(np.isfinite(full), np.where(rest != 0, added, y), full)
    if order in ("q", "k", "split"):
        x = np.where(rest != 0, x.astype(np.float32), x)
    return x


def half_forward(problem, half, order: str):
    r = lambda a: round_to(a, half)                               # noqa: E731
    f = half_logits(problem, half, order)
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


def sequential(problem, work, *, lse=False, half=None):
    """Exact attention with the softmax's row sum and every ``P V`` sum accumulated key by
    key in float32 (``np.cumsum`` adds left to right), as a plain loop or a kernel without
    pairwise or blocked reduction does: its error grows with the number of keys where a
    BLAS product's partial sums keep it small.  (A float64 result: the textbook form.)"""
    if work != "float32":
        return textbook(problem, work, lse=lse)
    f = half_logits(problem, "float32", "fused")
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
    return as_port(problem, f, out, l_out, lse)


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
    :math:`\bigl(\sum_j w_{ij} (v_{jc} - o_{ic})^2\bigr)^{1/2}`, :math:`w_{ij} = P_{ij}^2
    c^2\epsilon^2 |x_{ij}|^2`, and :math:`(\sum_j w_{ij})^{1/2}`.  Deterministic (no
    sampled perturbation to be lucky with): where a row's error rests on two or three
    large logits (far below zero, few keys) one sampled rounding pattern may sit far below
    the kernel's.  Exact attention only (``None`` otherwise)."""
    if not exact_host(problem):
        return None
    f = half_logits(problem, "float64", "fused")
    x = np.where(f["allowed"], f["x"], -np.inf)
    m = np.max(x, axis=-1, keepdims=True, initial=-np.inf)
    seen = np.isfinite(m)
    e = np.exp(x - np.where(seen, m, 0.0))
    p = np.where(seen, e / np.where(seen, e.sum(axis=-1, keepdims=True), 1.0), 0.0)
    size = LOGIT_ROUNDINGS * eps * np.where(np.isfinite(x), np.abs(x), 0.0)
    w = (p * size) ** 2                                        # (..., n, s)
    total = w.sum(axis=-1, keepdims=True)
    if lse:
        return port_rows(problem, f, np.zeros(total.shape), np.sqrt(total[..., 0]))[1]
    v = f["v"].astype(np.float64)
    o = p @ v
    # sum_j w_ij (v_jc - o_ic)^2, expanded into products (rounding below the estimate's
    # own precision can make it slightly negative where every v_j is o_i: 0 there)
    var = w @ (v * v) - 2.0 * o * (w @ v) + o * o * total
    return port_rows(problem, f, np.sqrt(np.maximum(var, 0.0)), np.zeros(o.shape[:-1]))[0]


def port_rows(problem, f, out, l_out) -> tuple:
    """``(out, per-row values)`` of an evaluation from :func:`half_logits`'s ``f`` in the
    port's layout: heads ungrouped, the profile's rows taken."""
    out, l_out = ungroup(f, np.asarray(out, dtype=np.float64),
                         np.asarray(l_out, dtype=np.float64))
    if problem.rows is not None:
        out, l_out = out[..., problem.rows, :], l_out[..., problem.rows]
    return out, l_out


def as_port(problem, f, out, l_out, lse: bool):
    """The output (or, with ``lse``, the log-sum-exp) as the port reports it
    (:func:`port_rows`), the lse of the logits as formed with the port's own shift."""
    out, l_out = port_rows(problem, f, out, l_out)
    if not lse:
        return out
    return (with_shift(l_out, problem, True) if f["shift"] is None
            else lse_as_port(l_out, problem, f["shift"]))


def ungroup(f, out, lse):
    if f["ungroup"] is None:
        return out, lse
    o, l = f["ungroup"]((out, lse))
    return np.asarray(o), np.asarray(l)


def sum_to(g, shape: tuple):
    """``g`` summed over the axes an argument of ``shape`` was broadcast along."""
    g = np.asarray(g, dtype=np.float64)
    if g.ndim > len(shape):
        g = g.sum(axis=tuple(range(g.ndim - len(shape))))
    axes = tuple(i for i, (a, b) in enumerate(zip(shape, g.shape)) if a == 1 and b != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def all_half(order: str):
    def evaluate(problem, work, *, lse=False, half=None):
        f = half_forward(problem, half, order)
        return as_port(problem, f, f["out"], f["lse"], lse)
    return evaluate


def all_half_grads(order: str):
    """The backward of :func:`half_forward` as a plain half evaluation computes it
    (autograd through half operations: each product rounded to ``half``)."""
    def evaluate(problem, do, half):
        r = lambda a: round_to(a, half)                           # noqa: E731
        f = half_forward(problem, half, order)
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
        scale = f["scale"] if order in ("after", "fused") else logit_scale_of(problem)
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
        return {"q": sum_to(dq, problem.q.shape), "k": sum_to(dk, problem.k.shape),
                "v": sum_to(dv, problem.v.shape)}
    return evaluate
