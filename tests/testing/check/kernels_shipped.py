"""Pure-torch kernels with the exact signatures of the kernels people ship (xFormers,
FlashInfer, vLLM, the Triton tutorial), each with plausible bugs; ``bug=None`` is the clean
kernel.  They implement each library's documented semantics on their own (they read the
``attn_bias`` objects' fields, the page tables, vLLM's split key layout), independently of
the conventions' mapping onto arrayattn."""
from __future__ import annotations

import functools
import math

import torch

NEG = float("-inf")
LOG2E = 1.0 / math.log(2.0)


def _attend(q, k, v, scale, keep=None, bias=None, softcap=None):
    """Softmax attention in float32 over ``(..., h, n, d)`` (fewer key/value heads grouped
    consecutively): ``(out, lse)`` (natural lse, ``-inf`` on a row with no key, whose output
    is 0)."""
    dt = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq != hkv:
        idx = torch.arange(hq) // (hq // hkv)
        k, v = k[..., idx, :, :], v[..., idx, :, :]
    s = q @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.float()
    if keep is not None:
        s = s.masked_fill(~keep, NEG)
    mx = s.amax(-1, keepdim=True)
    empty = torch.isinf(mx)
    safe = torch.where(empty, torch.zeros_like(mx), mx)
    p = torch.exp(s - safe)
    den = p.sum(-1, keepdim=True)
    out = (p @ v) / torch.where(den == 0, torch.ones_like(den), den)
    return out.to(dt), (torch.log(den) + safe)[..., 0]


def _grid(m, n):
    return torch.arange(m)[:, None], torch.arange(n)[None, :]


# -- xFormers ----------------------------------------------------------------------------
def _xformers_bias(attn_bias, m, n, bug):
    """``(keep (m, n) or None, additive bias or None)`` of an ``attn_bias`` (real xFormers
    classes or the checker's stand-ins: read by class name and fields)."""
    if attn_bias is None:
        return None, None
    if isinstance(attn_bias, torch.Tensor):
        return None, (None if bug == "bias_ignored" else attn_bias)
    kind = type(attn_bias).__name__
    i, j = _grid(m, n)
    shift = n - m
    if kind == "LowerTriangularMask":
        return j <= i, None
    if kind == "LowerTriangularMaskWithTensorBias":
        return j <= i, (None if bug == "bias_ignored" else attn_bias._bias)
    if kind == "LowerTriangularFromBottomRightMask":
        return j <= i + (0 if bug == "bottom_right_as_top_left" else shift), None
    if kind == "LowerTriangularFromBottomRightLocalAttentionMask":
        w = attn_bias._window_size
        return (j <= i + shift) & (j > i + shift - w), None
    if kind == "LocalAttentionFromBottomRightMask":
        return ((j >= i + shift - attn_bias.window_left)
                & (j <= i + shift + attn_bias.window_right)), None
    if kind.startswith("BlockDiagonal"):
        keep = torch.zeros(m, n, dtype=torch.bool)
        qs, ks = attn_bias.q_seqinfo.seqstart_py, attn_bias.k_seqinfo.seqstart_py
        for q0, q1, k0, k1 in zip(qs, qs[1:], ks, ks[1:]):
            bi, bj = _grid(q1 - q0, k1 - k0)
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            bottom = kind == "BlockDiagonalCausalFromBottomRightMask" or (
                kind == "BlockDiagonalCausalMask" and bug == "block_causal_bottom_right")
            if bottom:
                block = bj <= bi + (k1 - k0) - (q1 - q0)
            elif kind == "BlockDiagonalCausalMask":
                block = bj <= bi
            keep[q0:q1, k0:k1] = block
        return keep, None
    raise NotImplementedError(kind)


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *,
                               bug=None):
    """xFormers' signature: ``(B, M, H, K)`` or grouped ``(B, M, G, H, K)``."""
    if p:
        raise NotImplementedError("dropout")
    grouped = query.ndim == 5
    if grouped:
        b, m, g, h, kd = query.shape
        if bug == "groups_mixed":      # every group reads group 0's keys and values
            key, value = key[:, :, :1].expand(key.shape), value[:, :, :1].expand(value.shape)
        query, key, value = (x.reshape(x.shape[0], x.shape[1], g * h, x.shape[-1])
                             for x in (query, key, value))
        if isinstance(attn_bias, torch.Tensor):
            attn_bias = attn_bias.reshape(b, g * h, *attn_bias.shape[-2:])
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if bug == "scale_twice":
        scale = scale * scale
    keep, bias = _xformers_bias(attn_bias, q.shape[-2], k.shape[-2], bug)
    if bias is not None and bias.ndim == 5:       # a grouped (B, G, H, M, N) tensor bias
        bias = bias.reshape(bias.shape[0], -1, *bias.shape[-2:])
    out = _attend(q, k, v, scale, keep, bias)[0].transpose(1, 2)
    if grouped:
        out = out.reshape(*out.shape[:2], g, h, out.shape[-1])
    return out


