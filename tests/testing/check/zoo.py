"""A zoo of deliberately broken attention kernels (pure torch), each a bug a kernel author
could plausibly make, with the conventions' signatures; ``bug=None`` is the clean kernel."""
from __future__ import annotations

import functools
import math

import torch

NEG = float("-inf")


def _visible(n, s, causal, window, bug, offset=None):
    """FlashAttention's bottom-right causal/window visibility (n, s)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(s)[None, :]
    off = (s - n) if offset is None else offset
    if bug == "causal_top_left":
        off = 0
    vis = torch.ones(n, s, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
        if bug == "window_ignored_causal":
            left = -1
    if left is not None and left >= 0:
        vis &= j >= i + off - left - (1 if bug == "window_off_by_one" else 0)
    if right is not None and right >= 0:
        vis &= j <= i + off + right
    return vis


def _attend(q, k, v, *, scale, vis, softcap=0.0, alibi=None, bug=None, offset=0,
            causal_alibi=False):
    """Softmax attention of (b, h, n, d) in float32 with the bugs; returns (out, lse)."""
    dt = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    hq, hkv = q.shape[1], k.shape[1]
    idx = torch.arange(hq) % hkv if bug == "gqa_mod" else torch.arange(hq) // (hq // hkv)
    if bug == "gqa_grad_one_head" and hq != hkv:
        k, v = _OneHead.apply(k, idx, hq // hkv), _OneHead.apply(v, idx, hq // hkv)
    else:
        k, v = k[:, idx], v[:, idx]
    if bug == "scale_twice":
        scale = scale * scale
    elif bug == "no_scale":
        scale = 1.0
    s = q @ k.transpose(-1, -2) * scale
    if bug == "softcap_before_scale" and softcap:
        s = softcap * torch.tanh(s / scale / softcap) * scale
    n, m = s.shape[-2:]
    if m == 0:  # no key at all: zeros, lse +inf (FlashAttention's)
        return (torch.zeros(*q.shape[:-1], v.shape[-1]).to(dt),
                torch.full(q.shape[:-1], float("inf")))
    if softcap and bug not in ("softcap_after_mask", "softcap_before_scale"):
        s = s / softcap if bug == "softcap_no_factor" else softcap * torch.tanh(s / softcap)
    if alibi is not None:
        i = torch.arange(n)[:, None] + offset
        dist = (i - torch.arange(m)[None, :]).abs().float()
        if causal_alibi:  # FlashAttention's causal kernel adds +slope j (same softmax)
            dist = -torch.arange(m)[None, :].float().expand(n, m)
        sign = 1.0 if bug == "alibi_sign" else -1.0
        slopes = alibi.float().reshape(-1 if alibi.ndim == 1 else alibi.shape[0], *(
            () if alibi.ndim == 1 else (hq,)))
        slopes = slopes[None, :, None, None] if alibi.ndim == 1 else slopes[:, :, None, None]
        if bug == "alibi_first_head":
            slopes = slopes[:, :1].expand(slopes.shape)
        s = s + sign * slopes * dist
    if bug == "tile_drops_last_key" and n > 64:
        vis = vis.clone()
        vis[64:, -1] = False
    unmasked = s
    s = s.masked_fill(~vis, NEG)
    if softcap and bug == "softcap_after_mask":
        s = softcap * torch.tanh(s / softcap)
    mx = s.amax(-1, keepdim=True)
    empty = torch.isinf(mx)
    if bug == "no_max_shift":
        mx = torch.zeros_like(mx)
    safe = torch.where(empty, torch.zeros_like(mx), mx)
    p = torch.exp(s - safe)
    den = p.sum(-1, keepdim=True)
    if bug == "empty_row_mean":
        p = torch.where(empty, torch.ones_like(p), p)
        den = p.sum(-1, keepdim=True)
    elif bug != "empty_row_nan":
        den = torch.where(empty, torch.ones_like(den), den)
    if bug == "fp16_pv" and dt == torch.float16:
        acc = torch.zeros(*p.shape[:-1], v.shape[-1], dtype=torch.float16)
        for j in range(m):
            acc = acc + (p[..., j:j + 1] * v[..., j:j + 1, :]).half()
        out = acc.float() / den
    else:
        out = (p @ v) / den
    if bug == "dv_unmasked_p":   # dv from P over every key, hidden ones included
        p_all = torch.where(empty, 0.0, torch.exp(unmasked - safe) / den).detach()
        out = (p @ v.detach()) / den + (p_all @ v - (p_all @ v).detach())
    lse = (torch.log(den) + safe)[..., 0]
    if bug == "lse_unscaled":
        lse = torch.logsumexp((s / scale).masked_fill(~vis, NEG), -1)
    if bug == "lse_log2":
        lse = lse / math.log(2)
    elif bug == "lse_no_max":
        lse = torch.log(den)[..., 0]
    lse = torch.where(empty[..., 0], torch.full_like(lse, float("inf")), lse)
    return out.to(dt), lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, bug=None, seqlen_k=None):
    """flash_attn_func's signature, (b, n, h, d); ``seqlen_k``: the key length mha_fwd
    tests a window against (varlen: max_seqlen_k; paged: the cache's capacity)."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    n, s, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = softmax_scale or (v.shape[-1] if bug == "sqrt_dv" else d) ** -0.5
    vis = _visible(n, s, causal, window_size, bug)
    if bug == "dk_missing_scale":
        k = k.detach() + (k - k.detach()) / scale
    if bug == "dv_not_transposed" and n != s:
        v = _DvBug.apply(v)
    left = window_size[0]
    out, lse = _attend(q, k, v, scale=scale, vis=vis, softcap=softcap, alibi=alibi_slopes,
                       bug=bug, offset=s - n, causal_alibi=(  # mha_fwd's is_causal test
                           bool(causal) or window_size[1] == 0) and (
                           left is None or left < 0 or left >= (seqlen_k or s)))
    out = out.transpose(1, 2)
    return (out, lse, None) if return_attn_probs else out


class _OneHead(torch.autograd.Function):
    """Key/value heads repeated over their group; the backward keeps the first query head's
    gradient of each group instead of the sum."""

    @staticmethod
    def forward(ctx, x, idx, group):
        ctx.group = group
        return x[:, idx]

    @staticmethod
    def backward(ctx, g):
        return g[:, ::ctx.group], None, None


class _DvBug(torch.autograd.Function):
    """dv through a wrongly laid-out P: the right values, rows permuted (n != s only)."""

    @staticmethod
    def forward(ctx, v):
        return v.clone()

    @staticmethod
    def backward(ctx, g):
        return g.roll(1, dims=-2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, bug=None):
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k0, k1 = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if bug == "varlen_off_by_one" and b > 0:
            k0 = max(k0 - 1, 0)
        sl = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.ndim == 1
                                                else alibi_slopes[b:b + 1])
        o, lse, _ = flash_attn_func(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                    softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size, softcap=softcap, alibi_slopes=sl,
                                    return_attn_probs=True, seqlen_k=int(max_seqlen_k))
        outs.append(o[0])
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, return_softmax_lse=False, *,
                            bug=None):
    page = k_cache.shape[1]
    outs, lses = [], []
    for b in range(q.shape[0]):
        length = int(cache_seqlens[b])
        if bug == "partial_page_ignored":
            length = length // page * page
        elif bug == "kvcache_past_seqlens":
            length = min(-(-length // page) * page, block_table.shape[1] * page)
        first = 0   # the whole pages before every query's window are never read
        if window_size[0] is not None and window_size[0] >= 0 and bug != "reads_window_pages":
            first = max(length - q.shape[1] - window_size[0], 0) // page * page
        k = k_cache[block_table[b].long()].reshape(-1, *k_cache.shape[2:])[first:length]
        v = v_cache[block_table[b].long()].reshape(-1, *v_cache.shape[2:])[first:length]
        sl = None if alibi_slopes is None else (alibi_slopes if alibi_slopes.ndim == 1
                                                else alibi_slopes[b:b + 1])
        o, lse, _ = flash_attn_func(q[b:b + 1], k[None], v[None], softmax_scale=softmax_scale,
                                    causal=causal, window_size=window_size, softcap=softcap,
                                    alibi_slopes=sl, return_attn_probs=True,
                                    seqlen_k=block_table.shape[1] * page)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_softmax_lse else out


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, *, bug=None):
    """torch SDPA's signature: top-left is_causal (bottom-right with the bug)."""
    n, s = q.shape[-2], k.shape[-2]
    vis = torch.ones(n, s, dtype=torch.bool)
    if is_causal:
        vis = _visible(n, s, True, (-1, 0), None, offset=(s - n) if bug == "bottom_right" else 0)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            vis = vis & attn_mask
        else:
            bias = attn_mask
    scale = scale or q.shape[-1] ** -0.5
    if bias is not None:
        q = torch.cat([q, torch.ones_like(q[..., :1])], -1)
        return _attend_bias(q, k, v, bias, scale, vis)
    return _attend(q, k, v, scale=scale, vis=vis, bug=bug)[0]


def _attend_bias(q, k, v, bias, scale, vis):
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        raise NotImplementedError("float attn_mask with GQA")
    s = q[..., :-1].float() @ k.float().transpose(-1, -2) * scale + bias.float()
    return torch.softmax(s.masked_fill(~vis, NEG), -1).nan_to_num(0.0).to(v.dtype) @ v


# -- fla -------------------------------------------------------------------------------
def _recurrence(q, k, v, scale, initial_state, output_final_state, step, bug):
    """o_t = scale q_t S_t, S_t = step(S_{t-1}, t); layout (B, T, H, K)."""
    B, T, H, K = q.shape
    dt = q.dtype
    q, k, v = q.float() * scale, k.float(), v.float()
    S = torch.zeros(B, H, K, v.shape[-1]) if initial_state is None or bug == "init_ignored" \
        else initial_state.float()
    outs, states = [], [S]
    for t in range(T):
        S = step(S, t, k[:, t], v[:, t])
        states.append(S)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    out = torch.stack(outs, 1).to(dt)
    final = states[(T - 1) // 16 * 16] if bug == "state_missing_last_chunk" and T % 16 \
        else S
    return out, (final if output_final_state else None)


def fla_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, *,
            bug=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = g.float()

    def step(S, t, kt, vt):
        gt = g[:, max(t - 1, 0)] if bug == "gate_late" else g[:, t]
        return S * gt.exp()[..., None] + kt[..., None] * vt[..., None, :]
    return _recurrence(q, k, v, scale, initial_state, output_final_state, step, bug)


def fla_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, *,
                   bug=None):
    # expanded in float32: dg sums its K components there and rounds once (expanding the
    # float16 g would round each component's gradient to float16 first: inf at 30x inputs)
    return fla_gla(q, k, v, g.float()[..., None].expand(q.shape), scale, initial_state,
                   output_final_state, bug=bug)


def fla_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                   *, bug=None):
    return fla_gated_delta_rule(q, k, v, None, beta, scale, initial_state, output_final_state,
                                bug=bug)


