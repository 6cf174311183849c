r"""Reference form: Reformer's LSH attention (Kitaev, Kaiser & Levskaya 2020, "Reformer:
The Efficient Transformer", ICLR, section 2): shared-QK angular hashing, a stable sort
by bucket, chunked attention within the sorted order, the rounds merged by their
log-sum-exp.  Array API only; ``O(n (d + dv))`` memory plus score tiles, never ``n x n``.
"""
from __future__ import annotations

import math

from array_api_compat import array_namespace
from array_api_compat import device as xp_device

from .masks import attend, log_total, masked_softmax, zero_masked_keys
from .rows import unit_rows

__all__ = ["lsh_hash", "lsh_attention", "lsh_attention_chunked", "lsh_pattern",
           "lsh_inputs", "lsh_rounds", "SortedRound"]


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


class SortedRound:
    """One hash round's sorted, chunked order, as index arrays on the device (what the
    forward and the backward of a round share).

    Built from ``buckets (B, H, n)`` (masked tokens in bucket ``nb``) for round ``r``:
    a stable sort by bucket, padded to ``nc * C`` slots (a pad slot holds position 0
    but bucket -1).  :meth:`chunks` gathers rows into the sorted chunks, :meth:`window`
    puts each chunk after the previous one, :meth:`mask` gives the allowed pairs (and
    the duplicate count) of a block of chunks, :meth:`unsort` puts sorted rows back.
    """

    def __init__(self, xp, buckets, r: int, *, n: int, C: int, nb: int, causal: bool,
                 dedup: bool, device):
        B, H = buckets.shape[0], buckets.shape[1]
        self.xp, self.B, self.n, self.C, self.causal = xp, B, n, C, causal
        self.nc = nc = -(-n // C)
        L = nc * C
        order = xp.argsort(buckets[:, r, :], axis=-1, stable=True)      # (B, n) positions
        # Sorted slot t holds position order[t]; position i is at undo[i].
        undo = xp.argsort(order, axis=-1, stable=True)
        if L > n:
            order = xp.concat(
                [order, xp.zeros((B, L - n), dtype=order.dtype, device=device)], axis=-1)
        offsets = xp.reshape(xp.arange(B, dtype=order.dtype, device=device), (B, 1))
        self.flat = xp.reshape(order + offsets * n, (B * L,))
        self.flat_undo = xp.reshape(undo + offsets * L, (B * n,))
        is_slot = xp.arange(L, device=device) < n                         # (L,)

        def sorted_ints(a):  # (B, n) ints -> (B, nc, C), pad slots -1
            g = xp.reshape(xp.take(xp.reshape(a, (B * n,)), self.flat, axis=0), (B, L))
            return xp.reshape(xp.where(is_slot, g, -1), (B, nc, C))

        self.pos = sorted_ints(xp.broadcast_to(xp.arange(n, device=device), (B, n)))
        self.pk = _look_one_back(xp, self.pos, -1)
        if causal:
            # Sorted rank of each slot, and of each key slot in the look-back window.
            self.slot = xp.reshape(xp.arange(L, device=device), (1, nc, C))
            self.slot_k = _look_one_back(xp, self.slot, -L)
        bq = sorted_ints(buckets[:, r, :])
        bk = _look_one_back(xp, bq, -1)
        # Paper eq. (3): same bucket only.  Queries and keys that are not real (pad
        # slots in bucket -1, masked tokens in bucket nb) get codes that match nothing.
        self.bq_code = xp.where((bq >= 0) & (bq < nb), bq, -2)
        self.bk_code = xp.where((bk >= 0) & (bk < nb), bk, -1)
        self.others = []  # the other rounds' buckets, for the duplicate count
        if dedup and H > 1:
            for r2 in range(H):
                if r2 != r:
                    b2 = sorted_ints(buckets[:, r2, :])
                    self.others.append((b2, _look_one_back(xp, b2, -1)))

    def blocks(self):
        """Slices of chunks whose ``(C, 2C)`` tiles hold about ``_TILE`` elements in all."""
        step = max(1, _TILE // (self.B * self.C * 2 * self.C))
        return [slice(c0, min(c0 + step, self.nc)) for c0 in range(0, self.nc, step)]

    def chunks(self, x):
        """``x (B, n, f)`` in sorted order, ``(B, nc, C, f)`` (pad slots: position 0)."""
        return _gather(self.xp, x, self.flat, (self.B, self.nc, self.C, x.shape[-1]))

    def window(self, x, axis=2):
        """Each chunk preceded by the previous one: ``(B, nc, 2C, f)`` (see
        :func:`_look_one_back`; ``axis=-1`` for transposed keys)."""
        return _look_one_back(self.xp, x, 0, axis=axis)

    def unsort(self, y):
        """Sorted rows ``(B, nc, C, f)`` back in position order: ``(B, n, f)``."""
        flat = self.xp.reshape(y, (self.B * self.nc * self.C, y.shape[-1]))
        return self.xp.reshape(self.xp.take(flat, self.flat_undo, axis=0),
                               (self.B, self.n, y.shape[-1]))

    def mask(self, blk: slice):
        """``(allowed, count)`` of a block of chunks, both ``(B, g, C, 2C)``: a query sees
        the other real tokens of its bucket in its chunk and the previous one (causal:
        the ``C`` sorted slots before it); ``count`` is the number of other rounds in
        which the pair shares a bucket (``None`` without ``dedup``), so that where
        allowed ``N_ij = 1 + count``."""
        xp = self.xp
        pq4, pk4 = self.pos[:, blk, :, None], self.pk[:, blk, None, :]
        allowed = (self.bq_code[:, blk, :, None] == self.bk_code[:, blk, None, :]) & (
            (pk4 < pq4) if self.causal else (pk4 != pq4))
        if self.causal:
            # A sliding window of the C sorted slots before the query instead of the
            # chunk + previous chunk: within a bucket, slots are in position order, so
            # the window holds the query's min(C, #) most recent same-bucket keys -- a
            # set fixed by past tokens alone.  With chunk boundaries a future token's
            # bucket could shift the window and change a past output.
            allowed = allowed & (
                self.slot[:, blk, :, None] - self.slot_k[:, blk, None, :] <= self.C)
        count = None
        for b2q, b2k in self.others:
            same = xp.astype(b2q[:, blk, :, None] == b2k[:, blk, None, :], xp.int8)
            count = same if count is None else count + same
        return allowed, count


def _lsh_round(xp, qs, ks, vs, buckets, r, *, n, C, nb, causal, dedup, work_dtype, device):
    """One hash round: sort, chunk, attend; returns ``(out (B, n, dv), lse (B, n))``.

    ``qs`` (queries, scaled), ``ks`` (unit keys), ``vs`` are ``(B, n, .)``;
    ``buckets`` is ``(B, H, n)`` with masked tokens in bucket ``nb``.
    """
    rd = SortedRound(xp, buckets, r, n=n, C=C, nb=nb, causal=causal, dedup=dedup,
                     device=device)
    q_c = rd.chunks(qs)
    k_wt = rd.window(xp.matrix_transpose(rd.chunks(ks)), axis=-1)     # (B, nc, d, 2C)
    v_w = rd.window(rd.chunks(vs))
    # The score-sized work runs over blocks of chunks, so that its temporaries stay
    # near _TILE elements (cache-friendly, memory O(n d + tile) instead of O(n C)).
    outs, lses = [], []
    for blk in rd.blocks():
        allowed, count = rd.mask(blk)
        scores = q_c[:, blk, ...] @ k_wt[:, blk, ...]                 # (B, g, C, 2C)
        if count is not None:
            # Subtracting log N_ij makes a pair met in several rounds count once.
            scores = scores - xp.log1p(xp.astype(count, work_dtype))
        o, z = attend(scores, v_w[:, blk, ...], allowed)
        outs.append(o)
        lses.append(z[..., None])
    out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=1)
    lse = lses[0] if len(lses) == 1 else xp.concat(lses, axis=1)
    return rd.unsort(out), rd.unsort(lse)[..., 0]


def lsh_pattern(qk, rotations, *, num_buckets: int, chunk_size: int, causal: bool = False,
                key_mask=None):
    """The dense form's pairs: ``allowed (..., H, n, n)`` per round (same bucket, not
    itself, rank in the chunk or the previous one; causal: ``0 < t_i - t_j <= C``) and
    ``N (..., n, n)``, the number of rounds in which ``i`` and ``j`` share a bucket."""
    xp = array_namespace(qk)
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
    return allowed, xp.sum(xp.astype(same, qk.dtype), axis=-3)


def lsh_attention(qk, v, rotations, *, num_buckets: int, chunk_size: int, scale: float,
                  causal: bool = False, key_mask=None, dedup: bool = True):
    r"""The definition, dense (``O(H n^2)`` memory): for each round ``r``, token ``i`` at
    sorted rank ``t_i`` attends to the keys ``j != i`` of its bucket whose rank is in its
    chunk or the previous one (causal: ``0 < t_i - t_j <= C``), with logits
    ``scale qk_i . k_j - log N_ij``; the rounds merged by their log-sum-exp; a token with
    no key in any round returns its own value (padding: zeros)."""
    xp = array_namespace(qk, v)
    qk, v = zero_masked_keys(key_mask, qk, v)
    allowed, rounds = lsh_pattern(qk, rotations, num_buckets=num_buckets,
                                  chunk_size=chunk_size, causal=causal, key_mask=key_mask)
    scores = (qk * scale) @ xp.matrix_transpose(unit_rows(qk)[0])
    if dedup:   # a pair met in N_ij rounds counts once (N_ij >= 1 where allowed)
        scores = scores - xp.log(xp.maximum(rounds, 1.0))
    out, lse = attend(scores[..., None, :, :], v[..., None, :, :], allowed)  # per round
    weight = masked_softmax(lse, axis=-2)[..., None]                    # (..., H, n, 1)
    has_key = xp.any(allowed, axis=(-3, -1))[..., None]
    return xp.where(has_key, xp.sum(weight * out, axis=-3), v)


def lsh_inputs(qk, v, rotations, *, num_buckets: int, key_mask=None):
    """The chunked form's inputs: ``(batch, qk (B, n, d), v (B, n, dv), buckets (B, H,
    n))`` on the flattened broadcast batch, masked tokens' rows zeroed and their bucket
    ``num_buckets`` (sorted after every real bucket)."""
    xp = array_namespace(qk, v)
    batch = _broadcast(_broadcast(qk.shape[:-2], v.shape[:-2]), rotations.shape[:-3])
    if key_mask is not None:
        batch = _broadcast(batch, key_mask.shape[:-1])
    n, d, dv, H = qk.shape[-2], qk.shape[-1], v.shape[-1], rotations.shape[-3]
    qk, v = zero_masked_keys(key_mask, qk, v)
    B = math.prod(batch)
    buckets = _hash(xp, qk, rotations, num_buckets, batch, n)          # (*batch, H, n)
    if key_mask is not None:
        buckets = xp.where(key_mask[..., None, :], buckets, num_buckets)
    return (batch, xp.reshape(xp.broadcast_to(qk, (*batch, n, d)), (B, n, d)),
            xp.reshape(xp.broadcast_to(v, (*batch, n, dv)), (B, n, dv)),
            xp.reshape(buckets, (B, H, n)))


def lsh_rounds(qk, v, buckets, *, num_buckets: int, chunk_size: int, scale: float,
               causal: bool = False, dedup: bool = True):
    """Every round of ``qk (B, n, d)``, ``v (B, n, dv)``, ``buckets (B, H, n)`` merged
    by log-sum-exp: ``(O (B, n, dv), z (B, n))``, ``z = logsumexp_r z_r`` (``-inf``
    and ``O = 0`` for a token with no key in any round)."""
    xp = array_namespace(qk, v)
    B, n = buckets.shape[0], buckets.shape[-1]
    dev = xp_device(qk)
    ks = unit_rows(qk)[0]
    # The rounds merged as they come (the online log-sum-exp): top = running max of the
    # rounds' lse, total = sum_r e^{z_r - top}, acc = sum_r e^{z_r - top} o_r.
    top = xp.full((B, n), -xp.inf, dtype=qk.dtype, device=dev)
    total = xp.zeros((B, n), dtype=qk.dtype, device=dev)
    acc = xp.zeros((B, n, v.shape[-1]), dtype=qk.dtype, device=dev)
    for r in range(buckets.shape[1]):
        o, z = _lsh_round(xp, qk * scale, ks, v, buckets, r, n=n, C=chunk_size,
                          nb=num_buckets, causal=causal, dedup=dedup,
                          work_dtype=qk.dtype, device=dev)
        new_top = xp.maximum(top, z)
        shift = xp.where(new_top == -xp.inf, 0.0, new_top)
        old, new = xp.exp(top - shift), xp.exp(z - shift)
        total, acc, top = total * old + new, acc * old[..., None] + o * new[..., None], new_top
    return acc / xp.where(total > 0, total, 1.0)[..., None], log_total(total, top)


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
    batch, qk3, v3, buckets = lsh_inputs(qk, v, rotations, num_buckets=num_buckets,
                                         key_mask=key_mask)
    out, z = lsh_rounds(qk3, v3, buckets, num_buckets=num_buckets, chunk_size=chunk_size,
                        scale=scale, causal=causal, dedup=dedup)
    # A token with no other key in any round attends to itself (zeros if padded).
    # (a NaN z, a row that saw a NaN, keeps its NaN)
    out = xp.where((z != -xp.inf)[..., None], out, v3)
    return xp.reshape(out, (*batch, *out.shape[-2:]))
