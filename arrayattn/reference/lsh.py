r"""Reference form: Reformer's LSH attention (Kitaev, Kaiser & Levskaya 2020, "Reformer:
The Efficient Transformer", ICLR, section 2): shared-QK angular hashing, a stable sort
by bucket, chunked attention within the sorted order, the rounds merged by their
log-sum-exp.  Array API only; ``O(n (d + dv))`` memory plus score tiles, never ``n x n``.
"""
from __future__ import annotations

import math

from array_api_compat import array_namespace
from array_api_compat import device as xp_device

from .finite import drop_nonfinite, nonfinite_rows
from .masks import (attend, log_total, masked_softmax, merge_partials, partial_softmax,
                    zero_masked_keys)
from .indexing import take_in_bounds
from .rows import unit_rows
from .scan import scan

__all__ = ["lsh_hash", "lsh_attention", "lsh_attention_chunked", "lsh_pattern",
           "lsh_inputs", "lsh_rounds", "lsh_own_value", "SortedRound"]


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
    # as argmax takes the first maximum; the concatenation would double the largest
    # temporary, n H nb/2 entries).
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


_TILE = 1 << 22  # elements of one score-sized temporary (16 MiB in float32)


def _blocking(B: int, C: int, nc: int):
    """``(g, count)``: blocks of ``g`` chunks whose ``(C, 2C)`` tiles hold about ``_TILE``
    elements in all, as even as can be (``count * g >= nc``; the rest are pad chunks).
    Two blocks at least (of two chunks or more): the loop over them is then in the
    compiled program at every ``n`` -- XLA inlines a loop that runs once, and a program
    that gains its loop once ``n`` passes the tile compiled 1.2-1.6x longer there."""
    most = max(1, _TILE // (B * C * 2 * C))
    count = max(min(2, nc), -(-nc // most))
    return -(-nc // count), count


class SortedRound:
    """One hash round's sorted, chunked order, as index arrays on the device (what the
    forward and the backward of a round share).

    Built from the round's ``bucket (B, n)`` (masked tokens in bucket ``nb``): a stable
    sort by bucket, padded to ``nc * C`` slots, ``nc`` a whole number of blocks of
    chunks.  The chunk axis leads: it is the axis the blocks of chunks are scanned over.
    Each chunk's *window* is the previous chunk's ``C`` slots then its own: :attr:`at`,
    ``(nc, B, 2C)`` row numbers into a table of the ``B n`` token rows and one empty row
    last, which the pad slots and the first chunk's look-back (no previous chunk, no
    wrap-around) point at.  The window is built once, on these indices, and
    :meth:`windows` gathers any rows with it in one ``take``; a chunk's queries are the
    second half of its window.  :meth:`over_blocks` runs a step on each block of chunks
    (a scan), :meth:`mask` gives a block's allowed pairs from its slots' labels,
    :meth:`unsort` puts sorted rows back.

    The *labels* of a slot are its position, its bucket and -- for the duplicate count,
    when ``buckets (B, H, n)``, every round's, is given -- its bucket in every round:
    :attr:`labels`, a tuple of ``(nc, B, 2C)`` ints over the windows, -1 in the empty
    row.  (Gathered in one take, label-major: a scanned block reads each label
    contiguously, which XLA's fused mask needs to run at speed.)
    """

    def __init__(self, xp, bucket, buckets=None, *, C: int, nb: int, causal: bool, device):
        B, n = bucket.shape
        self.xp, self.B, self.n, self.C, self.nb, self.causal = xp, B, n, C, nb, causal
        self.g, count = _blocking(B, C, -(-n // C))
        self.nc = nc = self.g * count
        order = xp.argsort(bucket, axis=-1, stable=True)               # (B, n) positions
        # Sorted slot t holds position order[t]; position i is at undo[i].
        undo = xp.argsort(order, axis=-1, stable=True)
        batch = xp.reshape(xp.arange(B, dtype=order.dtype, device=device), (B, 1))
        rows = order + batch * n                        # slot -> row b n + i of the table
        empty = B * n                                   # the table's last row
        if nc * C > n:
            rows = xp.concat([rows, xp.full((B, nc * C - n), empty, dtype=rows.dtype,
                                            device=device)], axis=-1)
        own = xp.permute_dims(xp.reshape(rows, (B, nc, C)), (1, 0, 2))  # (nc, B, C)
        prev = xp.concat([xp.full((1, B, C), empty, dtype=rows.dtype, device=device),
                          own[:-1, ...]], axis=0)
        self.at = xp.reshape(xp.concat([prev, own], axis=-1), (nc * B * 2 * C,))
        # Position i back from the chunks' own halves (nc, B, C): row (c, b, i).
        self.flat_undo = xp.reshape((undo // C) * (B * C) + batch * C + undo % C, (B * n,))
        every = [] if buckets is None else [buckets[:, r, :] for r in range(buckets.shape[1])]
        pos = xp.broadcast_to(xp.arange(n, dtype=bucket.dtype, device=device), (B, n))
        # Every label of every window slot in one take, label-major (-1: the empty row).
        table = xp.reshape(xp.stack([pos, bucket, *every]), (2 + len(every), B * n))
        table = xp.concat([table, xp.full((table.shape[0], 1), -1, dtype=table.dtype,
                                          device=device)], axis=1)
        labels = xp.reshape(take_in_bounds(table, self.at, axis=1), (-1, nc, B, 2 * C))
        self.labels = tuple(labels[i, ...] for i in range(labels.shape[0]))  # (nc, B, 2C)
        if causal:
            # Window index j >= query index i: the key is among the C sorted slots
            # before the query (slot c C + i sees slots (c - 1) C + j, j = i .. 2C - 1).
            j = xp.arange(2 * C, dtype=order.dtype, device=device)
            self.near = j >= xp.reshape(j[:C], (C, 1))

    def windows(self, x):
        """The rows of ``x (B, n, f)`` in the windows: ``(nc, B, 2C, f)`` (the empty
        slots: 0)."""
        xp, B, n = self.xp, self.B, self.n
        table = xp.concat([xp.reshape(x, (B * n, x.shape[-1])),
                           xp.zeros((1, x.shape[-1]), dtype=x.dtype, device=xp_device(x))])
        return xp.reshape(take_in_bounds(table, self.at, axis=0),
                          (self.nc, B, 2 * self.C, x.shape[-1]))

    def unsort(self, y):
        """Sorted rows ``(nc, B, C, f)`` back in position order: ``(B, n, f)``."""
        flat = self.xp.reshape(y, (self.nc * self.B * self.C, y.shape[-1]))
        return self.xp.reshape(take_in_bounds(flat, self.flat_undo, axis=0),
                               (self.B, self.n, y.shape[-1]))

    def over_blocks(self, step, xs):
        """``step(*block) -> tuple`` on each block of ``g`` chunks of the ``(nc, ...)``
        arrays ``xs`` (an entry may be a tuple of such arrays, such as the labels), one
        :func:`~arrayattn.reference.scan.scan`; the outputs back as ``(nc, ...)``.
        (Blocks keep the score-sized temporaries near ``_TILE`` elements: memory
        ``O(n d + tile)`` instead of ``O(n C)``.)"""
        xp, g = self.xp, self.g
        if g == self.nc:         # one block: no loop
            return step(*xs)
        sizes = [len(x) if isinstance(x, tuple) else None for x in xs]
        flat = [a for x in xs for a in (x if isinstance(x, tuple) else (x,))]
        cut = tuple(xp.reshape(x, (self.nc // g, g, *x.shape[1:])) for x in flat)

        def block(_, *parts):    # the tuples of xs regrouped
            args, at = [], 0
            for size in sizes:
                args.append(parts[at] if size is None else tuple(parts[at:at + size]))
                at += 1 if size is None else size
            return None, step(*args)

        _, ys = scan(block, None, cut, axis=0)
        return tuple(xp.reshape(y, (self.nc, *y.shape[2:])) for y in ys)

    def mask(self, labels):
        """``(allowed, rounds)`` of a block from its window labels (each ``(g, B, 2C)``;
        the queries' are the second half), both ``(g, B, C, 2C)``: a query sees the other
        real tokens of its bucket in its chunk and the previous one (causal: the ``C``
        sorted slots before it); ``rounds`` is ``N_ij``, the number of rounds in which the
        pair shares a bucket (``None`` without every round's labels; ``>= 1`` where
        allowed)."""
        xp = self.xp
        at_q, at_k = [x[..., self.C:, None] for x in labels], [x[..., None, :] for x in labels]
        pq, pk, bq, bk = at_q[0], at_k[0], at_q[1], at_k[1]
        # Paper eq. (3): same bucket only, and a real key (pad slots and the first
        # chunk's look-back are in bucket -1, masked tokens in bucket nb).
        allowed = (bq == bk) & (bk >= 0) & (bk < self.nb) & (
            (pk < pq) if self.causal else (pk != pq))
        if self.causal:
            # A sliding window of the C sorted slots before the query instead of the
            # chunk + previous chunk: within a bucket, slots are in position order, so
            # the window holds the query's min(C, #) most recent same-bucket keys -- a
            # set fixed by past tokens alone.  With chunk boundaries a future token's
            # bucket could shift the window and change a past output.
            allowed = allowed & self.near
        rounds = None
        for hq, hk in zip(at_q[2:], at_k[2:]):    # every round's buckets
            same = xp.astype(hq == hk, xp.int8)
            rounds = same if rounds is None else rounds + same
        return allowed, rounds


def _lsh_round(xp, rows, bucket, buckets, *, d, C, nb, causal, device):
    """One hash round: sort, chunk, attend.  Returns the round's partial softmax sums in
    position order (:func:`~arrayattn.reference.masks.partial_softmax`): the row max
    ``m (B, n, 1)``, ``l = sum_j e^{s_ij - m} (B, n, 1)`` and ``sum_j e^{s_ij - m} v_j
    (B, n, dv)``, for the rounds' merge.

    ``rows (B, n, 2d + dv)`` holds each token's scaled query, unit key and value;
    ``bucket`` is the round's ``(B, n)`` with masked tokens in bucket ``nb``;
    ``buckets (B, H, n)`` every round's (the duplicate count), or ``None``.
    """
    rd = SortedRound(xp, bucket, buckets, C=C, nb=nb, causal=causal, device=device)

    def block(w, labels):       # the rows (g, B, 2C, 2d + dv) of a block's windows
        allowed, rounds = rd.mask(labels)
        scores = w[..., C:, :d] @ xp.matrix_transpose(w[..., d:2 * d])  # (g, B, C, 2C)
        if rounds is not None:
            # Subtracting log N_ij makes a pair met in several rounds count once.
            scores = scores - xp.log(xp.maximum(xp.astype(rounds, w.dtype), 1.0))
        m, total, e = partial_softmax(scores, allowed)
        # (values are finite: see lsh_rounds); the three put back in one unsort
        return (xp.concat([m, total, e @ w[..., 2 * d:]], axis=-1),)

    part = rd.unsort(rd.over_blocks(block, (rd.windows(rows), rd.labels))[0])
    return part[..., :1], part[..., 1:2], part[..., 2:]


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


def lsh_inputs(qk, v, rotations, *, num_buckets: int, key_mask=None, hash_fn=None):
    """The chunked form's inputs: ``(batch, qk (B, n, d), v (B, n, dv), buckets (B, H,
    n))`` on the flattened broadcast batch, masked tokens' rows zeroed and their bucket
    ``num_buckets`` (sorted after every real bucket).  ``hash_fn(qk, rotations,
    num_buckets)`` gives the buckets (:func:`lsh_hash`; the NumPy engine passes its
    own)."""
    xp = array_namespace(qk, v)
    batch = _broadcast(_broadcast(qk.shape[:-2], v.shape[:-2]), rotations.shape[:-3])
    if key_mask is not None:
        batch = _broadcast(batch, key_mask.shape[:-1])
    n, d, dv, H = qk.shape[-2], qk.shape[-1], v.shape[-1], rotations.shape[-3]
    qk, v = zero_masked_keys(key_mask, qk, v)
    B = math.prod(batch)
    hash_fn = lsh_hash if hash_fn is None else hash_fn
    buckets = xp.broadcast_to(hash_fn(qk, rotations, num_buckets), (*batch, H, n))
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
    qs, ks = qk * scale, unit_rows(qk)[0]
    every = buckets if dedup and buckets.shape[1] > 1 else None   # for N_ij
    # A non-finite value (finite.py's rule), once for every round: its row is zeroed and
    # its key made NaN, so its logits column is NaN -- exactly the rows that may see it
    # become NaN, as masks.attend's poisoned logits make them.
    bad = nonfinite_rows(v)
    ks, v = xp.where(bad[..., None], xp.nan, ks), drop_nonfinite(bad, v)
    rows = xp.concat([qs, ks, v], axis=-1)       # gathered together, once per round

    # The rounds merged as they come (masks.merge_partials, the online log-sum-exp of
    # their partial sums): the carry (top, total, acc) is the running row max, the sum of
    # e^{s - top} and the sum of e^{s - top} v over the rounds so far.

    def one_round(state, bucket):
        part = _lsh_round(xp, rows, bucket, every, d=qk.shape[-1], C=chunk_size,
                          nb=num_buckets, causal=causal, device=dev)
        return merge_partials(state, part), None

    start = (xp.full((B, n, 1), -xp.inf, dtype=qk.dtype, device=dev),
             xp.zeros((B, n, 1), dtype=qk.dtype, device=dev),
             xp.zeros((B, n, v.shape[-1]), dtype=qk.dtype, device=dev))
    (top, total, acc), _ = scan(one_round, start, (buckets,), axis=1)
    return acc / xp.where(total > 0, total, 1.0), log_total(total, top)[..., 0]


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
    batch, qk3, v3, buckets = lsh_inputs(qk, v, rotations, num_buckets=num_buckets,
                                         key_mask=key_mask)
    out, z = lsh_rounds(qk3, v3, buckets, num_buckets=num_buckets, chunk_size=chunk_size,
                        scale=scale, causal=causal, dedup=dedup)
    return lsh_own_value(out, z, v3, batch)


def lsh_own_value(out, z, v, batch):
    """The output ``(*batch, n, dv)`` from the merged rounds' ``out (B, n, dv)`` and
    ``z (B, n)``: a token with no other key in any round (``z = -inf``) attends to itself,
    its value ``v`` (zeros if padded); a NaN ``z``, a row that saw a NaN, keeps its NaN."""
    xp = array_namespace(out, v)
    out = xp.where((z != -xp.inf)[..., None], out, v)
    return xp.reshape(out, (*batch, *out.shape[-2:]))