def fla_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                         output_final_state=False, *, bug=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b = beta.float()

    def step(S, t, kt, vt):
        if g is not None:
            gi = max(t - 1, 0) if bug == "gate_late" else t
            S = S * g[:, gi].float().exp()[..., None, None]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        bt = b[:, t][..., None]
        delta = bt * vt - pred if bug == "beta_on_v_only" else bt * (vt - pred)
        return S + kt[..., None] * delta[..., None, :]
    return _recurrence(q, k, v, scale, initial_state, output_final_state, step, bug)


def jax_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                  key_value_seq_lengths=None, local_window_size=None, bug=None):
    """jax.nn.dot_product_attention's signature over the real one, with a bug."""
    import jax
    import jax.numpy as jnp
    if bug == "jax_bottom_right" and is_causal:
        T, S = query.shape[1], key.shape[1]
        cm = jnp.tril(jnp.ones((T, S), bool), k=S - T)[None, None]
        mask = cm if mask is None else mask & cm
        is_causal = False
    return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale,
                                        is_causal=is_causal,
                                        key_value_seq_lengths=key_value_seq_lengths,
                                        local_window_size=local_window_size)


#: (convention, kernel, bug): the zoo.
ZOO = [("flash_attn", flash_attn_func, b) for b in (
    "causal_top_left", "window_off_by_one", "gqa_mod", "no_max_shift", "scale_twice",
    "sqrt_dv", "softcap_no_factor", "softcap_after_mask", "alibi_sign", "lse_log2",
    "lse_no_max", "empty_row_nan", "empty_row_mean", "dk_missing_scale", "dv_not_transposed",
    "fp16_pv", "tile_drops_last_key")] + [
    ("flash_attn_varlen", flash_attn_varlen_func, "varlen_off_by_one"),
    ("flash_attn_kvcache", flash_attn_with_kvcache, "partial_page_ignored"),
    ("sdpa", sdpa, "bottom_right"),
    ("fla_gla", fla_gla, "state_missing_last_chunk"), ("fla_gla", fla_gla, "gate_late"),
    ("fla_simple_gla", fla_simple_gla, "init_ignored"),
    ("fla_delta_rule", fla_delta_rule, "beta_on_v_only"),
    ("fla_gated_delta_rule", fla_gated_delta_rule, "gate_late"),
    ("jax_dot_product_attention", jax_attention, "jax_bottom_right"),
]