# -- FlashInfer --------------------------------------------------------------------------
def single_prefill_with_kv_cache(q, k, v, custom_mask=None, causal=False, kv_layout="NHD",
                                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False,
                                 sm_scale=None, window_left=-1, logits_soft_cap=None,
                                 return_lse=False, *, bug=None):
    """FlashInfer's signature: q ``(qo_len, H, D)``, k, v ``NHD`` or ``HND``; lse base 2."""
    if pos_encoding_mode != "NONE" or custom_mask is not None:
        raise NotImplementedError(pos_encoding_mode)
    if kv_layout == "NHD" or bug == "hnd_as_nhd":
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    q = q.transpose(0, 1)                                       # (H, n, D)
    m, n = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    i, j = _grid(m, n)
    shift = 0 if bug == "causal_top_left" else n - m
    keep = torch.ones(m, n, dtype=torch.bool)
    if causal:
        keep &= j <= i + shift
    if window_left is not None and window_left >= 0:
        keep &= (j > i + n - m - window_left) if bug == "window_exclusive" else (
            j >= i + n - m - window_left)
    cap = logits_soft_cap or None
    if cap and bug == "softcap_before_scale":     # the cap on the unscaled logits
        qq, kk, vv = q.float(), _rep(k, q).float(), _rep(v, q).float()
        s = cap * torch.tanh((qq @ kk.transpose(-1, -2)) / cap) * scale
        s = s.masked_fill(~keep, NEG)
        lse = torch.logsumexp(s, -1)
        out = (torch.softmax(s, -1).nan_to_num(0.0) @ vv).to(q.dtype)
    else:
        out, lse = _attend(q, k, v, scale, keep, None, cap)
    out = out.transpose(0, 1)
    lse = lse.transpose(0, 1) * (1.0 if bug == "lse_natural" else LOG2E)
    return (out, lse) if return_lse else out


