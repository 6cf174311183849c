"""What a finding means (issue #50): the *named deviation* a kernel's results match -- the
softmax scale applied twice, causal aligned top-left, grouped heads tiled, the lse in base
2 ... -- and which of the smallest case's dimensions the failure needs.

After the search has shrunk a finding, :func:`explain` varies each dimension of the smallest
case (the seed, the magnitude, the dtype, the lengths, the heads, each active option off:
a handful of evaluations, in the manner of Hypothesis' explain phase) and says under which
the failure persists.  Then it re-evaluates the float64 reference under each entry of
:data:`DEVIATIONS` on the smallest failing case and on a few of those other failing cases,
and names the entries that the kernel's results equal, within the tolerance of the judge's
original comparison, on every one of them: a coincidence on one tiny case does not name
the wrong mistake.

A deviation is data: a name, a sentence, and a transformation of the reference problem --
of the port's options (``port``), of arrayattn's problem once the profile mapped them
(``native``, a :class:`~arrayattn.testing.problem.Problem`), of the reference's result
(``result``) or of the reference gradients (``grads``) -- which returns ``None`` where the
deviation does not apply (an option the case does not use, a convention it cannot occur
in).  Adding one is one entry of :data:`DEVIATIONS`.

Examples
--------
>>> from arrayattn.testing.check.explain import DEVIATIONS
>>> [d.name for d in DEVIATIONS][:3]
['scale_twice', 'scale_one', 'scale_sqrt_dv']
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..measures import host64
from ..problem import Problem, prepare, to_bhnd
from .cases import MAGNITUDES
from .conventions.base import host
from .judge import judge, judge_inputs, grad_options

__all__ = ["Deviation", "DEVIATIONS", "Explanation", "explain", "match_deviations",
           "dimensions", "run_case"]


# -- the record ------------------------------------------------------------------------
@dataclass(frozen=True)
class Deviation:
    """A named mistake: ``name``, the ``sentence`` printed, and its transformation of the
    reference problem (each hook returns ``None`` where the deviation does not apply).

    ``port(params, x, ctx)`` -> ``(params, x)``: the port's options and inputs;
    ``native(problem, ctx)`` -> problem: arrayattn's problem after the profile's mapping;
    ``result(label, ref, problem, ctx)`` -> array: the reference result ``label``
    (``"out"``, ``"lse"``, ``"dk"`` ...) under the deviation;
    ``grads(rec, args, options, how, ctx)`` -> dict: the reference gradients.
    ``items``: the results it changes (``None``: all, gradients included); the others must
    have matched already.  ``conventions``: the conventions it can occur in (empty: all)."""

    name: str
    sentence: str
    port: Callable | None = None
    native: Callable | None = None
    result: Callable | None = None
    grads: Callable | None = None
    items: tuple | None = None
    conventions: tuple = ()


@dataclass
class Ctx:
    """What a transformation may read: the case, the convention and its call."""

    case: object
    conv: object
    call: object

    @property
    def opts(self) -> dict:
        return self.case.active()

    def explicit_scale(self) -> bool:
        o = self.opts
        return bool(o.get("scale") or o.get("softmax_scale"))


# -- helpers on a problem ----------------------------------------------------------------
def _with(p: Problem, **changes) -> Problem:
    """``p`` with options changed (``None`` removes one)."""
    o = dict(p.options)
    for key, val in changes.items():
        if val is None:
            o.pop(key, None)
        else:
            o[key] = val
    return replace(p, options=o)


def _softmax(p: Problem) -> bool:
    return p.name == "softmax" and p.options.get("score_mod") is None


def _plain(p: Problem) -> bool:
    """Exact softmax of unpacked, unpaged sequences."""
    return _softmax(p) and p.options.get("cu_seqlens_q") is None


def _scale(p: Problem) -> float:
    s = p.options.get("scale")
    return float(s) if s is not None else p.q.shape[-1] ** -0.5


def _tanh(x):
    return x.tanh() if hasattr(x, "tanh") else np.tanh(x)


def _where(cond, a, b):
    if hasattr(a, "detach"):
        import torch
        return torch.where(torch.as_tensor(cond), a, torch.as_tensor(b, dtype=a.dtype))
    return np.where(cond, a, b)


def _window(p: Problem) -> tuple:
    """The effective ``(left, right)`` bounds (``None``: unbounded), causal folded in."""
    left, right = p.options.get("window") or (None, None)
    left = None if left is None or left < 0 else int(left)
    right = None if right is None or right < 0 else int(right)
    if p.options.get("causal"):
        right = 0 if right is None else min(right, 0)
    return left, right


def _ij(p: Problem):
    n, s = p.q.shape[-2], p.k.shape[-2]
    return np.arange(n)[:, None], np.arange(s)[None, :]


def _and_mask(p: Problem, mask: np.ndarray) -> Problem:
    old = p.options.get("mask")
    return _with(p, mask=mask if old is None else np.logical_and(old, mask))


def _probabilities(p: Problem, zero_logits: bool = False) -> np.ndarray | None:
    """The attention matrix ``P (b, h, n, s)`` of the problem (its output with ``v`` the
    identity); with ``zero_logits``, of ``q = k = 0`` without softcap (positive exactly
    where a key is visible)."""
    if p.name != "softmax" or p.v.ndim < 2:
        return None
    s = p.k.shape[-2]
    eye = np.broadcast_to(np.eye(s), p.v.shape[:-2] + (s, s))
    q, k = (np.zeros_like(p.q), np.zeros_like(p.k)) if zero_logits else (p.q, p.k)
    alt = replace(p, q=q, k=k, v=np.ascontiguousarray(eye), lse_shift=None)
    if zero_logits:
        alt = _with(alt, softcap=None, score_mod=None)
    return alt.evaluate()


def _empty_rows(p: Problem) -> np.ndarray | None:
    """Rows with no visible key (the reference lse infinite), ``(..., n)``; None if none."""
    if not _softmax(p):
        return None
    empty = ~np.isfinite(p.evaluate(lse=True))
    return empty if empty.any() else None


# -- the catalogue -----------------------------------------------------------------------
def _scale_to(fn):
    def native(p, ctx):
        if p.options.get("score_mod") is not None and p.name == "softmax" and \
                p.convert is not None:
            return None
        new = fn(p, ctx)
        return None if new is None or math.isclose(new, _scale(p)) else _with(p, scale=new)
    return native


def _top_left(p, ctx):
    """Causal / window bounds aligned top-left (offset 0), not bottom-right."""
    n, s = p.q.shape[-2], p.k.shape[-2]
    left, right = _window(p)
    if not _plain(p) or n == s or (left, right) == (None, None) or not ctx.conv_bottom_right:
        return None
    i, j = _ij(p)
    vis = np.ones((n, s), dtype=bool)
    if right is not None:
        vis &= j <= i + right
    if left is not None:
        vis &= j >= i - left
    return _and_mask(_with(p, window=None, causal=None), vis)


def _bottom_right(p, ctx):
    """Causal aligned bottom-right where the convention's is top-left (SDPA, JAX)."""
    n, s = p.q.shape[-2], p.k.shape[-2]
    if not _plain(p) or n == s or not ctx.opts.get("is_causal") or p.options.get(
            "mask") is None or ctx.conv_bottom_right:
        return None
    i, j = _ij(p)
    tl, br = j <= i, j <= i + s - n
    return _with(p, mask=br & (np.asarray(p.options["mask"], dtype=bool) | ~tl))


