"""A zoo of size-gated and value-gated kernel bugs (issue #49), pure torch, each written the
way a real kernel is structured: a dispatch on size to a code path (the d = 128 kernel, the
split-KV merge past 512 keys, causal tile skipping past 256 rows, program ids past 64, a
varlen offset that wraps past 2048 tokens, a memory-efficient path past 1024 keys), and the
three classes the search could not reach before (a running max starting at a finite
sentinel, a varlen backward writing garbage for a sequence with no queries, a paged kernel
reading the pages a sliding window skips).  Every path falls back to the clean kernel of
:mod:`zoo` where its precondition does not hold, as a real dispatcher does."""
from __future__ import annotations

import functools

import torch

import zoo

NEG = float("-inf")


def _plain(causal, window_size, softcap, alibi_slopes) -> bool:
    """Whether a call takes the plain path (no mask, softcap, ALiBi)."""
    return not causal and tuple(window_size) == (-1, -1) and not softcap and \
        alibi_slopes is None


def _online(q, k, v, scale, vis, *, block=64, init_max=NEG, rescale=True):
    """A tiled online softmax over key blocks of ``block`` (float32), (b, h, n, d) with
    GQA; the running max starts at ``init_max``; ``rescale=False`` forgets to rescale the
    accumulator when the max grows (the memory-efficient path's bug)."""
    dt = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    hq, hkv = q.shape[1], k.shape[1]
    idx = torch.arange(hq) // (hq // hkv)
    k, v = k[:, idx], v[:, idx]
    n, s = q.shape[-2], k.shape[-2]
    m = torch.full((*q.shape[:-1], 1), init_max)
    den = torch.zeros(*q.shape[:-1], 1)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])
    for j0 in range(0, s, block):
        sc = (q @ k[..., j0:j0 + block, :].transpose(-1, -2)) * scale
        sc = sc.masked_fill(~vis[:, j0:j0 + block], NEG)
        new = torch.maximum(m, sc.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
        p = torch.exp(sc - safe)
        alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, NEG), m) - safe)
        den = den * alpha + p.sum(-1, keepdim=True)
        acc = (acc * alpha if rescale else acc) + p @ v[..., j0:j0 + block, :]
        m = new
    out = acc / torch.where(den > 0, den, torch.ones_like(den))   # an empty row: 0
    lse = torch.where(den[..., 0] > 0, torch.log(den[..., 0]) + m[..., 0],
                      torch.full_like(m[..., 0], float("inf")))
    return out.to(dt), lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, bug=None, seqlen_k=None):
    """flash_attn_func (b, n, h, d) dispatching by size to the paths the bugs live in."""
    b, n, hq, d = q.shape
    s = k.shape[1]
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size,
              softcap=softcap, alibi_slopes=alibi_slopes, return_attn_probs=True,
              seqlen_k=seqlen_k)
    plain = _plain(causal, window_size, softcap, alibi_slopes)
    if bug == "d128_scale" and d == 128 and softmax_scale is None:
        kw["softmax_scale"] = 64 ** -0.5           # the d = 128 kernel's constant of d = 64
    scale = kw["softmax_scale"] or d ** -0.5
    if bug == "split_kv_merge" and s > 512 and plain:
        parts = [zoo.flash_attn_func(q, k[:, j:j + 512], v[:, j:j + 512], **kw)[:2]
                 for j in range(0, s, 512)]
        lses = torch.stack([lse for _, lse in parts])          # (splits, b, h, n)
        top = lses.amax(0)
        w = torch.exp(lses - top)                                # forgets the division by
        out = sum(o.float() * wi.transpose(1, 2)[..., None]      # the weights' sum
                  for (o, _), wi in zip(parts, w)).to(q.dtype)
        lse = top + torch.log(w.sum(0))
    elif bug == "mem_efficient" and s > 1024 and plain:
        vis = torch.ones(n, s, dtype=torch.bool)
        out, lse = _online(*(x.transpose(1, 2) for x in (q, k, v)), scale, vis, block=1024,
                           rescale=False)
        out = out.transpose(1, 2)
    elif bug == "sentinel_max" and not softcap and alibi_slopes is None:
        vis = zoo._visible(n, s, causal, window_size, None)
        out, lse = _online(*(x.transpose(1, 2) for x in (q, k, v)), scale, vis,
                           init_max=-5e4)
        out = out.transpose(1, 2)
    elif bug == "causal_tile_skip" and causal and n > 256:
        # query tile t (rows 64 t ..) visits key tiles up to floor(last visible / 64) - 1
        # past the fourth query tile: the diagonal tile is skipped
        vis = zoo._visible(n, s, True, window_size, None)
        i = torch.arange(n)[:, None]
        j = torch.arange(s)[None, :]
        diag = ((i // 64) * 64 + s - n).clamp(min=0) // 64 * 64
        vis = vis & ~((i >= 256) & (j >= diag))
        out, lse = zoo._attend(*(x.transpose(1, 2) for x in (q, k, v)), scale=scale, vis=vis,
                               softcap=softcap, alibi=alibi_slopes, offset=s - n)
        out = out.transpose(1, 2)
    else:
        out, lse = zoo.flash_attn_func(q, k, v, **kw)[:2]
    if bug == "program_ids" and b * hq > 64:
        # one program per (batch, head) on a grid whose second axis wraps at 64
        flat = out.transpose(1, 2).reshape(b * hq, n, -1)
        pid = torch.arange(b * hq) % 64
        out = flat[pid].reshape(b, hq, n, -1).transpose(1, 2)
        lse = lse.reshape(b * hq, n)[pid].reshape(b, hq, n)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, bug=None):
    """The varlen convention: offsets that wrap past 2048 tokens (an 11-bit field), or a
    backward that writes garbage into dk, dv of a sequence with no queries."""
    cq, ck = cu_seqlens_q.clone(), cu_seqlens_k.clone()
    if bug == "varlen_offset_wraps":
        lq, lk = cq.diff(), ck.diff()
        starts_q, starts_k = cq[:-1] % 2048, ck[:-1] % 2048
        q = torch.cat([q[int(a):int(a) + int(m)] for a, m in zip(starts_q, lq)]) \
            if int(lq.sum()) else q[:0]
        k = torch.cat([k[int(a):int(a) + int(m)] for a, m in zip(starts_k, lk)]) \
            if int(lk.sum()) else k[:0]
        v = torch.cat([v[int(a):int(a) + int(m)] for a, m in zip(starts_k, lk)]) \
            if int(lk.sum()) else v[:0]
    if bug == "varlen_bwd_no_queries":
        rows = torch.zeros(k.shape[0], dtype=torch.bool)
        for b in range(len(cq) - 1):
            if int(cq[b + 1] - cq[b]) == 0:
                rows[int(ck[b]):int(ck[b + 1])] = True
        k, v = _Garbage.apply(k, rows), _Garbage.apply(v, rows)
    return zoo.flash_attn_varlen_func(q, k, v, cq, ck, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, softcap=softcap,
                                      alibi_slopes=alibi_slopes,
                                      return_attn_probs=return_attn_probs)


class _Garbage(torch.autograd.Function):
    """Identity forward; the backward leaves the ``rows`` it never visits uninitialised
    (here: 7.0, what the last launch left in the buffer)."""

    @staticmethod
    def forward(ctx, x, rows):
        ctx.rows = rows
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[ctx.rows] = 7.0
        return g, None


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1),
                            softcap=0.0, alibi_slopes=None, return_softmax_lse=False, *,
                            bug=None):
    """The paged convention; ``reads_window_pages``: every page of the table is read and
    the window applied as a mask (0 x NaN where a skipped page holds garbage)."""
    return zoo.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                                       softmax_scale, causal, window_size, softcap,
                                       alibi_slopes, return_softmax_lse, bug=bug)


