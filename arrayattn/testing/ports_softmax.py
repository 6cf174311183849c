"""The profiles of exact-softmax kernels: torch SDPA, FlashAttention and torch FlexAttention."""
from __future__ import annotations

import re

import numpy as np

from .measures import is_array
from .records import Prepared, Profile, repeat_kv_heads, take_options

__all__ = ["SDPA", "FLASH_ATTN", "FLEX_ATTENTION", "prepare_sdpa", "prepare_flash_attn",
           "prepare_flex_attention", "window_pair", "flash_alibi_lse_shift", "FLASH_OPTIONS",
           "packed_alibi_bias", "flash_alibi_ref_shift"]


def prepare_sdpa(q, k, v, params) -> Prepared:
    """``torch.nn.functional.scaled_dot_product_attention``."""
    o = take_options(params, "sdpa", {"attn_mask": None, "is_causal": False, "scale": None,
                                      "enable_gqa": False, "dropout_p": 0.0})
    if o["dropout_p"]:
        raise ValueError("dropout_p must be 0 to validate SDPA (dropout is random)")
    if o["enable_gqa"]:
        k, v = repeat_kv_heads(q, k, v, "enable_gqa")
    if o["is_causal"] and o["attn_mask"] is not None:
        raise ValueError("SDPA refuses attn_mask together with is_causal=True")
    opts = {} if o["scale"] is None else {"scale": float(o["scale"])}
    if o["is_causal"]:
        # SDPA aligns is_causal top-left: query i sees keys j <= i (arrayattn's causal
        # is end-aligned, j <= i + s - n).  An explicit mask reproduces SDPA's.
        opts["mask"] = np.tril(np.ones((q.shape[-2], k.shape[-2]), dtype=bool))
    elif o["attn_mask"] is not None:
        m = np.asarray(o["attn_mask"])
        # a float attn_mask is an additive logit bias (-inf entries: masked)
        opts["mask" if m.dtype == bool else "bias"] = m
    return Prepared("softmax", q, k, v, opts)


def window_pair(value) -> tuple:
    """FlashAttention's ``window_size`` -- a pair, a 2-element integer array, or the text
    ``"l,r"`` / ``"(l, r)"`` of a command line -- as ``(left, right)`` with ``-1`` as
    ``None`` (unbounded)."""
    pair = value
    if isinstance(value, str):
        pair = re.sub(r"[()\[\]\s]", "", value).split(",")
        pair = [int(p) if re.fullmatch(r"-?\d+", p) else p for p in pair]
    pair = np.asarray(pair) if isinstance(pair, (tuple, list)) or is_array(pair) else None
    if pair is None or pair.shape != (2,) or pair.dtype.kind not in "iu":
        raise ValueError(f"window_size must be a pair of integers (-1: unbounded); got "
                         f"{value!r}")
    return tuple(None if x < 0 else int(x) for x in pair.tolist())


def _row_positions(q, k, o) -> tuple:
    """Each query's position among its keys, ``i + s - n`` (per packed segment, per paged
    sequence): ``(n,)``, ``(B, n)`` paged or ``(total_q,)`` packed, with the segment of each
    packed query."""
    if o["cache_seqlens"] is not None:
        n = q.shape[-2]
        return np.asarray(o["cache_seqlens"])[:, None] - n + np.arange(n), None
    if o["cu_seqlens_q"] is not None:
        cq, ck = np.asarray(o["cu_seqlens_q"]), np.asarray(o["cu_seqlens_k"])
        seg = np.searchsorted(cq, np.arange(q.shape[-2]), side="right") - 1
        return np.arange(q.shape[-2]) - cq[seg] + (ck[seg + 1] - ck[seg]) - (
            cq[seg + 1] - cq[seg]), seg
    return np.arange(q.shape[-2]) + k.shape[-2] - q.shape[-2], None


