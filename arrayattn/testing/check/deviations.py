"""The catalogue of named deviations (issue #50): the mistakes kernels make, each a
transformation of the reference problem (a name, a sentence, where it applies); adding one
is one entry of :data:`DEVIATIONS`."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..measures import host64
from ..problem import Problem

from .deviation import (Deviation, and_mask, empty_rows, ij, is_plain, is_softmax,
                        probabilities, scale_of, tanh, where, window_of, with_changes)

__all__ = ["DEVIATIONS", "BOTTOM_RIGHT"]


# -- the catalogue -----------------------------------------------------------------------
def _scale_to(fn):
    def native(p, ctx):
        if p.options.get("score_mod") is not None and p.name == "softmax" and \
                p.convert is not None:
            return None
        new = fn(p, ctx)
        return None if new is None or math.isclose(new, scale_of(p)) else with_changes(p, scale=new)
    return native


def _top_left(p, ctx):
    """Causal / window bounds aligned top-left (offset 0), not bottom-right."""
    n, s = p.q.shape[-2], p.k.shape[-2]
    left, right = window_of(p)
    if not is_plain(p) or n == s or (left, right) == (None, None) or not ctx.conv_bottom_right:
        return None
    i, j = ij(p)
    vis = np.ones((n, s), dtype=bool)
    if right is not None:
        vis &= j <= i + right
    if left is not None:
        vis &= j >= i - left
    return and_mask(with_changes(p, window=None, causal=None), vis)


def _bottom_right(p, ctx):
    """Causal aligned bottom-right where the convention's is top-left (SDPA, JAX)."""
    n, s = p.q.shape[-2], p.k.shape[-2]
    if not is_plain(p) or n == s or not ctx.opts.get("is_causal") or p.options.get(
            "mask") is None or ctx.conv_bottom_right:
        return None
    i, j = ij(p)
    tl, br = j <= i, j <= i + s - n
    return with_changes(p, mask=br & (np.asarray(p.options["mask"], dtype=bool) | ~tl))


def _window_shift(side: int, delta: int):
    def native(p, ctx):
        if not is_softmax(p):
            return None
        w = list(window_of(p))
        if w[side] is None or w[side] + delta < 0:
            return None
        w[side] += delta
        return with_changes(p, window=tuple(w), causal=None)
    return native


def _window_ignored(p, ctx):
    o = ctx.opts
    win = o.get("window_size") or o.get("window")
    if not is_softmax(p) or not o.get("causal") or not win or tuple(win)[0] in (None, -1):
        return None
    return with_changes(p, window=(None, 0), causal=None)


def _softcap_mod(make):
    def native(p, ctx):
        cap = p.options.get("softcap")
        if not cap or not is_softmax(p):
            return None
        return make(with_changes(p, softcap=None), float(cap), p)
    return native


def _softcap_after_mask(q, cap, orig):
    """``cap tanh((l + alibi) / cap)`` on the visible keys, ``-cap`` on the hidden ones: the
    softcap after the ALiBi bias and the mask."""
    if not is_plain(orig) or orig.options.get("bias") is not None:
        return None
    vis = probabilities(orig, zero_logits=True)
    slopes = orig.options.get("alibi_slopes")
    if vis is None or (vis.all() and slopes is None):
        return None
    vis = vis > 0
    alibi = 0.0
    if slopes is not None:
        i, j = ij(orig)
        n, s = orig.q.shape[-2], orig.k.shape[-2]
        slopes = np.asarray(slopes, dtype=np.float64)[..., None, None]
        left, right = window_of(orig)
        # FlashAttention's causal kernel adds +slope j (the same softmax, not the same logits)
        alibi = slopes * j if (left is None and right == 0) else -slopes * np.abs(
            i + s - n - j)
        alibi = np.broadcast_to(alibi, vis.shape) if alibi.ndim <= vis.ndim else alibi
    bare = with_changes(q, window=None, causal=None, mask=None, key_mask=None, alibi_slopes=None)
    return with_changes(bare, score_mod=lambda x, b, h, i, j: where(
        vis, cap * tanh((x + _like(alibi, x)) / cap), -cap))


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
    if slopes is None or not is_plain(p) or n == s:
        return None
    i, j = ij(p)
    slopes = np.asarray(slopes, dtype=np.float64)
    bias = -slopes[..., None, None] * np.abs(i - j)
    old = p.options.get("bias")
    return with_changes(p, alibi_slopes=None, bias=bias if old is None else old + bias)


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
    probs = probabilities(p)
    if probs is None:
        return None
    with np.errstate(divide="ignore"):
        return -np.log(probs.max(axis=-1, initial=0.0))


def _empty_rows_as(fill):
    def result(label, ref, p, ctx):
        if label != "out":
            return ref
        empty = empty_rows(p)
        if empty is None:
            return None
        new = np.array(ref, dtype=np.float64)
        value = fill(p, new)
        if value is None:
            return None
        return np.where(empty[..., None], value, new)
    return result