#: (convention, kernel, bug, what the shrunk case must show)
SIZED = [
    ("flash_attn", flash_attn_func, "d128_scale", lambda c: c.d == 128),
    ("flash_attn", flash_attn_func, "split_kv_merge", lambda c: c.s == 513),
    # (wrong only where a later chunk raises the running max: the smallest failing s is
    # past 1024, not always 1025)
    ("flash_attn", flash_attn_func, "mem_efficient", lambda c: 1024 < c.s <= 2048),
    ("flash_attn", flash_attn_func, "causal_tile_skip", lambda c: c.n == 257),
    ("flash_attn", flash_attn_func, "program_ids", lambda c: 64 < c.b * c.hq <= 72),
    ("flash_attn", flash_attn_func, "sentinel_max",
     lambda c: c.values in ("far_below", "sentinel")),
    ("flash_attn_varlen", flash_attn_varlen_func, "varlen_offset_wraps", lambda c: True),
    ("flash_attn_varlen", flash_attn_varlen_func, "varlen_bwd_no_queries",
     lambda c: c.opts.get("segments") in ("no_queries", "many")
     and c.opts.get("backward")),
    ("flash_attn_kvcache", flash_attn_with_kvcache, "reads_window_pages",
     lambda c: "window" in c.poison and c.opts.get("window_size")),
]


def broken(fn, bug):
    return functools.partial(fn, bug=bug)
