"""The convention of vLLM's PagedAttention kernel (``vllm._custom_ops.paged_attention_v1``):
one decode token per sequence over its own paged cache layouts, the output written in place."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .base import draw_qkv, host
from .shipped import ShippedConvention, draw_pages

__all__ = ["VllmPagedAttention", "HEAD_SIZES", "key_cache_layout", "value_cache_layout"]

#: The head sizes vLLM's paged-attention kernels are instantiated for.
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)


def _x(dtype_name: str) -> int:
    """vLLM's ``x``: the elements of one 16-byte vector (8 in 16-bit, 4 in float32)."""
    return 16 // (4 if dtype_name == "float32" else 2)


def key_cache_layout(k_pages: np.ndarray, x: int) -> np.ndarray:
    """``(num_blocks, block_size, num_kv_heads, head_size)`` -> vLLM's key cache
    ``(num_blocks, num_kv_heads, head_size // x, block_size, x)``."""
    nb, bs, h, d = k_pages.shape
    return np.ascontiguousarray(k_pages.reshape(nb, bs, h, d // x, x).transpose(0, 2, 3, 1, 4))


def value_cache_layout(v_pages: np.ndarray) -> np.ndarray:
    """``(num_blocks, block_size, num_kv_heads, head_size)`` -> vLLM's value cache
    ``(num_blocks, num_kv_heads, head_size, block_size)``."""
    return np.ascontiguousarray(v_pages.transpose(0, 2, 3, 1))


def _pages_of(key_cache: np.ndarray, value_cache: np.ndarray) -> tuple:
    """vLLM's caches back to ``(num_blocks, block_size, num_kv_heads, head_size)``."""
    nb, h, dx, bs, x = key_cache.shape
    k = key_cache.transpose(0, 3, 1, 2, 4).reshape(nb, bs, h, dx * x)
    return k, value_cache.transpose(0, 3, 1, 2)


class VllmPagedAttention(ShippedConvention):
    """``fn(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
    block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale)`` -> None:
    vLLM's ``vllm._custom_ops.paged_attention_v1`` (its trailing ``tp_rank`` and
    block-sparse arguments left at their defaults).

    - ``query (num_seqs, num_heads, head_size)``: one decode token per sequence, at
      position ``seq_lens[b] - 1``; it sees all ``seq_lens[b]`` tokens of its cache;
    - ``key_cache (num_blocks, num_kv_heads, head_size // x, block_size, x)`` with ``x =
      16 // element_size`` (8 in float16/bfloat16, 4 in float32), ``value_cache
      (num_blocks, num_kv_heads, head_size, block_size)``; token ``t`` of sequence ``b``
      is slot ``t % block_size`` of block ``block_tables[b, t // block_size]``;
    - ``out (num_seqs, num_heads, head_size)`` written in place (the checker fills it with
      NaN first: a row the kernel leaves unwritten is found); ``scale`` is required (the
      checker passes ``head_size ** -0.5`` or 0.3); ``alibi_slopes (num_heads,)`` float32
      adds ``slope (t - seq_len + 1)`` (vLLM's reference: ``-slope |i - j|`` at the last
      position); ``kv_cache_dtype="auto"``, ``k_scale = v_scale = 1.0`` (float32 tensors);
    - GQA: query head ``i`` reads key/value head ``i // (num_heads // num_kv_heads)``;
      head sizes :data:`HEAD_SIZES`, ``block_size`` 8, 16 or 32.

    Judged against :func:`arrayattn.paged_attention` (the caches mapped back to
    ``(num_blocks, block_size, num_kv_heads, head_size)``).  ``paged_attention_v2`` takes
    the same arguments after its ``exp_sums, max_logits, tmp_out`` scratch tensors: wrap
    it with them to check it here.  vLLM's FlashAttention backend keeps the cache as
    ``(num_blocks, block_size, num_kv_heads, head_size)``: that is
    ``flash_attn_kvcache``'s convention."""

    name = "vllm_paged_attention"
    signature = ("fn(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, "
                 "seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, "
                 "v_scale) -> None (out written)")
    head_dims = HEAD_SIZES
    equal_dims = True
    space = {"scale": (None, 0.3), "alibi_slopes": (False, True), "block_size": (None, 8, 32)}

    def normalize(self, case):
        return super().normalize(replace(case, n=1) if case.n != 1 else case)

    def build_valid(self, case):
        rng = np.random.default_rng(case.seed)
        o = case.opts
        block = o.get("block_size") or 16
        lengths = rng.integers(1, case.s + 1, case.b)
        lengths[0] = case.s
        q = draw_qkv(case, rng)["q"][:, :, 0]                     # (num_seqs, h, d)
        kp, vp, pages = draw_pages(rng, lengths, block, case.hkv, case.d, case.dv)
        width = max(len(p) for p in pages)
        table = np.zeros((case.b, width), dtype=np.int32)       # unused entries: block 0
        for b, p in enumerate(pages):
            table[b, :len(p)] = p
        arrays = {"q": q, "key_cache": key_cache_layout(kp, _x(case.dtype)),
                  "value_cache": value_cache_layout(vp),
                  "block_tables": table, "seq_lens": lengths.astype(np.int32),
                  "do": np.zeros((case.b, case.hq, 1, case.dv))}
        if o.get("alibi_slopes"):
            arrays["alibi_slopes"] = rng.uniform(0.05, 1.0, case.hq)
        t = self.tensors(arrays, case)
        if "alibi_slopes" in t:
            t["alibi_slopes"] = t["alibi_slopes"].float()
        k, v = _pages_of(host(t["key_cache"]), host(t["value_cache"]))
        inputs = {"q": host(t["q"])[:, :, None], "k": k, "v": v, "do": arrays["do"]}
        params = {"block_table": table, "cache_seqlens": arrays["seq_lens"]}
        if o.get("scale") is not None:
            params["scale"] = float(o["scale"])
        if "alibi_slopes" in t:
            params["alibi_slopes"] = host(t["alibi_slopes"])
        return self.judged_call(t, (), params, inputs, [f"seq_lens {lengths.tolist()}"])

    def call_valid(self, fn, t, case):
        import torch
        q = t["q"]                                        # the query
        scale = case.opts.get("scale") or case.d ** -0.5
        out = torch.full_like(q, float("nan"))
        one = torch.ones((), dtype=torch.float32, device=q.device)
        fn(out, q, t["key_cache"], t["value_cache"], case.hkv, float(scale),
           t["block_tables"], t["seq_lens"], case.opts.get("block_size") or 16,
           int(t["seq_lens"].max()), t.get("alibi_slopes"), "auto", one, one)
        return {"out": out[:, :, None]}
