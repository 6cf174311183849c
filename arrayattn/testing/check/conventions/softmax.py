"""The conventions of exact-softmax kernels called like torch's
``scaled_dot_product_attention``, ``flex_attention`` and ``jax.nn.dot_product_attention``."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .base import VALUE_CLASSES, Call, Convention, draw_qkv, host, swap

__all__ = ["Sdpa", "FlexAttention", "JaxDotProductAttention"]


def _tanh(x):
    if hasattr(x, "tanh"):
        return x.tanh()
    return np.tanh(x)


class Sdpa(Convention):
    """``fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False)``, layout ``(b, h, n, d)``, ``is_causal`` top-left."""

    values = VALUE_CLASSES
    name = "sdpa"
    signature = ("fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, "
                 "enable_gqa=False) -> out")
    space = {"is_causal": (False, True), "attn_mask": (None, "bool", "float", "empty_row"),
             "scale": (None, 0.3), "backward": (False, True)}

    def normalize(self, case):
        return case.with_options(attn_mask=None) if case.opts.get("is_causal") else case

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        arrays, o = draw_qkv(case, rng), case.opts
        kind = o.get("attn_mask")
        if kind in ("bool", "empty_row"):
            m = rng.random((case.n, case.s)) < 0.7
            m[:, 0] = True
            if kind == "empty_row":
                m[rng.integers(case.n)] = False
            arrays["attn_mask"] = m
        elif kind == "float":
            arrays["attn_mask"] = rng.standard_normal((case.n, case.s))
        t = self.tensors(arrays, case)
        params = {"is_causal": bool(o.get("is_causal")), "scale": o.get("scale"),
                  "enable_gqa": case.hq != case.hkv}
        if "attn_mask" in t:
            params["attn_mask"] = host(t["attn_mask"])
        return Call(t, ("q", "k", "v"), "softmax", "sdpa", "bhnd", params)

    def call(self, fn, t, case):
        o = case.opts
        return {"out": fn(t["q"], t["k"], t["v"], attn_mask=t.get("attn_mask"),
                          dropout_p=0.0, is_causal=bool(o.get("is_causal")),
                          scale=o.get("scale"), enable_gqa=case.hq != case.hkv)}


class _Mods:
    """The score_mod and mask_mod the checker builds for a flex case (written with plain
    operators, so that the referee evaluates them on its own index arrays)."""

    def __init__(self, case, rng):
        o, self.n, self.s = case.opts, case.n, case.s
        self.mask_kind, self.score_kind = o.get("mask_mod"), o.get("score_mod")
        self.window = int(rng.integers(0, 6))
        self.prefix = int(rng.integers(1, max(case.s, 1) + 1))
        self.docs = int(rng.integers(2, 5))
        self.slopes = [float(x) for x in rng.uniform(0.05, 1.0, case.hq)]
        self.cap = 2.0

    def mask_mod(self, b, h, i, j):
        kind = self.mask_kind
        if kind == "causal":
            return i >= j
        if kind == "window":
            return (i >= j) & (i - j <= self.window)
        if kind == "prefix":
            return (j <= i) | (j < self.prefix)
        # document masking: tokens split into equal fractions of each sequence
        return (i * self.docs) // self.n == (j * self.docs) // self.s

    def score_mod(self, score, b, h, i, j):
        if self.score_kind == "softcap":
            return self.cap * _tanh(score / self.cap)
        slope = sum(self._where(h == k, s) for k, s in enumerate(self.slopes))
        return score - slope * abs(i - j)

    @staticmethod
    def _where(cond, value):
        return cond * value


class FlexAttention(Convention):
    """``fn(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
    return_lse=False)`` (torch's ``flex_attention``, eager on CPU); the checker builds the
    ``score_mod`` (ALiBi, softcap) and the ``block_mask`` from a ``mask_mod`` (causal,
    sliding window, prefix-LM, document masking)."""

    values = VALUE_CLASSES
    name = "flex_attention"
    signature = ("fn(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, "
                 "return_lse=False) -> out or (out, lse)")
    space = {"mask_mod": (None, "causal", "window", "document", "prefix"),
             "score_mod": (None, "alibi", "softcap"), "scale": (None, 0.3),
             "return_lse": (False, True), "backward": (False, True)}

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        t = self.tensors(draw_qkv(case, rng), case)
        mods = _Mods(case, rng)
        params = {"scale": case.opts.get("scale"), "enable_gqa": case.hq != case.hkv}
        if mods.mask_kind:
            params["mask_mod"] = mods.mask_mod
        if mods.score_kind:
            params["score_mod"] = mods.score_mod
        t["mods"] = mods
        return Call(t, ("q", "k", "v"), "softmax", "flex_attention", "bhnd", params)

    def call(self, fn, t, case):
        from torch.nn.attention.flex_attention import create_block_mask

        mods, o = t["mods"], case.opts

        def mask_mod(b, h, i, j):        # a function, not a bound method (torch checks)
            return mods.mask_mod(b, h, i, j)

        def score_mod(score, b, h, i, j):
            return mods.score_mod(score, b, h, i, j)

        block = None if not mods.mask_kind else create_block_mask(
            mask_mod, None, None, case.n, case.s, device=self.device)
        res = fn(t["q"], t["k"], t["v"], score_mod=score_mod if mods.score_kind else None,
                 block_mask=block, scale=o.get("scale"), enable_gqa=case.hq != case.hkv,
                 return_lse=bool(o.get("return_lse")))
        if o.get("return_lse"):
            return {"out": res[0], "lse": res[1]}
        return {"out": res}


class JaxDotProductAttention(Convention):
    """``fn(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
    query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None)``, layout
    ``(B, T, N, H)``; ``is_causal`` and the window top-left.  A row with no visible key is
    never drawn (JAX returns the mean of v there, arrayattn zeros)."""

    values = VALUE_CLASSES
    name = "jax_dot_product_attention"
    framework = "jax"
    signature = ("fn(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, "
                 "key_value_seq_lengths=None, local_window_size=None) -> out")
    space = {"is_causal": (False, True), "mask": (None, "bool"), "bias": (None, "float"),
             "scale": (None, 0.3), "key_value_seq_lengths": (False, True),
             "local_window_size": (None, (2, 0), (0, 3), (5, 5)), "backward": (False, True)}

    def normalize(self, case):
        o = case.opts
        if case.dv != case.d:          # jax.nn.dot_product_attention takes one head dim
            case = replace(case, dv=case.d)
        if o.get("local_window_size") and case.n > case.s:
            case = replace(case, n=case.s)
        if o.get("local_window_size") or o.get("is_causal"):
            case = case.with_options(key_value_seq_lengths=None)
        return case.with_options(mask=None) if o.get("local_window_size") else case

    def build(self, case) -> Call:
        rng = np.random.default_rng(case.seed)
        arrays, o = draw_qkv(case, rng), case.opts
        visible = np.ones((case.b, 1, case.n, case.s), dtype=bool)
        i, j = np.arange(case.n)[:, None], np.arange(case.s)[None, :]
        if o.get("is_causal"):
            visible &= j <= i
        if o.get("local_window_size"):
            left, right = o["local_window_size"]
            visible &= (j >= i - left) & (j <= i + right)
        if o.get("mask"):
            m = rng.random((case.b, 1, case.n, case.s)) < 0.7
            m[..., 0] = True
            arrays["mask"], visible = m, visible & m
        if o.get("key_value_seq_lengths"):
            lengths = rng.integers(1, case.s + 1, case.b).astype(np.int32)
            arrays["kv_len"], visible = lengths, visible & (j < lengths[:, None, None, None])
        if o.get("bias"):
            arrays["bias"] = rng.standard_normal((1, 1, case.n, case.s))
        t = self.tensors({k: swap(v) if k in "qkvdo" else v for k, v in arrays.items()}, case)
        params = {"mask": visible, "scale": o.get("scale")}
        if "bias" in t:
            params["bias"] = host(t["bias"])
        params = {k: v for k, v in params.items() if v is not None}
        return Call(t, ("q", "k", "v"), "softmax", None, "bnhd", params, grad_params=params)

    def call(self, fn, t, case):
        o = case.opts
        return {"out": fn(t["q"], t["k"], t["v"], bias=t.get("bias"), mask=t.get("mask"),
                          scale=o.get("scale"), is_causal=bool(o.get("is_causal")),
                          key_value_seq_lengths=t.get("kv_len"),
                          local_window_size=o.get("local_window_size"))}