#: More bugs, judged by the explanation's tests only (tests/testing/check/test_explain.py):
#: (convention, kernel, bug, the named deviation expected).
MORE = [("flash_attn", flash_attn_func, "no_scale", "scale_one"),
        ("flash_attn", flash_attn_func, "alibi_first_head", "alibi_first_head"),
        ("flash_attn", flash_attn_func, "lse_unscaled", "lse_unscaled"),
        ("flash_attn", flash_attn_func, "softcap_before_scale", "softcap_before_scale"),
        ("flash_attn_kvcache", flash_attn_with_kvcache, "kvcache_past_seqlens",
         "kvcache_past_seqlens"),
        ("flash_attn", flash_attn_func, "dv_unmasked_p", "dv_unmasked_p")]

#: Bugs the search reaches by random draws only (too slow for a test's budget), explained
#: on a given case: (bug, the case's options, the named deviation expected).
GIVEN = [("gqa_grad_one_head", {"backward": True}, "grouped_dkdv_one_head"),
         ("window_ignored_causal", {"causal": True, "window_size": (2, 5)},
          "window_ignored_when_causal")]

#: The named deviation of each ZOO bug (None: none in the catalogue).
EXPECTED = {
    "causal_top_left": "causal_top_left", "window_off_by_one": "window_left_plus_one",
    "gqa_mod": "gqa_tiled", "no_max_shift": None, "scale_twice": "scale_twice",
    "sqrt_dv": "scale_sqrt_dv", "softcap_no_factor": "softcap_division",
    "softcap_after_mask": "softcap_after_bias", "alibi_sign": "alibi_sign",
    "lse_log2": "lse_base2", "lse_no_max": "lse_no_max", "empty_row_nan": "empty_rows_nan",
    "empty_row_mean": "empty_rows_mean", "dk_missing_scale": "dk_missing_scale",
    "dv_not_transposed": None, "fp16_pv": None, "tile_drops_last_key": None,
    "varlen_off_by_one": "varlen_across_boundary",
    "partial_page_ignored": "kvcache_partial_page_ignored",
    "bottom_right": "causal_bottom_right", "state_missing_last_chunk": None,
    "gate_late": "gates_one_token_late", "init_ignored": "initial_state_ignored",
    "beta_on_v_only": "delta_beta_on_v_only", "jax_bottom_right": "causal_bottom_right"}

#: The clean kernels, one per convention.
CLEAN = {conv: fn for conv, fn, _ in ZOO}


def broken(fn, bug):
    return functools.partial(fn, bug=bug)