def flash_alibi_lse_shift(q, k, o, window) -> np.ndarray | None:
    """FlashAttention's causal kernel adds ALiBi as ``+slope j`` (the same bias vector for
    every row), arrayattn as ``-slope |i + s - n - j|``: equal after the softmax, but the
    kernel's log-sum-exp is larger by ``slope (i + s - n)``.  That shift, broadcasting
    against the ``lse`` (``None`` when FlashAttention takes its non-causal path: its
    ``is_causal`` is a right window of 0 and no left window, one of ``>= seqlen_k`` dropped)."""
    slopes = o["alibi_slopes"]
    if o["block_table"] is not None:
        keys = o["block_table"].shape[-1] * k.shape[1]      # the cache's capacity
    elif o["cu_seqlens_k"] is not None:
        keys = int(np.diff(np.asarray(o["cu_seqlens_k"])).max(initial=0))
    else:
        keys = k.shape[-2]
    left = None if window[0] is None or window[0] >= keys else window[0]   # as mha_fwd
    if slopes is None or left is not None or window[1] != 0:
        return None
    slopes = np.asarray(slopes, dtype=np.float64)
    pos, seg = _row_positions(q, k, o)
    if seg is not None:                         # packed: (h, total_q)
        per_row = slopes[seg].T if slopes.ndim == 2 else slopes[:, None]
        return per_row * pos
    if pos.ndim == 2:                           # paged: (b, h, n)
        return (slopes[:, :, None] if slopes.ndim == 2 else slopes[None, :, None]) * pos[
            :, None, :]
    return slopes[..., None] * pos


def flash_alibi_ref_shift(q, k, o) -> np.ndarray | None:
    """FlashAttention's ``attention_ref`` forms causal ALiBi as ``slope (j - s + 1)``
    (``attn_bias_from_alibi_slopes``, with any window): larger than arrayattn's ``-slope
    |i + s - n - j|`` by ``slope (i + s - n - s + 1)`` per row (``s`` each sequence's
    keys); ``None`` without causal ALiBi or for a paged cache."""
    slopes = o["alibi_slopes"]
    if slopes is None or not o["causal"] or o["block_table"] is not None:
        return None
    slopes = np.asarray(slopes, dtype=np.float64)
    pos, seg = _row_positions(q, k, o)
    if seg is not None:
        keys = np.diff(np.asarray(o["cu_seqlens_k"]))[seg]
        return (slopes[seg].T if slopes.ndim == 2 else slopes[:, None]) * (pos - keys + 1)
    return slopes[..., None] * (pos - k.shape[-2] + 1)


FLASH_OPTIONS = {"softmax_scale": None, "causal": False, "window_size": (-1, -1),
                 "softcap": 0.0, "alibi_slopes": None, "dropout_p": 0.0,
                 "dropout_mask": None, "deterministic": False, "return_attn_probs": False,
                 "cu_seqlens_q": None, "cu_seqlens_k": None, "max_seqlen_q": None,
                 "max_seqlen_k": None, "block_table": None, "cache_seqlens": None}


def prepare_flash_attn(q, k, v, params) -> Prepared:
    """FlashAttention's ``flash_attn_func``, ``flash_attn_varlen_func`` and
    ``flash_attn_with_kvcache``."""
    o = take_options(params, "flash_attn", FLASH_OPTIONS)
    if o["dropout_p"] and o["dropout_mask"] is None:
        raise ValueError("dropout_p > 0 needs dropout_mask= (the keep-mask the kernel drew, "
                         "bool (b, h, n, s)): dropout is random")
    window = window_pair(o["window_size"])
    if o["causal"]:
        window = (window[0], 0)
    opts = {key: o[key] for key in ("alibi_slopes", "dropout_mask", "cu_seqlens_q",
                                    "cu_seqlens_k", "block_table", "cache_seqlens")
            if o[key] is not None}
    if window != (None, None):
        opts["window"] = window
    if o["softmax_scale"] is not None:
        opts["scale"] = float(o["softmax_scale"])
    if o["softcap"]:
        opts["softcap"] = float(o["softcap"])
    if o["dropout_mask"] is not None:
        opts["dropout_p"] = float(o["dropout_p"])
    if o["cu_seqlens_q"] is not None and opts.get("alibi_slopes") is not None and np.ndim(
            opts["alibi_slopes"]) == 2:
        opts["bias"] = packed_alibi_bias(q, k, o, opts.pop("alibi_slopes"))
    shift = flash_alibi_ref_shift(q, k, o)
    return Prepared("softmax", q, k, v, opts,
                    lse_shift=flash_alibi_lse_shift(q, k, o, window),
                    form_shifts=() if shift is None else (shift,))


def packed_alibi_bias(q, k, o, slopes) -> np.ndarray:
    """Per-sequence ALiBi slopes ``(b, h)`` of a packed (varlen) call as the bias
    ``-slope[seq(i), h] |pos_i - pos_j|`` ``(h, total_q, total_k)``, positions counted
    within each sequence and queries end-aligned with their keys (entries across sequences
    are masked by the segments anyway)."""
    pos_q, seg = _row_positions(q, k, o)
    ck = np.asarray(o["cu_seqlens_k"])
    keys = np.arange(k.shape[-2])
    pos_k = keys - ck[np.searchsorted(ck, keys, side="right") - 1]
    slopes = np.asarray(slopes, dtype=np.float64)[seg].T          # (h, total_q)
    return -slopes[:, :, None] * np.abs(pos_q[:, None] - pos_k[None, :])