def _window_shift(side: int, delta: int):
    def native(p, ctx):
        if not _softmax(p):
            return None
        w = list(_window(p))
        if w[side] is None or w[side] + delta < 0:
            return None
        w[side] += delta
        return _with(p, window=tuple(w), causal=None)
    return native


def _window_ignored(p, ctx):
    o = ctx.opts
    win = o.get("window_size") or o.get("window")
    if not _softmax(p) or not o.get("causal") or not win or tuple(win)[0] in (None, -1):
        return None
    return _with(p, window=(None, 0), causal=None)


def _softcap_mod(make):
    def native(p, ctx):
        cap = p.options.get("softcap")
        if not cap or not _softmax(p):
            return None
        return make(_with(p, softcap=None), float(cap), p)
    return native


def _softcap_after_mask(q, cap, orig):
    """``cap tanh((l + alibi) / cap)`` on the visible keys, ``-cap`` on the hidden ones: the
    softcap after the ALiBi bias and the mask."""
    if not _plain(orig) or orig.options.get("bias") is not None:
        return None
    vis = _probabilities(orig, zero_logits=True)
    slopes = orig.options.get("alibi_slopes")
    if vis is None or (vis.all() and slopes is None):
        return None
    vis = vis > 0
    alibi = 0.0
    if slopes is not None:
        i, j = _ij(orig)
        n, s = orig.q.shape[-2], orig.k.shape[-2]
        slopes = np.asarray(slopes, dtype=np.float64)[..., None, None]
        left, right = _window(orig)
        # FlashAttention's causal kernel adds +slope j (the same softmax, not the same logits)
        alibi = slopes * j if (left is None and right == 0) else -slopes * np.abs(
            i + s - n - j)
        alibi = np.broadcast_to(alibi, vis.shape) if alibi.ndim <= vis.ndim else alibi
    bare = _with(q, window=None, causal=None, mask=None, key_mask=None, alibi_slopes=None)
    return _with(bare, score_mod=lambda x, b, h, i, j: _where(
        vis, cap * _tanh((x + _like(alibi, x)) / cap), -cap))


