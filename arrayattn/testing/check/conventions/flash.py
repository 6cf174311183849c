"""The conventions of FlashAttention's ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``: layout ``(b, n, h, d)`` (packed ``(total, h, d)``), causal and
windows aligned bottom-right, the lse through ``return_attn_probs``."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .base import Call, Convention, draw_qkv, host, swap

__all__ = ["FlashAttn", "FlashAttnVarlen", "FlashAttnKVCache"]

_WINDOWS = ((-1, -1), (0, 0), (3, 0), (0, 3), (2, 5), (1000, 1000))
_COMMON = {"causal": (False, True), "window_size": _WINDOWS, "softcap": (0.0, 1.0, 50.0),
           "alibi_slopes": (None, "h", "bh"), "softmax_scale": (None, 0.3)}


def _options(case, rng, arrays) -> dict:
    """The FlashAttention keywords of a case (drawing the ALiBi slopes into ``arrays``)."""
    o = case.opts
    kw = {"softmax_scale": o.get("softmax_scale"), "causal": bool(o.get("causal")),
          "window_size": tuple(o.get("window_size") or (-1, -1)),
          "softcap": float(o.get("softcap") or 0.0)}
    if o.get("alibi_slopes"):
        shape = (case.hq,) if o["alibi_slopes"] == "h" else (case.b, case.hq)
        arrays["alibi_slopes"] = rng.uniform(0.05, 1.0, shape).astype(np.float32)
    return kw


def _port_params(kw: dict, t: dict) -> dict:
    params = dict(kw)
    if "alibi_slopes" in t:
        params["alibi_slopes"] = host(t["alibi_slopes"])
    return params


class FlashAttn(Convention):
    """``fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False)``; with
    ``return_attn_probs=True`` it returns ``(out, softmax_lse, S_dmask)``."""

    name = "flash_attn"
    signature = ("fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
                 "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
                 "return_attn_probs=False) -> out or (out, lse, S_dmask)")
    space = {**_COMMON, "return_attn_probs": (False, True), "backward": (False, True)}

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        arrays = {k: swap(v) for k, v in draw_qkv(case, rng).items()}
        kw = _options(case, rng, arrays)
        t = self.tensors(arrays, case)
        if "alibi_slopes" in t:
            t["alibi_slopes"] = t["alibi_slopes"].float()
        return Call(t, ("q", "k", "v"), "softmax", "flash_attn", "bnhd", _port_params(kw, t))

    def call(self, fn, t, case):
        kw = _options(case, np.random.default_rng(0), {})
        probs = bool(case.opts.get("return_attn_probs"))
        res = fn(t["q"], t["k"], t["v"], dropout_p=0.0, alibi_slopes=t.get("alibi_slopes"),
                 deterministic=False, return_attn_probs=probs, **kw)
        return {"out": res[0], "lse": res[1]} if probs else {"out": res}


class FlashAttnVarlen(Convention):
    """``fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    deterministic=False, return_attn_probs=False)``: ``case.b`` packed sequences of at most
    ``n`` and ``s`` tokens, ``(total, h, d)``."""

    name = "flash_attn_varlen"
    signature = ("fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                 "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                 "softcap=0.0, alibi_slopes=None, deterministic=False, "
                 "return_attn_probs=False)")
    space = {**_COMMON,
             "segments": (None, "empty", "one_token", "uneven"),
             "return_attn_probs": (False, True), "backward": (False, True)}

    def normalize(self, case):
        return replace(case, b=max(case.b, 2)) if case.opts.get("segments") else case

    def _lengths(self, case, rng):
        seg = case.opts.get("segments")
        lq = rng.integers(1, case.n + 1, case.b)
        lk = rng.integers(1, case.s + 1, case.b)
        lq[0], lk[0] = case.n, case.s
        if seg == "empty":
            lq[-1] = lk[-1] = 0
        elif seg == "one_token":
            lq[-1] = lk[-1] = 1
        elif seg == "uneven":
            lq[-1], lk[-1] = 1, case.s
        return lq, lk

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        lq, lk = self._lengths(case, rng)
        one = replace(case, b=1, n=int(lq.sum()), s=int(lk.sum()))
        arrays = {k: swap(v)[0] for k, v in draw_qkv(one, rng).items()}
        arrays["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        arrays["cu_seqlens_k"] = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        kw = _options(case, rng, arrays)
        t = self.tensors(arrays, case)
        if "alibi_slopes" in t:
            t["alibi_slopes"] = t["alibi_slopes"].float()
        params = _port_params(kw, t)
        params.update(cu_seqlens_q=arrays["cu_seqlens_q"], cu_seqlens_k=arrays["cu_seqlens_k"])
        t["max_seqlen"] = (int(lq.max()), int(lk.max()))
        return Call(t, ("q", "k", "v"), "softmax", "flash_attn", "bnhd", params)

    def call(self, fn, t, case):
        kw = _options(case, np.random.default_rng(0), {})
        probs = bool(case.opts.get("return_attn_probs"))
        res = fn(t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"],
                 *t["max_seqlen"], dropout_p=0.0, alibi_slopes=t.get("alibi_slopes"),
                 deterministic=False, return_attn_probs=probs, **kw)
        return {"out": res[0], "lse": res[1]} if probs else {"out": res}


class FlashAttnKVCache(Convention):
    """``fn(q, k_cache, v_cache, cache_seqlens=..., block_table=..., softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    return_softmax_lse=False)``: a paged cache ``(num_blocks, page, h_kv, d)``; each
    sequence holds ``cache_seqlens[b] <= s`` tokens, the last page partly filled."""

    name = "flash_attn_kvcache"
    signature = ("fn(q, k_cache, v_cache, cache_seqlens=None, block_table=None, "
                 "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                 "alibi_slopes=None, return_softmax_lse=False) -> out or (out, lse)")
    space = {**_COMMON, "page_size": (None, 1, 5, 64), "return_softmax_lse": (False, True)}

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        page = case.opts.get("page_size") or 16
        per_seq = -(-case.s // page)
        blocks = case.b * per_seq + 1
        qkv = draw_qkv(replace(case, b=blocks, s=page), rng)
        arrays = {"q": swap(draw_qkv(case, rng)["q"]), "k": swap(qkv["k"][:, :, :page]),
                  "v": swap(qkv["v"][:, :, :page])}
        arrays["do"] = np.zeros((case.b, case.n, case.hq, case.dv))
        arrays["block_table"] = rng.permutation(blocks)[:case.b * per_seq].reshape(
            case.b, per_seq).astype(np.int32)
        lengths = rng.integers(1, case.s + 1, case.b)
        lengths[0] = case.s
        arrays["cache_seqlens"] = lengths.astype(np.int32)
        kw = _options(case, rng, arrays)
        t = self.tensors(arrays, case)
        if "alibi_slopes" in t:
            t["alibi_slopes"] = t["alibi_slopes"].float()
        params = _port_params(kw, t)
        params.update(block_table=arrays["block_table"], cache_seqlens=arrays["cache_seqlens"])
        return Call(t, (), "softmax", "flash_attn", "bnhd", params)

    def call(self, fn, t, case):
        kw = _options(case, np.random.default_rng(0), {})
        want = bool(case.opts.get("return_softmax_lse"))
        res = fn(t["q"], t["k"], t["v"], cache_seqlens=t["cache_seqlens"],
                 block_table=t["block_table"], alibi_slopes=t.get("alibi_slopes"),
                 return_softmax_lse=want, **kw)
        return {"out": res[0], "lse": res[1]} if want else {"out": res}