def _mean_of_v(p, out):
    if not is_plain(p):
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
        return with_changes(p, cache_seqlens=new)
    return native


def _no_initial_state(p, ctx):
    if p.options.get("initial_state") is None:
        return None
    return with_changes(p, initial_state=None)


def _gates_late(p, ctx):
    for name in ("g", "a"):
        g = p.options.get(name)
        if g is not None and np.ndim(g) >= 3 and np.shape(g)[2] > 1:
            g = np.asarray(g)
            return with_changes(p, **{name: np.concatenate([g[:, :, :1], g[:, :, :-1]], axis=2)})
    return None


def _dk_no_scale(label, ref, p, ctx):
    return ref / scale_of(p) if label == "dk" and p.name == "softmax" else ref


def _grouped_from_one_head(rec, args, options, how, ctx):
    """dK, dV of each key/value head from the first query head of its group."""
    from ..grads import reference_vjp
    hq, hkv = ctx.case.hq, ctx.case.hkv
    if hq == hkv or rec.name != "softmax":
        return None
    group = hq // hkv
    full = dict(args)
    for name in ("k", "v"):
        if full[name].shape[-3] == hkv:
            full[name] = np.repeat(full[name], group, axis=-3)
    res = reference_vjp(rec, full, options, "float64", how={**how, "groups": 1})
    return {"q": res["q"], "k": res["k"][..., ::group, :, :],
            "v": res["v"][..., ::group, :, :]}


def _dv_unmasked(rec, args, options, how, ctx):
    """dV from ``P`` over every key (the hidden ones at ``exp(l - lse)``), not the masked
    ``P``."""
    from ..grads import reference_vjp
    hidden = ("window", "causal", "mask", "key_mask")
    if rec.name != "softmax" or not any(options.get(k) is not None and options.get(k) is
                                        not False for k in hidden) or options.get(
            "cu_seqlens_q") is not None or options.get("score_mod") is not None:
        return None
    p = Problem(rec.name, rec.reference, args["q"], args["k"], args["v"], dict(options))
    bare = with_changes(p, **{k: None for k in hidden})
    probs = probabilities(bare)
    with np.errstate(invalid="ignore", over="ignore"):
        shift = np.exp(bare.evaluate(lse=True) - p.evaluate(lse=True))
    shift = np.where(np.isfinite(shift), shift, 0.0)
    every = probs * shift[..., None]                               # (b, hq, n, s)
    dv = np.swapaxes(every, -1, -2) @ args["do"]                   # (b, hq, s, dv)
    hkv = ctx.case.hkv
    if dv.shape[-3] != hkv:
        dv = dv.reshape(*dv.shape[:-3], hkv, dv.shape[-3] // hkv, *dv.shape[-2:]).sum(-3)
    ref = reference_vjp(rec, args, options, "float64", how=how)
    return {**ref, "v": dv}


BOTTOM_RIGHT = ("flash_attn", "flash_attn_varlen", "flash_attn_kvcache", "custom")

#: The catalogue of named deviations, most common first.
DEVIATIONS = [
    Deviation("scale_twice", "the softmax scale applied twice (scale^2: 1/d by default)",
              native=_scale_to(lambda p, c: scale_of(p) ** 2)),
    Deviation("scale_one", "no softmax scale (1, not 1/sqrt(d))",
              native=_scale_to(lambda p, c: 1.0)),
    Deviation("scale_sqrt_dv", "softmax scale 1/sqrt(dv) (the value dim), not 1/sqrt(d)",
              native=_scale_to(lambda p, c: None if c.explicit_scale()
                               else p.v.shape[-1] ** -0.5)),
    Deviation("scale_ignored", "the explicit softmax scale ignored (1/sqrt(d) used)",
              native=_scale_to(lambda p, c: p.q.shape[-1] ** -0.5 if c.explicit_scale()
                               else None)),
    Deviation("causal_top_left", "causal aligned top-left (SDPA's), not bottom-right "
              "(windows too)", native=_top_left, conventions=BOTTOM_RIGHT),
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
              native=_softcap_mod(lambda q, c, p: with_changes(
                  q, score_mod=lambda x, b, h, i, j: tanh(x / c)))),
    Deviation("softcap_division", "softcap as a division only: x / cap (no tanh, no "
              "factor)", native=_softcap_mod(lambda q, c, p: with_changes(
                  q, score_mod=lambda x, b, h, i, j: x / c))),
    Deviation("softcap_before_scale", "softcap before the scale: scale * cap * "
              "tanh(q.k / cap)", native=_softcap_mod(lambda q, c, p: with_changes(
                  q, scale=1.0, score_mod=lambda x, b, h, i, j, s=scale_of(p):
                  s * c * tanh(x / c)))),
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