def _like(a, x):
    """``a`` as an array of ``x``'s library (torch tensors for a torch hook)."""
    if hasattr(x, "detach") and isinstance(a, np.ndarray):
        import torch
        return torch.as_tensor(a, dtype=x.dtype)
    return a


def _delta_beta_v_only(p, ctx):
    """The delta rule's write ``beta v - k S`` instead of ``beta (v - k S)``."""
    if p.name not in ("deltanet", "gated_deltanet") or p.options.get("normalize_qk") or \
            p.options.get("key_mask") is not None:
        return None
    o = p.options

    def reference(q, k, v, **options):
        want = options.get("return_state", False)
        q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
        beta = np.asarray(options["beta"], np.float64)
        g = options.get("g")
        S = np.zeros(q.shape[:-2] + (q.shape[-1], v.shape[-1]))
        if options.get("initial_state") is not None:
            S = S + np.asarray(options["initial_state"], np.float64)
        scale = options.get("scale")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        outs = []
        for t in range(q.shape[-2]):
            if g is not None:
                S = S * np.exp(np.asarray(g, np.float64)[..., t])[..., None, None]
            kt, vt = k[..., t, :], v[..., t, :]
            pred = np.einsum("...k,...kv->...v", kt, S)
            S = S + kt[..., :, None] * (beta[..., t, None] * vt - pred)[..., None, :]
            outs.append(scale * np.einsum("...k,...kv->...v", q[..., t, :], S))
        out = np.stack(outs, axis=-2)
        return (out, S) if want else out
    return replace(p, reference=reference, options=dict(o))


def _alibi(fn):
    def port(params, x, ctx):
        slopes = params.get("alibi_slopes")
        if slopes is None:
            return None
        new = fn(np.asarray(host64(slopes)))
        if new is None:
            return None
        return {**params, "alibi_slopes": new}, x
    return port


def _first_head(s):
    return None if s.shape[-1] < 2 else np.broadcast_to(s[..., :1], s.shape).copy()


def _first_batch(s):
    return None if s.ndim < 2 or s.shape[0] < 2 else np.broadcast_to(s[:1], s.shape).copy()


def _alibi_no_offset(p, ctx):
    slopes = p.options.get("alibi_slopes")
    n, s = p.q.shape[-2], p.k.shape[-2]
    if slopes is None or not _plain(p) or n == s:
        return None
    i, j = _ij(p)
    slopes = np.asarray(slopes, dtype=np.float64)
    bias = -slopes[..., None, None] * np.abs(i - j)
    old = p.options.get("bias")
    return _with(p, alibi_slopes=None, bias=bias if old is None else old + bias)


def _gqa_tiled(p, ctx):
    """Query head h reads key/value head h mod hkv instead of h // (hq / hkv)."""
    hq, hkv = ctx.case.hq, ctx.case.hkv
    if hq == hkv or p.name != "softmax" or p.k.ndim < 3:
        return None
    group = hq // hkv

    def tiled(x):
        orig = x if x.shape[-3] == hkv else x[..., ::group, :, :]
        return np.ascontiguousarray(orig[..., np.arange(hq) % hkv, :, :])
    return replace(p, k=tiled(p.k), v=tiled(p.v), notes=list(p.notes) + ["gqa-tiled"])


def _lse_result(fn):
    def result(label, ref, p, ctx):
        return fn(ref, p) if label == "lse" else ref
    return result


def _lse_no_max(ref, p):
    probs = _probabilities(p)
    if probs is None:
        return None
    with np.errstate(divide="ignore"):
        return -np.log(probs.max(axis=-1, initial=0.0))


def _empty_rows_as(fill):
    def result(label, ref, p, ctx):
        if label != "out":
            return ref
        empty = _empty_rows(p)
        if empty is None:
            return None
        new = np.array(ref, dtype=np.float64)
        value = fill(p, new)
        if value is None:
            return None
        return np.where(empty[..., None], value, new)
    return result


