"""The layout model on the host: :class:`BlockLayout` (a pattern as NumPy data) and its
gather plan."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..core.xp import xp_from_host
from .tiles import tile_mask

__all__ = ["BlockLayout", "num_blocks", "group_rows"]

# The cost of one more group of query blocks, in score elements: a group is a dozen
# array operations, worth about this much padded work.
_GROUP_OVERHEAD = 1 << 17
# Groups of the scanned plan (every path but the NumPy engine's threads): a bound on
# the loop bodies of its program -- a group is one scan over its chunks -- and the share
# of the one-group work a group more must save.  Half: under jax.jit a group is a loop
# body more for XLA to compile (Poolingformer with its pooled level in two: 2.0-2.5 s
# against 1.0-1.4 s in one, on a 2-core CPU), while a cut that saves a quarter of the
# padded scores saves little of the run (that one: 0-13 %); the global rows of Longformer
# and BigBird save 70-99 % and keep their group.
_SCAN_GROUPS, _SCAN_SPLIT = 4, 0.5
# Elements of the host tiles :meth:`BlockLayout.count_allowed` builds at once.
_COUNT_ELEMENTS = 1 << 23


def num_blocks(n: int, b: int) -> int:
    """Blocks of ``b`` tokens that hold ``n`` tokens (the last may be short)."""
    return -(-n // b)


def group_rows(support: np.ndarray, block_size: int, overhead: int,
               max_groups: int | None = None) -> tuple:
    """Groups ``(rows, idx, valid)`` of the rows of a boolean block matrix ``support``:
    ``rows (G,)`` row blocks, ``idx (G, R)`` the column blocks each gathers (sorted,
    padded with masked slots), ``valid (G, R)`` which slots are real.

    Rows are sorted by how many blocks they reach and cut into contiguous groups
    minimising padded work plus ``overhead`` per group (a small dynamic programme over
    the distinct counts), so a few global rows that reach every block do not pad the
    many local rows, and a handful of edge rows do not cost a group of their own.
    With ``max_groups`` (the scanned form's plan, :attr:`BlockLayout.scan_plan`): at
    most that many groups, a group more only where it saves ``_SCAN_SPLIT`` of the
    one-group work -- a relative price, so that a pattern is cut the same way at every
    ``n``."""
    sup, b = support, block_size
    counts = np.maximum(sup.sum(axis=1), 1)
    order = np.argsort(-counts, kind="stable")
    vals, first = np.unique(-counts[order], return_index=True)
    vals, bounds = -vals, np.r_[first, order.size]
    tile = b * b
    segments = (_cheapest_cuts(vals, bounds, tile, overhead) if max_groups is None
                else _few_cuts(vals, bounds, tile, max_groups))
    groups = []
    for u, t in segments:
        rows = np.sort(order[bounds[u]:bounds[t]])
        r = int(vals[u])
        idx = np.argsort(~sup[rows], axis=1, kind="stable")[:, :r]
        valid = np.take_along_axis(sup[rows], idx, axis=1)
        groups.append((rows, idx, valid))
    return tuple(groups)


def _cheapest_cuts(vals, bounds, tile: int, overhead: int) -> list:
    """Contiguous groups ``[(u, t)]`` of the counts ``vals`` (descending; count ``u`` holds
    rows ``bounds[u] .. bounds[u + 1] - 1``) of least padded work plus ``overhead`` each:
    group ``u .. t - 1`` is padded to ``vals[u]`` blocks."""
    m = vals.size
    best, cut = np.zeros(m + 1), np.zeros(m + 1, dtype=np.int64)
    for t in range(1, m + 1):
        costs = [best[u] + vals[u] * (bounds[t] - bounds[u]) * tile + overhead
                 for u in range(t)]
        cut[t] = int(np.argmin(costs))
        best[t] = costs[cut[t]]
    segments, t = [], m
    while t > 0:
        segments.append((cut[t], t))
        t = cut[t]
    return segments[::-1]


def _few_cuts(vals, bounds, tile: int, max_groups: int) -> list:
    """The cut of :func:`_cheapest_cuts` in at most ``max_groups`` groups, each group more
    saving at least ``_SCAN_SPLIT`` of the padded work of one group."""
    m = vals.size
    levels = min(m, max_groups)
    # best[g, t]: the least padded work of the first t counts in g + 1 groups
    best = np.full((levels, m + 1), np.inf)
    cut = np.zeros((levels, m + 1), dtype=np.int64)
    best[0, 1:] = [vals[0] * bounds[t] * tile for t in range(1, m + 1)]
    for g in range(1, levels):
        for t in range(g + 1, m + 1):
            costs = [best[g - 1, u] + vals[u] * (bounds[t] - bounds[u]) * tile
                     if u >= g else np.inf for u in range(t)]
            cut[g, t] = int(np.argmin(costs))
            best[g, t] = costs[cut[g, t]]
    price = _SCAN_SPLIT * best[0, m]
    segments, t, g = [], m, int(np.argmin(best[:, m] + price * np.arange(levels)))
    while t > 0:
        u = int(cut[g, t]) if g else 0
        segments.append((u, t))
        t, g = u, g - 1
    return segments[::-1]


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """A sparse attention pattern for ``n`` queries and ``s`` keys, as host data.

    Build it with :func:`local_layout`, :func:`strided_layout`, :func:`fixed_layout`,
    :func:`longformer_layout`, :func:`bigbird_layout` or :func:`block_layout`.

    Attributes
    ----------
    n, s : int
        Numbers of queries and keys.
    block_size : int
        Tokens per block; query block ``I`` holds queries ``I*b ... I*b+b-1`` (the last
        block may be short).
    blocks : numpy.ndarray of bool, shape ``(ceil(n/b), ceil(s/b))``
        Whole block pairs that are allowed.
    window : tuple (left, right) or None
        Token band: query ``i`` (at position ``i + s - n``) sees keys ``j`` with
        ``i + s - n - left <= j <= i + s - n + right``.
    global_tokens : numpy.ndarray of int
        Tokens (``n == s``) that see every key and that every query sees.
    causal : bool
        Whether the pattern also requires ``j <= i + s - n``.
    key_start, key_end : numpy.ndarray of int, optional
        For keys that stand for an interval of positions (pooled keys): key ``j``
        covers positions ``key_start[j] ... key_end[j]`` (non-decreasing). The window
        then requires the whole interval inside the band and causality its end
        ``<= i'``. ``None``: key ``j`` is position ``j``.
    query_offset : int, optional
        Position of query 0 (default ``s - n``, end-aligned); query ``i`` sits at
        ``i' = i + query_offset``.
    pattern : str
        The builder's name; ``params`` its arguments (for reports).
    """

    n: int
    s: int
    block_size: int
    blocks: np.ndarray
    window: tuple | None = None
    global_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    causal: bool = False
    key_start: np.ndarray | None = None
    key_end: np.ndarray | None = None
    query_offset: int | None = None
    pattern: str = "custom"
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        b = self.block_size
        shape = (num_blocks(self.n, b), num_blocks(self.s, b))
        blocks = np.array(self.blocks, dtype=bool)  # a private copy, read-only
        if blocks.shape != shape:
            raise ValueError(
                f"blocks must have shape (ceil(n/block_size), ceil(s/block_size)) = {shape} "
                f"for n={self.n}, s={self.s}, block_size={b}; got {blocks.shape}"
            )
        blocks.setflags(write=False)
        g = np.unique(np.asarray(self.global_tokens, dtype=np.int64).reshape(-1))
        if g.size and (self.n != self.s or g[0] < 0 or g[-1] >= self.n):
            raise ValueError(
                f"global_tokens must be token indices in [0, n) of a self-attention "
                f"pattern (n == s); got n={self.n}, s={self.s}, tokens {g.tolist()}"
            )
        g.setflags(write=False)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "global_tokens", g)
        if self.window is not None:
            object.__setattr__(self, "window", tuple(int(w) for w in self.window))
        if (self.key_start is None) != (self.key_end is None):
            raise ValueError("give both key_start and key_end, or neither")
        if self.key_start is not None:
            ks = np.array(self.key_start, dtype=np.int64).reshape(-1)
            ke = np.array(self.key_end, dtype=np.int64).reshape(-1)
            if ks.shape != (self.s,) or ke.shape != (self.s,) or (ke < ks).any() or (
                    np.diff(ks) < 0).any() or (np.diff(ke) < 0).any():
                raise ValueError(
                    f"key_start and key_end must be non-decreasing integer arrays of "
                    f"length s={self.s} with key_start <= key_end"
                )
            if g.size:
                raise ValueError("global_tokens cannot be combined with key intervals")
            ks.setflags(write=False)
            ke.setflags(write=False)
            object.__setattr__(self, "key_start", ks)
            object.__setattr__(self, "key_end", ke)

    # -- derived host data ------------------------------------------------------
    @property
    def shift(self) -> int:
        """Query ``i`` sits at position ``i + shift`` (default ``s - n``: end-aligned)."""
        return self.s - self.n if self.query_offset is None else int(self.query_offset)

    def key_span(self, j):
        """First and last positions covered by keys ``j`` (an integer array, ``< s``):
        ``(j, j)`` unless keys stand for intervals (``key_start``, ``key_end``)."""
        if self.key_start is None:
            return j, j
        return self.key_start[j], self.key_end[j]

    @cached_property
    def support(self) -> np.ndarray:
        """Boolean ``(n_query_blocks, n_key_blocks)``: key blocks a query block can reach
        (the blocks that :func:`sparse_attention` gathers)."""
        b, sh = self.block_size, self.shift
        nqb, nkb = self.blocks.shape
        sup = self.blocks.copy()
        qlo = np.arange(nqb) * b + sh                        # first query position
        qhi = np.minimum(np.arange(nqb) * b + b - 1, self.n - 1) + sh
        # Spans are non-decreasing: a key block's smallest end is its first key's, its
        # largest start its last key's.
        first_end = self.key_span(np.arange(nkb) * b)[1]
        last_start = self.key_span(np.minimum(np.arange(nkb) * b + b - 1, self.s - 1))[0]
        if self.window is not None:
            left, right = self.window
            # Some key j of the block and query i' of the block with
            # start_j >= i' - left and end_j <= i' + right.
            sup |= ((first_end[None, :] - right <= qhi[:, None])
                    & (last_start[None, :] + left >= qlo[:, None]))
        if self.global_tokens.size:
            gb = np.unique(self.global_tokens // b)
            sup[gb, :] = True
            sup[:, gb] = True
        if self.causal:
            sup &= first_end[None, :] <= qhi[:, None]
        sup.setflags(write=False)
        return sup

    def count_allowed(self, *, causal: bool = False) -> int:
        """Number of allowed query-key pairs (with ``causal`` added), computed tile by
        tile on the host in ``O(n * keys gathered per query)`` memory, never ``n * s``."""
        import array_api_compat.numpy as xnp

        total = 0
        for rows, idx, valid in self.plan:
            step = max(1, _COUNT_ELEMENTS // (self.block_size ** 2 * idx.shape[1]))
            for c0 in range(0, rows.size, step):
                sl = slice(c0, c0 + step)
                m = tile_mask(xnp, self, rows[sl], idx[sl], valid[sl],
                               causal=causal or self.causal, device="cpu")
                qvalid = (rows[sl, None] * self.block_size + np.arange(self.block_size)) < self.n
                total += int(np.sum(np.broadcast_to(m, (m.shape[0], self.block_size,
                                                        m.shape[2])) & qvalid[:, :, None]))
        return total

    @property
    def density(self) -> float:
        """Fraction of the ``n * s`` query-key pairs that are allowed."""
        return self.count_allowed() / (self.n * self.s)

    def count_computed(self) -> int:
        """Number of query-key scores :func:`sparse_attention` computes (gathered tiles,
        including masked and padded slots): its cost is ``4 d`` FLOPs per score."""
        return sum(int(rows.size) * idx.shape[1] for rows, idx, _ in self.plan) \
            * self.block_size ** 2

    def dense_mask(self, xp=None, *, device=None):
        """The ``(n, s)`` boolean mask of the pattern (``True`` = may attend).

        For tests and docs (it costs ``n * s``). A NumPy array by default; pass a
        namespace ``xp`` (and ``device``) to get it there.

        Examples
        --------
        >>> from arrayattn import local_layout
        >>> local_layout(5, window=1, block_size=2).dense_mask().astype(int)
        array([[1, 1, 0, 0, 0],
               [1, 1, 1, 0, 0],
               [0, 1, 1, 1, 0],
               [0, 0, 1, 1, 1],
               [0, 0, 0, 1, 1]])
        """
        b = self.block_size
        i = np.arange(self.n)[:, None]
        j = np.arange(self.s)[None, :]
        pos = i + self.shift
        start, end = self.key_span(j)
        m = self.blocks[i // b, j // b]
        if self.window is not None:
            left, right = self.window
            m = m | ((start >= pos - left) & (end <= pos + right))
        if self.global_tokens.size:
            g = np.zeros(self.n, dtype=bool)
            g[self.global_tokens] = True
            m = m | g[:, None] | g[None, :]
        if self.causal:
            m = m & (end <= pos)
        if xp is None:
            return m
        return xp_from_host(xp, m, dtype=xp.bool, device=device)

    # -- the gather plan ----------------------------------------------------------
    @cached_property
    def plan(self) -> tuple:
        """Groups ``(rows, idx, valid)`` of query blocks: ``rows (G,)`` query blocks,
        ``idx (G, R)`` the key blocks each gathers (sorted, padded with masked slots),
        ``valid (G, R)`` which slots are real (:func:`group_rows`:
        grouped by how many key blocks they reach)."""
        return group_rows(self.support, self.block_size, _GROUP_OVERHEAD)

    @cached_property
    def scan_plan(self) -> tuple:
        """:attr:`plan` in at most ``_SCAN_GROUPS`` groups, a group more only where it
        saves ``_SCAN_SPLIT`` (half) of the padded work: each group is one loop body of the
        scanned executor, so a pattern's compiled program is the same at every ``n``."""
        return group_rows(self.support, self.block_size, _GROUP_OVERHEAD, _SCAN_GROUPS)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return (f"BlockLayout({self.pattern!r}, n={self.n}, s={self.s}, "
                f"block_size={self.block_size}{extra})")

