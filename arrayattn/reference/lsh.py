r"""Reference form: Reformer's LSH attention (Kitaev, Kaiser & Levskaya 2020, "Reformer:
The Efficient Transformer", ICLR, section 2): shared-QK angular hashing, a stable sort
by bucket, chunked attention within the sorted order, the rounds merged by their
log-sum-exp.  Array API only; ``O(n (d + dv))`` memory plus score tiles, never ``n x n``.
"""
from __future__ import annotations

import math

from array_api_compat import array_namespace
from array_api_compat import device as xp_device

from .masks import attend, masked_softmax, zero_masked_keys
from .scan import scan

__all__ = ["lsh_hash", "lsh_attention", "lsh_attention_chunked"]


def _hash(xp, qk, rot, nb: int, batch: tuple, n: int):
    """Buckets ``(*batch, H, n)``: ``argmax([x R, -x R])`` per round (Andoni et al. 2015)."""
    H = rot.shape[-3]
    if nb == 1:
        return xp.full((*batch, H, n), 0, device=xp_device(qk))  # default integer dtype
    d, half = rot.shape[-2], rot.shape[-1]
    # All rounds in one product: (..., n, d) @ (..., d, H * nb/2).
    flat_rot = xp.reshape(xp.permute_dims(rot, (*range(rot.ndim - 3), rot.ndim - 2,
                                                 rot.ndim - 3, rot.ndim - 1)),
                          (*rot.shape[:-3], d, H * half))
    if rot.ndim == 3:  # shared rotations: one 2-D product (NumPy's broadcast is slow)
        proj = xp.reshape(xp.reshape(qk, (-1, d)) @ flat_rot, (*qk.shape[:-1], H, half))
    else:
        proj = qk @ flat_rot
        proj = xp.reshape(proj, (*proj.shape[:-1], H, half))   # (..., n, H, nb/2)
    # argmax([p, -p]) without forming the concatenation (ties: the first half wins,
    # as argmax takes the first maximum).
    upper = xp.max(proj, axis=-1) >= -xp.min(proj, axis=-1)
    buckets = xp.where(upper, xp.argmax(proj, axis=-1),
                       xp.argmin(proj, axis=-1) + half)                 # (..., n, H)
    return xp.broadcast_to(xp.matrix_transpose(buckets), (*batch, H, n))


def lsh_hash(qk, rotations, num_buckets: int):
    r"""Angular LSH buckets ``(..., H, n)``: :math:`h_r(x) = \arg\max\,[x R_r; -x R_r]`
    (Andoni et al. 2015) for the rotations ``(..., H, d, num_buckets/2)``."""
    xp = array_namespace(qk, rotations)
    batch = tuple(_broadcast(qk.shape[:-2], rotations.shape[:-3]))
    return _hash(xp, qk, rotations, num_buckets, batch, qk.shape[-2])


def _broadcast(a, b):
    a, b = tuple(a), tuple(b)
    width = max(len(a), len(b))
    a, b = (1,) * (width - len(a)) + a, (1,) * (width - len(b)) + b
    return tuple(y if x == 1 else x for x, y in zip(a, b))


def _gather(xp, x, flat_idx, shape):
    """Rows of ``x (B, n, f)`` at flat indices ``(B*L,)`` (``b*n + i``), reshaped."""
    B, n, f = x.shape
    return xp.reshape(xp.take(xp.reshape(x, (B * n, f)), flat_idx, axis=0), shape)


def _look_one_back(xp, x, fill, axis=2):
    """``(B, nc, C, ...) -> (B, nc, 2C, ...)``: each chunk preceded by the previous chunk.

    ``axis`` is the within-chunk axis (``-1`` for transposed keys ``(B, nc, d, C)``).
    The first chunk has no previous chunk (no wrap-around): its look-back half is
    ``fill`` (a slot that no query may attend to).  The result is a fresh contiguous
    array (NumPy's batched matmul is ~10x slower on a transposed view).
    """
    first = xp.full((x.shape[0], 1, *x.shape[2:]), fill, dtype=x.dtype,
                    device=xp_device(x))
    prev = xp.concat([first, x[:, :-1, ...]], axis=1)
    return xp.concat([prev, x], axis=axis)