def _mean_of_v(p, out):
    if not _plain(p):
        return None
    hq, hv = p.q.shape[-3], p.v.shape[-3]
    mean = p.v.mean(axis=-2)                            # (b, hv, dv)
    return np.repeat(mean, hq // hv, axis=-2)[..., None, :]


def _varlen_across(p, ctx):
    """Each packed sequence after the first also reads the last key of the one before."""
    cq, ck = p.options.get("cu_seqlens_q"), p.options.get("cu_seqlens_k")
    if cq is None or p.name != "softmax" or len(ck) < 3:
        return None
    cq, ck = np.asarray(cq), np.asarray(ck)
    base, opts = p.reference, {k: v for k, v in p.options.items()
                               if k not in ("cu_seqlens_q", "cu_seqlens_k")}
    slopes = opts.pop("alibi_slopes", None)
    if opts.get("bias") is not None:
        return None

    def reference(q, k, v, **options):
        want = options.pop("return_lse", False)
        options = {key: val for key, val in options.items()
                   if key not in ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes")}
        outs, lses = [], []
        for b in range(len(cq) - 1):
            k0 = max(int(ck[b]) - (1 if b > 0 else 0), 0)
            extra = {}
            if slopes is not None:
                sl = np.asarray(slopes)
                extra["alibi_slopes"] = sl if sl.ndim == 1 else sl[b]
            res = base(q[..., cq[b]:cq[b + 1], :], k[..., k0:ck[b + 1], :],
                       v[..., k0:ck[b + 1], :], return_lse=True, **options, **extra)
            outs.append(np.asarray(res[0]))
            lses.append(np.asarray(res[1]))
        out = np.concatenate(outs, axis=-2)
        return (out, np.concatenate(lses, axis=-1)) if want else out
    return replace(p, reference=reference, options=dict(p.options))


def _cache_lengths(fn):
    def native(p, ctx):
        lengths = p.options.get("cache_seqlens")
        if lengths is None:
            return None
        page, table = p.k.shape[1], np.asarray(p.options["block_table"])
        lengths = np.asarray(lengths)
        new = np.minimum(fn(lengths, page), table.shape[-1] * page).astype(lengths.dtype)
        if np.array_equal(new, lengths):
            return None
        return _with(p, cache_seqlens=new)
    return native


def _no_initial_state(p, ctx):
    if p.options.get("initial_state") is None:
        return None
    return _with(p, initial_state=None)


def _gates_late(p, ctx):
    for name in ("g", "a"):
        g = p.options.get(name)
        if g is not None and np.ndim(g) >= 3 and np.shape(g)[2] > 1:
            g = np.asarray(g)
            return _with(p, **{name: np.concatenate([g[:, :, :1], g[:, :, :-1]], axis=2)})
    return None


def _dk_no_scale(label, ref, p, ctx):
    return ref / _scale(p) if label == "dk" and p.name == "softmax" else ref


def _grouped_from_one_head(rec, args, options, how, ctx):
    """dK, dV of each key/value head from the first query head of its group."""
    from ..grads import _vjp
    hq, hkv = ctx.case.hq, ctx.case.hkv
    if hq == hkv or rec.name != "softmax":
        return None
    group = hq // hkv
    full = dict(args)
    for name in ("k", "v"):
        if full[name].shape[-3] == hkv:
            full[name] = np.repeat(full[name], group, axis=-3)
    res = _vjp(rec, full, options, "float64", how={**how, "groups": 1})
    return {"q": res["q"], "k": res["k"][..., ::group, :, :],
            "v": res["v"][..., ::group, :, :]}


def _dv_unmasked(rec, args, options, how, ctx):
    """dV from ``P`` over every key (the hidden ones at ``exp(l - lse)``), not the masked
    ``P``."""
    from ..grads import _vjp
    hidden = ("window", "causal", "mask", "key_mask")
    if rec.name != "softmax" or not any(options.get(k) is not None and options.get(k) is
                                        not False for k in hidden) or options.get(
            "cu_seqlens_q") is not None or options.get("score_mod") is not None:
        return None
    p = Problem(rec.name, rec.reference, args["q"], args["k"], args["v"], dict(options))
    bare = _with(p, **{k: None for k in hidden})
    probs = _probabilities(bare)
    with np.errstate(invalid="ignore", over="ignore"):
        shift = np.exp(bare.evaluate(lse=True) - p.evaluate(lse=True))
    shift = np.where(np.isfinite(shift), shift, 0.0)
    every = probs * shift[..., None]                               # (b, hq, n, s)
    dv = np.swapaxes(every, -1, -2) @ args["do"]                   # (b, hq, s, dv)
    hkv = ctx.case.hkv
    if dv.shape[-3] != hkv:
        dv = dv.reshape(*dv.shape[:-3], hkv, dv.shape[-3] // hkv, *dv.shape[-2:]).sum(-3)
    ref = _vjp(rec, args, options, "float64", how=how)
    return {**ref, "v": dv}


_BR = ("flash_attn", "flash_attn_varlen", "flash_attn_kvcache", "custom")

#: The catalogue of named deviations, most common first.
DEVIATIONS = [
    Deviation("scale_twice", "the softmax scale applied twice (scale^2: 1/d by default)",
              native=_scale_to(lambda p, c: _scale(p) ** 2)),
    Deviation("scale_one", "no softmax scale (1, not 1/sqrt(d))",
              native=_scale_to(lambda p, c: 1.0)),
    Deviation("scale_sqrt_dv", "softmax scale 1/sqrt(dv) (the value dim), not 1/sqrt(d)",
              native=_scale_to(lambda p, c: None if c.explicit_scale()
                               else p.v.shape[-1] ** -0.5)),
    Deviation("scale_ignored", "the explicit softmax scale ignored (1/sqrt(d) used)",
              native=_scale_to(lambda p, c: p.q.shape[-1] ** -0.5 if c.explicit_scale()
                               else None)),
    Deviation("causal_top_left", "causal aligned top-left (SDPA's), not bottom-right "
              "(windows too)", native=_top_left, conventions=_BR),
    Deviation("causal_bottom_right", "causal aligned bottom-right (FlashAttention's), not "
              "top-left", native=_bottom_right,
              conventions=("sdpa", "jax_dot_product_attention")),
    Deviation("gqa_tiled", "grouped heads mapped by modulo (query head h reads key/value "
              "head h mod h_kv), not consecutive groups", native=_gqa_tiled),
    Deviation("window_left_plus_one", "the window's left bound one key too wide",
              native=_window_shift(0, 1)),
    Deviation("window_left_minus_one", "the window's left bound one key too narrow",
              native=_window_shift(0, -1)),
    Deviation("window_right_plus_one", "the window's right bound one key too wide",
              native=_window_shift(1, 1)),
    Deviation("window_right_minus_one", "the window's right bound one key too narrow",
              native=_window_shift(1, -1)),
    Deviation("window_ignored_when_causal", "the window ignored when causal is set",
              native=_window_ignored),
    Deviation("alibi_sign", "ALiBi with the wrong sign (+slope |i - j|)",
              port=_alibi(lambda s: -s)),
    Deviation("alibi_no_offset", "ALiBi without the offset s - n (|i - j|, not "
              "|i + s - n - j|)", native=_alibi_no_offset, items=("out",)),
    Deviation("alibi_first_head", "ALiBi slopes of the first head only",
              port=_alibi(_first_head)),
    Deviation("alibi_first_batch", "ALiBi slopes of the first batch only",
              port=_alibi(_first_batch)),
    Deviation("lse_base2", "lse in base 2 (log2), not the natural log",
              result=_lse_result(lambda ref, p: ref / math.log(2)), items=("lse",)),
    Deviation("lse_unscaled", "lse of the unscaled logits",
              native=_scale_to(lambda p, c: 1.0), items=("lse",)),
    Deviation("lse_no_max", "lse without the row max (log sum exp(l - max))",
              result=_lse_result(_lse_no_max), items=("lse",)),
    Deviation("empty_rows_nan", "rows without keys give NaN, not 0",
              result=_empty_rows_as(lambda p, out: np.nan), items=("out",)),
    Deviation("empty_rows_mean", "rows without keys give the mean of v, not 0",
              result=_empty_rows_as(_mean_of_v), items=("out",)),
    Deviation("softcap_no_factor", "softcap without its factor: tanh(x / cap)",
              native=_softcap_mod(lambda q, c, p: _with(
                  q, score_mod=lambda x, b, h, i, j: _tanh(x / c)))),
    Deviation("softcap_division", "softcap as a division only: x / cap (no tanh, no "
              "factor)", native=_softcap_mod(lambda q, c, p: _with(
                  q, score_mod=lambda x, b, h, i, j: x / c))),
    Deviation("softcap_before_scale", "softcap before the scale: scale * cap * "
              "tanh(q.k / cap)", native=_softcap_mod(lambda q, c, p: _with(
                  q, scale=1.0, score_mod=lambda x, b, h, i, j, s=_scale(p):
                  s * c * _tanh(x / c)))),
    Deviation("softcap_after_bias", "softcap after the ALiBi bias and the mask (hidden keys "
              "at -cap, not -inf)", native=_softcap_mod(_softcap_after_mask)),
    Deviation("varlen_across_boundary", "a varlen sequence attending across its boundary "
              "(the previous sequence's last key)", native=_varlen_across,
              conventions=("flash_attn_varlen",)),
    Deviation("kvcache_past_seqlens", "the kvcache read past cache_seqlens (whole pages)",
              native=_cache_lengths(lambda n, page: -(-n // page) * page)),
    Deviation("kvcache_partial_page_ignored", "the kvcache's partly filled last page "
              "ignored", native=_cache_lengths(lambda n, page: n // page * page)),
    Deviation("delta_beta_on_v_only", "the delta rule's beta applied to v only (beta v - "
              "k S, not beta (v - k S))", native=_delta_beta_v_only),
    Deviation("initial_state_ignored", "the initial state ignored",
              native=_no_initial_state),
    Deviation("gates_one_token_late", "gates one token late (token t decayed by g[t-1]: "
              "an exclusive cumulative sum of the gates)", native=_gates_late),
    Deviation("dk_missing_scale", "dk missing the softmax scale (dk / scale)",
              result=_dk_no_scale, items=("dk",)),
    Deviation("dv_unmasked_p", "dv from the attention weights of every key, the hidden "
              "ones included (exp(l - lse) unmasked)", grads=_dv_unmasked, items=("dv",)),
    Deviation("grouped_dkdv_one_head", "grouped dK/dV taken from the first query head of "
              "each group, not summed over the group", grads=_grouped_from_one_head,
              items=("dk", "dv")),
]


# -- running and matching ----------------------------------------------------------------
@dataclass
class Run:
    """One case run again: its call, the kernel's results and gradients, the verdict."""

    case: object
    call: object
    results: dict
    grads: dict
    verdict: object


def run_case(fn, conv, case) -> Run | None:
    """Run and judge ``case``, keeping the kernel's results (None: unsupported or raised)."""
    try:
        call = conv.build(case)
        results, grads = conv.run(fn, call, case, bool(case.opts.get("backward")))
        verdict = judge(call, conv, results, grads)
    except Exception:
        return None
    return Run(case, call, results, grads, verdict)


def _ctx(run: Run, conv) -> Ctx:
    ctx = Ctx(run.case, conv, run.call)
    ctx.conv_bottom_right = conv.name in _BR or (
        conv.name not in CONVENTION_NAMES and run.call.profile is None)
    return ctx


CONVENTION_NAMES = ("sdpa", "flex_attention", "jax_dot_product_attention", "flash_attn",
                    "flash_attn_varlen", "flash_attn_kvcache", "fla_gla", "fla_simple_gla",
                    "fla_delta_rule", "fla_gated_delta_rule")


def _errors(theirs: np.ndarray, alt: np.ndarray, heads: int) -> np.ndarray:
    """Per head ``max |theirs - alt|``, NaN against NaN and equal infinities agreeing."""
    theirs, alt = np.asarray(theirs, np.float64), np.asarray(alt, np.float64)
    if theirs.shape != alt.shape:
        raise ValueError("shape")
    with np.errstate(invalid="ignore"):
        err = np.abs(theirs - alt)
    same = (np.isnan(theirs) & np.isnan(alt)) | (np.isinf(theirs) & (theirs == alt))
    err = np.where(same, 0.0, np.where(np.isnan(err), np.inf, err))
    return err.reshape(heads, -1).max(axis=1, initial=0.0)


def _forward_alt(dev: Deviation, run: Run, ctx: Ctx, label: str):
    call, x = run.call, judge_inputs(run.call)
    params, xx = dict(call.params), dict(x)
    if dev.port is not None:
        got = dev.port(params, xx, ctx)
        if got is None:
            return None
        params, xx = got
    p = prepare(None if call.profile else call.variant, xx["q"], xx["k"], xx["v"],
                layout=call.layout, profile=call.profile, params=params)
    if dev.native is not None:
        p = dev.native(p, ctx)
        if p is None:
            return None
    if label == "final_state":
        from ...registry import get_variant
        ref = get_variant(p.name).reference(p.q, p.k, p.v, return_state=True, **p.options)[1]
        ref = np.asarray(ref, np.float64)
    else:
        ref = p.evaluate(lse=label == "lse")
    if dev.result is not None:
        ref = dev.result(label, ref, p, ctx)
    return ref


def _theirs(run: Run, conv, label: str, layout: str) -> np.ndarray:
    if label == "out":
        out = host(conv.to_judge("out", run.results["out"]))
        return to_bhnd({"out": out}, layout, ("out",))["out"]
    return host(run.results[label])


def _grad_alts(dev: Deviation, run: Run, ctx: Ctx, conv):
    """``(theirs, alt)`` gradients in arrayattn's layout under the deviation."""
    from ..grads import _host_problem, _vjp
    from ...registry import get_variant
    call, x = run.call, judge_inputs(run.call)
    theirs = {call.rename.get(k, k): conv.to_judge(k, g) for k, g in run.grads.items()}
    if call.grad_params is None and call.profile is not None:
        params, variant, profile = dict(call.params), None, call.profile
    else:
        params, variant, profile = dict(grad_options(call, x)), call.variant, None
    xx = dict(x)
    if dev.port is not None:
        got = dev.port(params, xx, ctx)
        if got is None:
            return None
        params, xx = got
    rec, args, options, theirs, how = _host_problem(theirs, variant, xx["q"], xx["k"],
                                                    xx["v"], xx["do"], params, call.layout,
                                                    profile)
    if dev.grads is not None:
        ref = dev.grads(rec, args, options, how, ctx)
        return None if ref is None else (theirs, ref)
    p = Problem(rec.name, rec.reference, args["q"], args["k"], args["v"], dict(options))
    if dev.native is not None:
        p = dev.native(p, ctx)
        if p is None:
            return None
    if p.reference != rec.reference:
        return "skip"                   # a reference of its own: no vjp (gradients unjudged)
    tiled = "gqa-tiled" in p.notes
    ref = _vjp(rec,
               {"q": p.q, "k": p.k, "v": p.v, "do": args["do"]}, p.options, "float64",
               how={**how, "groups": 1} if tiled else how)
    if tiled:
        hkv = ctx.case.hkv
        for name in ("k", "v"):
            g = ref[name]
            ref[name] = g.reshape(*g.shape[:-3], g.shape[-3] // hkv, hkv,
                                  *g.shape[-2:]).sum(axis=-4)
    if dev.result is not None:
        ref = {name: dev.result(f"d{name}", g, p, ctx) for name, g in ref.items()}
    return theirs, ref


def match_one(dev: Deviation, run: Run, conv) -> tuple | None:
    """``(matched, worst error, labels compared)`` of ``dev`` on a failing run, or None
    where it does not apply."""
    ctx = _ctx(run, conv)
    if dev.conventions and conv.name not in dev.conventions and not (
            "custom" in dev.conventions and conv.name not in CONVENTION_NAMES):
        return None
    items = run.verdict.items
    fwd = [(lab, c) for lab, c in items if not lab.startswith("d")]
    grads = [(lab, c) for lab, c in items if lab.startswith("d")]
    covers = (lambda lab: True) if dev.items is None else (lambda lab: lab in dev.items)
    worst, compared = 0.0, []
    try:
        for lab, c in fwd:
            if not covers(lab):
                if not c.ok:
                    return False, math.inf, compared
                continue
            alt = _forward_alt(dev, run, ctx, lab)
            if alt is None:
                return None
            theirs = _theirs(run, conv, lab, run.call.layout)
            err = _errors(theirs, alt, len(c.heads))
            if not np.all(err <= c.tolerance):
                return False, float(np.max(err)), [lab]
            compared.append(lab)
            worst = max(worst, float(np.max(err, initial=0.0)))
        grad_covered = [(lab, c) for lab, c in grads if covers(lab)]
        if grads and (dev.items is None or grad_covered):
            got = _grad_alts(dev, run, ctx, conv)
            if got is None:
                return None
            theirs, ref = ({}, {}) if got == "skip" else got
            for lab, c in grads if got != "skip" else ():
                name = lab[1:]
                if not covers(lab):
                    if not c.ok:
                        return False, math.inf, compared
                    continue
                err = _errors(theirs[name], ref[name], len(c.heads))
                if not np.all(err <= c.tolerance):
                    return False, float(np.max(err)), [lab]
                compared.append(lab)
                worst = max(worst, float(np.max(err, initial=0.0)))
    except Exception:
        return None
    if not compared or not any(not c.ok for lab, c in items if lab in compared):
        return None          # it explains nothing that failed
    return True, worst, compared


def match_deviations(runs: list, conv, catalogue=None) -> list:
    """The deviations the kernel matches on every failing run where they apply (and at
    least the first): ``[(Deviation, matched, tried, worst error, labels)]``."""
    found = []
    for dev in DEVIATIONS if catalogue is None else catalogue:
        results = [match_one(dev, run, conv) for run in runs]
        if results[0] is None or not results[0][0]:
            continue
        applied = [r for r in results if r is not None]
        if all(r[0] for r in applied):
            labels = sorted({lab for r in applied for lab in r[2]},
                            key=lambda s: (s != "out", s))
            found.append((dev, len(applied), len(runs), max(r[1] for r in applied), labels))
    return found


# -- which dimensions matter -------------------------------------------------------------
def _variations(case, conv, dtypes) -> list:
    """``[(dimension, description, case)]``: each dimension of ``case`` varied once or twice."""
    out = [("seed", f"seed {case.seed + d}", replace(case, seed=case.seed + d)) for d in (1, 2)]
    mags = [m for m in (1.0, 3.0, 0.05) if m != case.magnitude][:2]
    out += [("magnitude", f"magnitude {m:g}", replace(case, magnitude=m)) for m in mags]
    out += [("dtype", dt, replace(case, dtype=dt)) for dt in dtypes if dt != case.dtype][:2]
    if case.n != case.s:
        m = max(case.n, case.s)
        out.append(("n != s", f"n = s = {m}", replace(case, n=m, s=m)))
        if not conv.equal_lengths:
            out.append(("n/s", f"n = {case.s}, s = {case.n}", replace(case, n=case.s,
                                                                      s=case.n)))
    elif not conv.equal_lengths:
        out.append(("n == s", f"n = {case.n}, s = {case.n + 3}",
                    replace(case, s=case.n + 3)))
    out.append(("size", f"n = {2 * case.n + 3}, s = {2 * case.s + 3}",
                replace(case, n=2 * case.n + 3, s=2 * case.s + 3)))
    if case.hq != case.hkv:
        out.append(("grouped heads", f"h = kv heads = {case.hkv}",
                    replace(case, hq=case.hkv)))
    for key, val in case.active().items():
        out.append((f"{key}={val}", f"{key} off", case.with_options(**{key: None})))
    return [(dim, text, conv.normalize(c)) for dim, text, c in out if conv.normalize(c) != case]


def dimensions(fn, conv, case, dtypes) -> tuple:
    """``(sentence, failing runs of the variations)``: under which variations of ``case``
    the failure persists (each dimension varied once or twice), e.g. ``fails for every
    seed, magnitude and dtype tried; needs causal=True and n != s``."""
    runs, by_dim = [], {}
    for dim, text, cand in _variations(case, conv, dtypes):
        run = run_case(fn, conv, cand)
        if run is None:
            continue
        fails = not run.verdict.ok
        by_dim.setdefault(dim, []).append((text, fails))
        if fails and run.verdict.error is None:
            runs.append(run)
    every, persists, needs, partly = [], [], [], []
    for dim, got in by_dim.items():
        passing = [t for t, f in got if not f]
        if dim == "n/s":
            dim = "n < s" if case.n < case.s else "n > s"
        if not passing:
            if dim in ("seed", "magnitude", "dtype", "size"):
                every.append(dim if dim != "size" else "larger size")
            else:
                persists.append(got[0][0])
        elif len(passing) == len(got):
            needs.append({"size": f"the size (passes at {got[0][0]})",
                          "seed": f"seed {case.seed}",
                          "magnitude": f"magnitude {case.magnitude:g}",
                          "dtype": case.dtype}.get(dim, dim))
        else:
            partly.append(f"{dim} (passes with {', '.join(passing)})")
    if "n != s" in needs and ("n < s" in needs or "n > s" in needs):
        needs.remove("n != s")
    parts = []
    if every:
        parts.append("fails for every " + _and(every) + " tried")
    if persists:
        parts.append("persists with " + _and(persists))
    if needs:
        parts.append("needs " + _and(needs))
    if partly:
        parts.append("depends on " + _and(partly))
    return ("; ".join(parts) or "no variation ran"), runs


def _and(words: list) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


# -- the result --------------------------------------------------------------------------
@dataclass
class Explanation:
    """What :func:`explain` found: ``likely`` (the line on the named deviation),
    ``matches`` (``[(Deviation, matched, tried, worst error, labels)]``), ``dims`` (the
    line on the dimensions)."""

    likely: str
    dims: str
    matches: list

    @property
    def names(self) -> list:
        return [m[0].name for m in self.matches]

    def lines(self) -> list:
        return [self.likely, f"dimensions: {self.dims}"]


def _likely(matches: list, tried: int) -> str:
    if not matches:
        return (f"no named deviation matches ({len(DEVIATIONS)} tried on {tried} failing "
                f"case{'s' if tried != 1 else ''})")
    dev, ok, total, err, labels = matches[0]
    verb = "equals" if len(labels) == 1 else "equal"
    line = (f"likely: {dev.sentence} -- {', '.join(labels)} {verb} that reference to "
            f"{err:.2g} on {ok} of {total} failing case{'s' if total != 1 else ''}")
    if len(matches) > 1:
        line += "; also matches: " + "; ".join(m[0].sentence for m in matches[1:])
    return line


def explain(fn, conv, case, dtypes=("float32",), *, others: int = 3) -> Explanation | None:
    """The named deviation and the dimensions of the failing ``case`` (None when the case
    does not fail again, or the kernel raised)."""
    first = run_case(fn, conv, case)
    if first is None or first.verdict.ok or first.verdict.error is not None:
        return None
    dims, failing = dimensions(fn, conv, case, tuple(dtypes))
    # the other failing cases: prefer the ones that differ most from the smallest
    order = sorted(failing, key=lambda r: -(r.case.n + r.case.s + (r.case.seed != case.seed)))
    runs = [first] + order[:others]
    matches = match_deviations(runs, conv)
    return Explanation(_likely(matches, len(runs)), dims, matches)