def _to_torch(x):
    import torch
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def prepare_flex_attention(q, k, v, params) -> Prepared:
    """torch's ``flex_attention`` (``torch.nn.attention.flex_attention``)."""
    o = take_options(params, "flex_attention", {
        "score_mod": None, "block_mask": None, "mask_mod": None, "scale": None,
        "enable_gqa": False, "return_lse": False, "kernel_options": None})
    mask_mod = o["mask_mod"]
    if o["block_mask"] is not None:
        if mask_mod is not None:
            raise ValueError("give block_mask= or mask_mod=, not both")
        mask_mod = getattr(o["block_mask"], "mask_mod", None)
        if mask_mod is None:
            raise ValueError("block_mask has no mask_mod: pass the mask_mod it was built from")
    for name, fn in (("score_mod", o["score_mod"]), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} is a callable given from Python, not from a file "
                             f"(got {type(fn).__name__})")
    if o["enable_gqa"]:
        k, v = repeat_kv_heads(q, k, v, "enable_gqa")
    opts = {} if o["scale"] is None else {"scale": float(o["scale"])}
    opts.update({key: fn for key, fn in (("score_mod", o["score_mod"]), ("mask_mod", mask_mod))
                 if fn is not None})
    convert = None
    if opts.keys() & {"score_mod", "mask_mod"}:
        try:
            import torch  # noqa: F401  (the hooks are written with torch operations)
            convert = _to_torch
        except ImportError:
            pass
    return Prepared("softmax", q, k, v, opts, convert=convert)


SDPA = Profile(
    "sdpa", "torch.nn.functional.scaled_dot_product_attention", "bhnd",
    "attn_mask (bool, or float: an additive bias), is_causal, scale, enable_gqa, dropout_p=0",
    "is_causal is top-left aligned (query i sees keys j <= i), reproduced by an "
    "explicit mask; GQA repeats each key/value head over consecutive query heads, "
    "reproduced; a float attn_mask is an additive logit bias, passed as bias= "
    "(-inf entries mask).", prepare_sdpa)

FLASH_ATTN = Profile(
    "flash_attn", "flash-attn flash_attn_func, flash_attn_varlen_func, "
    "flash_attn_with_kvcache", "bnhd",
    "softmax_scale (None: d^-1/2), causal, window_size (default (-1, -1); a pair, or "
    "'l,r' on the command line), softcap (0.0: off), alibi_slopes, dropout_p with "
    "dropout_mask (the keep-mask, bool (b, h, n, s)), cu_seqlens_q, cu_seqlens_k, "
    "max_seqlen_q, max_seqlen_k (ignored), block_table with cache_seqlens (k, v are then "
    "the caches (num_blocks, page, h_kv, d)), deterministic, return_attn_probs (ignored)",
    "causal and window_size end-aligned as arrayattn's (window, softcap, alibi_slopes, "
    "scale map one to one); GQA by fewer k, v heads as arrayattn's; lse is (b, h, n) "
    "((h, total_q) packed), +inf on a row with no key (either infinity agrees). With "
    "causal and alibi_slopes the kernel adds +slope j (the same bias on every row): its lse "
    "is larger by slope (i + s - n) than arrayattn's, and the profile shifts the reference "
    "lse by that; the output is the same. Dropout is judged on the kernel's own keep-mask "
    "only (FlashAttention's S_dmask >= 0 after its tests' convert_flash_attn_S_to_softmax).",
    prepare_flash_attn)

FLEX_ATTENTION = Profile(
    "flex_attention", "torch flex_attention (torch.nn.attention.flex_attention)", "bhnd",
    "scale, enable_gqa, score_mod, mask_mod or block_mask (callables: Python only), "
    "return_lse, kernel_options (ignored)",
    "score_mod and mask_mod are Python callables: they cannot come from an .npz file, so "
    "`arrayattn validate` judges only scale and enable_gqa; from Python pass them (or the "
    "block_mask, whose mask_mod is used) to compare_to_reference. They are evaluated on "
    "broadcast index arrays, on torch float64 tensors when torch is installed, so a hook "
    "written with torch operations runs unchanged. A block_mask's block sparsity is "
    "assumed to be its mask_mod's; GQA repeats each key/value head over consecutive query "
    "heads, reproduced. lse is (b, h, n), -inf on a row with no key.",
    prepare_flex_attention)