_TILE = 1 << 22  # elements of one score-sized temporary (16 MiB in float32)


def _lsh_round(xp, qs, ks, vs, buckets, b_r, *, n, C, nb, causal, dedup, work_dtype,
               device):
    """One hash round: sort, chunk, attend; returns ``(out (B, n, dv), lse (B, n))``.

    ``qs`` (queries, scaled), ``ks`` (unit keys), ``vs`` are ``(B, n, .)``; ``b_r``
    ``(B, n)`` are this round's buckets, ``buckets`` ``(B, H, n)`` every round's (for the
    duplicate count), masked tokens in bucket ``nb``.
    """
    B, H = buckets.shape[0], buckets.shape[1]
    # The score-sized work runs over blocks of chunks, so that its temporaries stay
    # near _TILE elements (cache-friendly, memory O(n d + tile) instead of O(n C)):
    # nblk blocks of `step` chunks each (pad chunks at the end make them equal).
    chunks, most = -(-n // C), max(1, _TILE // (B * C * 2 * C))
    nblk = -(-chunks // most)
    step = -(-chunks // nblk)
    nc = nblk * step
    L = nc * C
    order = xp.argsort(b_r, axis=-1, stable=True)                    # (B, n) positions
    # Pad the sorted order to nc * C slots; a pad slot holds position 0 but bucket -1.
    if L > n:
        order = xp.concat(
            [order, xp.zeros((B, L - n), dtype=order.dtype, device=device)], axis=-1)
    offsets = xp.reshape(xp.arange(B, dtype=order.dtype, device=device) * n, (B, 1))
    flat = xp.reshape(order + offsets, (B * L,))
    is_slot = xp.arange(L, device=device) < n                         # (L,)

    def sorted_ints(a):  # (B, n) ints -> (B, nc, C), pad slots -1
        g = xp.reshape(xp.take(xp.reshape(a, (B * n,)), flat, axis=0), (B, L))
        return xp.reshape(xp.where(is_slot, g, -1), (B, nc, C))

    q_c = _gather(xp, qs, flat, (B, nc, C, qs.shape[-1]))
    k_t = xp.matrix_transpose(_gather(xp, ks, flat, (B, nc, C, ks.shape[-1])))
    k_wt = _look_one_back(xp, k_t, 0, axis=-1)                        # (B, nc, d, 2C)
    v_w = _look_one_back(xp, _gather(xp, vs, flat, (B, nc, C, vs.shape[-1])), 0)
    pos = sorted_ints(xp.broadcast_to(xp.arange(n, device=device), (B, n)))
    # Sorted rank of each slot, and of each key slot in the look-back window.
    slot = xp.reshape(xp.arange(L, device=device), (1, nc, C))
    slot_k = _look_one_back(xp, slot, -L)
    bq = sorted_ints(b_r)
    bk = _look_one_back(xp, bq, -1)
    pk = _look_one_back(xp, pos, -1)
    # Paper eq. (3): same bucket only.  Queries and keys that are not real (pad slots
    # in bucket -1, masked tokens in bucket nb) get codes that match nothing.  The
    # token itself is excluded here and used as a fallback after the rounds are merged.
    bq_code = xp.where((bq >= 0) & (bq < nb), bq, -2)
    bk_code = xp.where((bk >= 0) & (bk < nb), bk, -1)
    every = []  # every round's buckets in this order, for the duplicate count
    if dedup and H > 1:
        for r2 in range(H):
            b2 = sorted_ints(buckets[:, r2, :])
            every += [b2, _look_one_back(xp, b2, -1)]

    def block(_, q_c, k_wt, v_w, pos, pk, slot, slot_k, bq, bk, bq_code, bk_code, *every):
        pq4, pk4 = pos[..., :, None], pk[..., None, :]
        allowed = (bq_code[..., :, None] == bk_code[..., None, :]) & (
            (pk4 < pq4) if causal else (pk4 != pq4))
        if causal:
            # A sliding window of the C sorted slots before the query instead of the
            # chunk + previous chunk: within a bucket, slots are in position order, so
            # the window holds the query's min(C, #) most recent same-bucket keys -- a
            # set fixed by past tokens alone.  With chunk boundaries a future token's
            # bucket could shift the window and change a past output.
            allowed = allowed & (slot[..., :, None] - slot_k[..., None, :] <= C)
        scores = q_c @ k_wt                                            # (B, step, C, 2C)
        if every:
            # N_ij = #rounds in which i and j share a bucket (paper, multi-round LSH):
            # subtracting log N_ij makes a pair met in several rounds count once.
            # Where allowed, N_ij = 1 (this round) + the other rounds' matches.
            count = -xp.astype(bq[..., :, None] == bk[..., None, :], xp.int8)
            for b2q, b2k in zip(every[::2], every[1::2]):
                count = count + xp.astype(b2q[..., :, None] == b2k[..., None, :], xp.int8)
            scores = scores - xp.log1p(xp.astype(count, work_dtype))
        return None, attend(scores, v_w, allowed)

    tiles = [xp.reshape(x, (x.shape[0], nblk, step, *x.shape[2:])) for x in (
        q_c, k_wt, v_w, pos, pk, slot, slot_k, bq, bk, bq_code, bk_code, *every)]
    _, (out, lse) = scan(block, None, tiles, axis=1)
    out = xp.reshape(out, (B, L, out.shape[-1]))[:, :n, :]
    lse = xp.reshape(lse, (B, L))[:, :n]
    # Undo the sort: sorted slot t holds position order[t]; position i is at undo[i].
    undo = xp.argsort(order[:, :n], axis=-1, stable=True)
    flat_undo = xp.reshape(undo + offsets, (B * n,))
    out = _gather(xp, out, flat_undo, (B, n, out.shape[-1]))
    lse = xp.reshape(xp.take(xp.reshape(lse, (B * n,)), flat_undo, axis=0), (B, n))
    return out, lse


def lsh_attention(qk, v, rotations, *, num_buckets: int, chunk_size: int, scale: float,
                  causal: bool = False, key_mask=None, dedup: bool = True):
    r"""The definition, dense (``O(H n^2)`` memory): for each round ``r``, token ``i`` at
    sorted rank ``t_i`` attends to the keys ``j != i`` of its bucket whose rank is in its
    chunk or the previous one (causal: ``0 < t_i - t_j <= C``), with logits
    ``scale qk_i . k_j - log N_ij``; the rounds merged by their log-sum-exp; a token with
    no key in any round returns its own value (padding: zeros)."""
    xp = array_namespace(qk, v)
    qk, v = zero_masked_keys(key_mask, qk, v)
    h = lsh_hash(qk, rotations, num_buckets)                            # (..., H, n)
    if key_mask is not None:                 # padding: a last bucket that nobody attends
        h = xp.where(key_mask[..., None, :], h, num_buckets)
    rank = xp.argsort(xp.argsort(h, axis=-1, stable=True), axis=-1, stable=True)
    same = h[..., :, None] == h[..., None, :]                            # (..., H, n, n)
    gap = rank[..., :, None] - rank[..., None, :]
    chunks = rank[..., :, None] // chunk_size - rank[..., None, :] // chunk_size
    near = ((gap > 0) & (gap <= chunk_size)) if causal else (
        (gap != 0) & (chunks >= 0) & (chunks <= 1))
    allowed = same & near & (h < num_buckets)[..., None, :]
    norm = xp.sqrt(xp.sum(qk * qk, axis=-1, keepdims=True))
    scores = (qk * scale) @ xp.matrix_transpose(qk / xp.where(norm > 0, norm, 1.0))
    if dedup:   # a pair met in N_ij rounds counts once (N_ij >= 1 where allowed)
        scores = scores - xp.log(xp.maximum(xp.sum(xp.astype(same, qk.dtype), axis=-3), 1.0))
    out, lse = attend(scores[..., None, :, :], v[..., None, :, :], allowed)  # per round
    weight = masked_softmax(lse, axis=-2)[..., None]                    # (..., H, n, 1)
    has_key = xp.any(allowed, axis=(-3, -1))[..., None]
    return xp.where(has_key, xp.sum(weight * out, axis=-3), v)


def lsh_attention_chunked(qk, v, rotations, *, num_buckets: int, chunk_size: int,
                          scale: float, causal: bool = False, key_mask=None,
                          dedup: bool = True):
    r"""Reformer LSH attention as it runs: per hash round, a stable sort by bucket, chunks of
    ``chunk_size``, each query attending to the same-bucket keys (``k = qk / ||qk||``,
    not itself) of its chunk and the previous one (causal: the ``chunk_size`` sorted slots
    before it), ``- log N_ij`` for pairs met in several rounds (``dedup``); the rounds
    merged by their log-sum-exp.  A token with no key in any round returns its own value;
    padded tokens (``key_mask`` False) hash to an extra last bucket and return 0.
    """
    xp = array_namespace(qk, v)
    batch = _broadcast(_broadcast(qk.shape[:-2], v.shape[:-2]), rotations.shape[:-3])
    if key_mask is not None:
        batch = _broadcast(batch, key_mask.shape[:-1])
    n, d, dv, H = qk.shape[-2], qk.shape[-1], v.shape[-1], rotations.shape[-3]
    qk, v = zero_masked_keys(key_mask, qk, v)
    B, dev = math.prod(batch), xp_device(qk)
    buckets = _hash(xp, qk, rotations, num_buckets, batch, n)          # (*batch, H, n)
    if key_mask is not None:
        buckets = xp.where(key_mask[..., None, :], buckets, num_buckets)
    buckets = xp.reshape(buckets, (B, H, n))
    qk3 = xp.reshape(xp.broadcast_to(qk, (*batch, n, d)), (B, n, d))
    v3 = xp.reshape(xp.broadcast_to(v, (*batch, n, dv)), (B, n, dv))
    norm = xp.sqrt(xp.sum(qk3 * qk3, axis=-1, keepdims=True))
    ks = qk3 / xp.where(norm > 0, norm, 1.0)
    # The rounds merged as they come (the online log-sum-exp): top = running max of the
    # rounds' lse, total = sum_r e^{z_r - top}, acc = sum_r e^{z_r - top} o_r.
    qs = qk3 * scale

    def hash_round(merged, b_r):
        top, total, acc = merged
        o, z = _lsh_round(xp, qs, ks, v3, buckets, b_r, n=n, C=chunk_size,
                          nb=num_buckets, causal=causal, dedup=dedup,
                          work_dtype=qk.dtype, device=dev)
        new_top = xp.maximum(top, z)
        shift = xp.where(new_top == -xp.inf, 0.0, new_top)
        old, new = xp.exp(top - shift), xp.exp(z - shift)
        return (new_top, total * old + new, acc * old[..., None] + o * new[..., None]), None

    start = (xp.full((B, n), -xp.inf, dtype=qk.dtype, device=dev),
             xp.zeros((B, n), dtype=qk.dtype, device=dev),
             xp.zeros((B, n, dv), dtype=qk.dtype, device=dev))
    (top, total, acc), _ = scan(hash_round, start, (buckets,), axis=1)
    has_key = total > 0
    out = acc / xp.where(has_key, total, 1.0)[..., None]
    # A token with no other key in any round attends to itself (zeros if padded).
    return xp.reshape(xp.where(has_key[..., None], out, v3), (*batch, n, dv))