def _rep(k, q):
    hq, hkv = q.shape[-3], k.shape[-3]
    return k if hq == hkv else k[..., torch.arange(hq) // (hq // hkv), :, :]


def single_decode_with_kv_cache(q, k, v, kv_layout="NHD", pos_encoding_mode="NONE",
                                use_tensor_cores=False, q_scale=None, k_scale=None,
                                v_scale=None, window_left=-1, logits_soft_cap=None,
                                sm_scale=None, return_lse=False, *, bug=None):
    """FlashInfer's signature: q ``(H, D)``."""
    res = single_prefill_with_kv_cache(q[None], k, v, causal=False, kv_layout=kv_layout,
                                       pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale,
                                       window_left=window_left,
                                       logits_soft_cap=logits_soft_cap, return_lse=True,
                                       bug=bug)
    out, lse = res[0][0], res[1][0]
    return (out, lse) if return_lse else out


def _request_kv(paged_kv_cache, kv_layout, pages, last, bug):
    """One request's k, v ``(kv_len, H, D)`` from the combined paged cache."""
    cache = paged_kv_cache[pages.long()]
    if kv_layout == "HND":
        cache = cache.transpose(2, 3)                           # (pages, 2, page, H, D)
    page = cache.shape[2]
    length = (len(pages) - 1) * page + int(last)
    if bug == "last_page_full":
        length = len(pages) * page
    k = cache[:, 0].reshape(-1, *cache.shape[3:])[:length]
    v = cache[:, 1].reshape(-1, *cache.shape[3:])[:length]
    return k, v


def batch_prefill(q, paged_kv_cache, qo_indptr, paged_kv_indptr, paged_kv_indices,
                  paged_kv_last_page_len, *, causal=False, kv_layout="NHD", sm_scale=None,
                  window_left=-1, logits_soft_cap=None, return_lse=False, bug=None):
    """FlashInfer's batch prefill (plan + run) as one function, paged cache combined."""
    outs, lses = [], []
    for b in range(len(qo_indptr) - 1):
        pages = paged_kv_indices[int(paged_kv_indptr[b]):int(paged_kv_indptr[b + 1])]
        k, v = _request_kv(paged_kv_cache, kv_layout, pages, paged_kv_last_page_len[b], bug)
        o, lse = single_prefill_with_kv_cache(
            q[int(qo_indptr[b]):int(qo_indptr[b + 1])], k, v, causal=causal,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap,
            return_lse=True, bug=bug)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_lse else out


def batch_decode(q, paged_kv_cache, paged_kv_indptr, paged_kv_indices,
                 paged_kv_last_page_len, *, kv_layout="NHD", sm_scale=None, window_left=-1,
                 logits_soft_cap=None, return_lse=False, bug=None):
    """FlashInfer's batch decode (plan + run) as one function: q ``(batch, H, D)``."""
    indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return batch_prefill(q, paged_kv_cache, indptr, paged_kv_indptr, paged_kv_indices,
                         paged_kv_last_page_len, causal=False, kv_layout=kv_layout,
                         sm_scale=sm_scale, window_left=window_left,
                         logits_soft_cap=logits_soft_cap, return_lse=return_lse, bug=bug)


# -- vLLM --------------------------------------------------------------------------------
def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                       seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                       k_scale, v_scale, tp_rank=0, blocksparse_local_blocks=0,
                       blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0, *, bug=None):
    """vLLM's signature: writes ``out (num_seqs, H, D)``; key cache ``(blocks, H_kv, D/x,
    block_size, x)``, value cache ``(blocks, H_kv, D, block_size)``."""
    if kv_cache_dtype != "auto":
        raise NotImplementedError(kv_cache_dtype)
    seqs = query.shape[0]
    for b in range(seqs):
        if bug == "last_seq_unwritten" and b == seqs - 1 and seqs > 1:
            break
        length = int(seq_lens[b])
        nblk = -(-length // block_size)
        blocks = block_tables[b, :nblk].long()
        if bug == "reads_past_seq_len":
            length = nblk * block_size
        kc = key_cache[blocks]                                  # (nblk, H, D/x, bs, x)
        if bug == "x_unpacked_wrong":
            k = kc.reshape(nblk, kc.shape[1], -1, block_size).permute(0, 3, 1, 2)
        else:
            k = kc.permute(0, 3, 1, 2, 4).reshape(nblk, block_size, kc.shape[1], -1)
        v = value_cache[blocks].permute(0, 3, 1, 2)             # (nblk, bs, H, D)
        k = k.reshape(-1, *k.shape[2:])[:length].transpose(0, 1)
        v = v.reshape(-1, *v.shape[2:])[:length].transpose(0, 1)
        bias = None
        if alibi_slopes is not None:
            pos = torch.arange(length, dtype=torch.float32) - (length - 1)
            sign = -1.0 if bug == "alibi_sign" else 1.0
            bias = sign * alibi_slopes.float()[:, None, None] * pos
        o, _ = _attend(query[b][:, None], k, v, scale, None, bias)
        out[b] = o[:, 0]


# -- the Triton tutorial -----------------------------------------------------------------
class _TutorialAttention(torch.autograd.Function):
    """The tutorial's structure: the forward keeps ``M`` (the row lse in base 2), the
    backward recomputes P from it (``exp2(qk scale log2 e - M)``)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, bug):
        n = q.shape[-2]
        i, j = _grid(n, n)
        keep = (j <= i) if causal else None
        o, lse = _attend(q, k, v, sm_scale, keep)
        ctx.save_for_backward(q, k, v, o, lse * LOG2E)
        ctx.causal, ctx.sm_scale, ctx.bug = causal, sm_scale, bug
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, m = ctx.saved_tensors
        bug = ctx.bug
        qf, kf, vf, of, dof = (x.float() for x in (q, k, v, o, do))
        n = q.shape[-2]
        i, j = _grid(n, n)
        s = qf @ kf.transpose(-1, -2) * ctx.sm_scale
        p = torch.exp(s - m[..., None]) if bug == "bwd_lse_natural" else torch.exp2(
            s * LOG2E - m[..., None])
        if ctx.causal or bug == "bwd_always_causal":
            p = p.masked_fill(~(j <= i), 0.0)
        dv = p.transpose(-1, -2) @ dof
        dp = dof @ vf.transpose(-1, -2)
        delta = (of * dof).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = ds @ kf * ctx.sm_scale
        dk = ds.transpose(-1, -2) @ qf * (1.0 if bug == "dk_missing_scale" else ctx.sm_scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def triton_attention(q, k, v, causal, sm_scale, *, bug=None):
    """The tutorial's ``attention(q, k, v, causal, sm_scale)``: ``(Z, H, N_CTX, HEAD_DIM)``."""
    if bug == "fwd_scale_twice":
        sm_scale_fwd = sm_scale * sm_scale
        return _TutorialAttention.apply(q, k, v, causal, sm_scale_fwd, bug)
    return _TutorialAttention.apply(q, k, v, causal, sm_scale, bug)


#: (convention, kernel, bug): the shipped conventions' broken kernels.
SHIPPED_ZOO = [("xformers", memory_efficient_attention, b) for b in (
    "bottom_right_as_top_left", "bias_ignored", "block_causal_bottom_right", "groups_mixed",
    "scale_twice")] + [
    ("flashinfer_single_prefill", single_prefill_with_kv_cache, b) for b in (
        "causal_top_left", "lse_natural", "softcap_before_scale", "window_exclusive",
        "hnd_as_nhd")] + [
    ("flashinfer_single_decode", single_decode_with_kv_cache, b) for b in (
        "lse_natural", "window_exclusive")] + [
    ("flashinfer_batch_prefill", batch_prefill, b) for b in (
        "last_page_full", "causal_top_left", "lse_natural")] + [
    ("flashinfer_batch_decode", batch_decode, b) for b in (
        "last_page_full", "window_exclusive")] + [
    ("vllm_paged_attention", paged_attention_v1, b) for b in (
        "reads_past_seq_len", "x_unpacked_wrong", "alibi_sign", "last_seq_unwritten")] + [
    ("triton_tutorial", triton_attention, b) for b in (
        "bwd_always_causal", "bwd_lse_natural", "dk_missing_scale", "fwd_scale_twice")]

#: The clean kernel of each shipped convention.
SHIPPED_CLEAN = {conv: fn for conv, fn, _ in SHIPPED_ZOO}


def broken(fn, bug):
    return functools.partial(fn, bug=bug)
