"""The conventions of FlashAttention's ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache``: layout ``(b, n, h, d)`` (packed ``(total, h, d)``), causal and
windows aligned bottom-right, the lse through ``return_attn_probs``."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .base import VALUE_CLASSES, Call, Convention, draw_qkv, host, swap, to_framework

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

    values = VALUE_CLASSES
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

    values = VALUE_CLASSES
    name = "flash_attn_varlen"
    signature = ("fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, "
                 "dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
                 "softcap=0.0, alibi_slopes=None, deterministic=False, "
                 "return_attn_probs=False)")
    space = {**_COMMON,
             "segments": (None, "empty", "one_token", "uneven", "no_queries", "no_keys",
                          "very_uneven", "many"),
             "return_attn_probs": (False, True), "backward": (False, True)}

    def normalize(self, case):
        seg = case.opts.get("segments")
        if case.poison and case.opts.get("backward"):   # dk, dv of padding: not judged
            case = replace(case, poison="")
        return replace(case, b=max(case.b, 8 if seg == "many" else 2)) if seg else case

    def _lengths(self, case, rng):
        """The query and key lengths of the ``case.b`` sequences, drawn independently: the
        first holds ``n`` and ``s``; ``segments`` makes the last one empty, one token,
        uneven (1 query, ``s`` keys), ``no_queries`` (0 queries, keys), ``no_keys``
        (queries, 0 keys: its output rows are 0, its lse +inf), ``very_uneven`` (1 query
        and ``s`` keys, then ``n`` queries and 1 key), or ``many`` (lengths 0 .. n, 0 .. s
        over 8 or more sequences)."""
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
        elif seg == "no_queries":
            lq[-1] = 0
        elif seg == "no_keys":
            lk[-1] = 0
        elif seg == "very_uneven":
            lq[-1], lk[-1], lq[-2], lk[-2] = 1, case.s, case.n, 1
        elif seg == "many":
            lq[1:], lk[1:] = (rng.integers(0, x + 1, case.b - 1) for x in (case.n, case.s))
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
        inputs = None
        if case.poison:      # padding past cu_seqlens_k[-1]: the kernel's k, v only
            total = arrays["k"].shape[0]
            padded = {**t, "k": _pad(t["k"]), "v": _pad(t["v"])}
            slots = np.arange(padded["k"].shape[0]) >= total
            inputs, t = _poison(padded, slots, case.poison, rng, self)
            inputs = {name: x[:total] if name in ("k", "v") else x
                      for name, x in inputs.items()}
        return Call(t, ("q", "k", "v"), "softmax", "flash_attn", "bnhd", params,
                    inputs=inputs)

    def poison_regions(self, case) -> tuple:
        """The padding rows of k and v past ``cu_seqlens_k[-1]`` (forward cases)."""
        return ("padding_past_cu_seqlens",)

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

    values = VALUE_CLASSES
    name = "flash_attn_kvcache"
    signature = ("fn(q, k_cache, v_cache, cache_seqlens=None, block_table=None, "
                 "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
                 "alibi_slopes=None, return_softmax_lse=False) -> out or (out, lse)")
    space = {**_COMMON, "page_size": (None, 1, 5, 64), "return_softmax_lse": (False, True)}

    def poison_regions(self, case) -> tuple:
        """unused pages (blocks no sequence's table names), the slots past
        ``cache_seqlens`` (the last page's tail and whole pages), and, with a left window,
        the whole pages before every query's window."""
        left = (case.opts.get("window_size") or (-1, -1))[0]
        return ("unused_pages", "past_cache_seqlens") + (
            ("pages_a_window_skips",) if left is not None and left >= 0 else ())

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
        poisoned = self._poisoned(case, arrays, page, kw) if case.poison else None
        t = self.tensors(arrays, case)
        if "alibi_slopes" in t:
            t["alibi_slopes"] = t["alibi_slopes"].float()
        params = _port_params(kw, t)
        params.update(block_table=arrays["block_table"], cache_seqlens=arrays["cache_seqlens"])
        inputs = None
        if poisoned is not None:
            inputs, t = _poison(t, poisoned, case.poison, rng, self)
        return Call(t, (), "softmax", "flash_attn", "bnhd", params, inputs=inputs)

    def _poisoned(self, case, arrays, page, kw) -> np.ndarray:
        """A boolean ``(num_blocks, page)``: the slots of the case's poison regions."""
        table, lengths = arrays["block_table"], arrays["cache_seqlens"]
        kind, _, region = case.poison.partition(":")
        regions = (region,) if region else self.poison_regions(case)
        mask = np.zeros((arrays["k"].shape[0], page), dtype=bool)
        if "unused_pages" in regions:
            mask[np.setdiff1d(np.arange(mask.shape[0]), table.ravel())] = True
        left = kw["window_size"][0]
        for b in range(case.b):
            pos = np.arange(table.shape[1] * page).reshape(table.shape[1], page)
            if "past_cache_seqlens" in regions:
                mask[table[b]] |= pos >= lengths[b]
            if "pages_a_window_skips" in regions and left >= 0:
                first = lengths[b] - case.n - left       # row 0's first visible key
                whole = (pos[:, -1] < first)[:, None]
                mask[table[b]] |= whole & np.ones_like(pos, dtype=bool)
        return mask

    def call(self, fn, t, case):
        kw = _options(case, np.random.default_rng(0), {})
        want = bool(case.opts.get("return_softmax_lse"))
        res = fn(t["q"], t["k"], t["v"], cache_seqlens=t["cache_seqlens"],
                 block_table=t["block_table"], alibi_slopes=t.get("alibi_slopes"),
                 return_softmax_lse=want, **kw)
        return {"out": res[0], "lse": res[1]} if want else {"out": res}


def _poison(t: dict, slots: np.ndarray, poison: str, rng, conv):
    """``(the referee's inputs, the kernel's tensors)``: k and v caches whose ``slots``
    (``(num_blocks, page)``) hold NaN (``poison`` ``nan``) or +-inf keys and huge finite
    values (``inf``) for the kernel, and 0 for the referee (which gathers whole pages)."""
    inputs = {name: host(t[name]) for name in ("q", "k", "v", "do")}
    k, v = inputs["k"].copy(), inputs["v"].copy()
    for x in (inputs["k"], inputs["v"]):
        x[slots] = 0.0
    if poison.partition(":")[0] == "nan":
        k[slots], v[slots] = np.nan, np.nan
    else:
        big = float(np.finfo(np.float16).max if str(t["k"].dtype).endswith("float16")
                     else 1e30)
        k[slots] = rng.choice((-1.0, 1.0), k[slots].shape) * np.inf
        v[slots] = rng.choice((-1.0, 1.0), v[slots].shape) * big
    out = dict(t)
    dtype = str(t["k"].dtype).split(".")[-1]
    out["k"], out["v"] = (to_framework(x, conv.framework, dtype, conv.device) for x in (k, v))
    return inputs, out


def _pad(x):
    """``x`` with ``max(rows // 4, 1)`` zero rows appended along the first axis (torch or
    JAX): room for the padding a packed kernel must not read."""
    rows = max(x.shape[0] // 4, 1)
    if hasattr(x, "new_zeros"):
        import torch
        return torch.cat([x, x.new_zeros((rows,) + tuple(x.shape[1:]))])
    import jax.numpy as jnp
    return jnp.concatenate([x, jnp.zeros((rows,) + tuple(x.shape[1:]), x.dtype)])
