"""Sparse attention: exact softmax attention restricted to a pattern, computed block-sparse.

A pattern says which keys each query may see.  Here it is *data*, a :class:`BlockLayout`
built on the host (NumPy, like every random object of arrayattn, so the same seed gives
the same layout on every backend):

* ``blocks`` — a boolean ``(n_query_blocks, n_key_blocks)`` matrix of whole blocks of
  ``block_size`` tokens that are allowed (the unit of Child et al.'s blocksparse
  kernels, of BigBird and of DeepSpeed's sparsity configs);
* ``window`` — an optional token-level band ``i - left <= j <= i + right`` (sliding
  window, Longformer);
* ``global_tokens`` — optional tokens that attend to every key and are attended by
  every query (Longformer);
* ``causal`` — the pattern is autoregressive (``j <= i``).

A query ``i`` may attend to key ``j`` when the block pair is allowed, or ``j`` is in
``i``'s window, or ``i`` or ``j`` is global — and, if causal, ``j <= i`` (end-aligned:
``j <= i + s - n``).  :meth:`BlockLayout.dense_mask` gives that ``(n, s)`` mask.

:func:`sparse_attention` never forms the ``(n, s)`` scores: for each query block it
gathers the key blocks the layout can reach (one batched ``take`` per group of query
blocks with a similar number of key blocks) and runs masked dense attention on those,
so time and memory are ``O(n * keys gathered per query)``.

Child et al. 2019, "Generating Long Sequences with Sparse Transformers";
Beltagy et al. 2020, "Longformer: The Long-Document Transformer";
Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences".
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from . import reference
from ._engine import dense_reference, entry, numpy_engine
from ._validate import (check_bias, check_flag, check_key_mask, check_positive_int, check_qkv,
                        check_scale, check_seed)
from ._numpy.parallel import parallel_map
from ._xp import xp_device, xp_from_host
from .reference.scan import scan
from .reference.masks import zero_masked_keys
from .registry import Variant, register

__all__ = [
    "BlockLayout", "block_layout", "local_layout", "strided_layout", "fixed_layout",
    "longformer_layout", "bigbird_layout", "sparse_attention", "local_attention",
    "block_sparse_attention", "host_indices", "num_blocks",
]

# Elements of the score tile plus gathered keys/values processed at once (per chunk of
# query blocks); bounds the working memory at a few hundred MB in float32.
_CHUNK_ELEMENTS = 1 << 23
# The cost of one more group of query blocks, in score elements: a group is a dozen
# array operations, worth about this much padded work.
_GROUP_OVERHEAD = 1 << 17
# Groups of the scanned form (JAX and every non-NumPy-engine path): a bound on the loop
# bodies of its program (a group is a scan over its chunks), and the share of the work
# a group more must save.
_SCAN_GROUPS, _SCAN_SPLIT = 4, 0.05


def _cuts(vals, bounds, tile: int, max_groups):
    """The cheapest cut of the sorted counts into contiguous groups: ``[(u, t)]``, group
    ``u .. t - 1`` padded to ``vals[u]`` key blocks, each group costing its padded work
    plus ``_GROUP_OVERHEAD``; with ``max_groups``, at most that many groups, each saving
    ``_SCAN_SPLIT`` of the one-group work."""
    m = vals.size

    def cost(u, t):
        return vals[u] * (bounds[t] - bounds[u]) * tile + _GROUP_OVERHEAD

    if max_groups is None:
        best, cut = np.zeros(m + 1), np.zeros(m + 1, dtype=np.int64)
        for t in range(1, m + 1):
            costs = [best[u] + cost(u, t) for u in range(t)]
            cut[t] = int(np.argmin(costs))
            best[t] = costs[cut[t]]
        segments, t = [], m
        while t > 0:
            segments.append((cut[t], t))
            t = cut[t]
        return segments[::-1]
    # best[g, t]: the least padded work of the first t counts in g + 1 groups; a group
    # more must save _SCAN_SPLIT of the work of one group (a relative price, so that the
    # same pattern gets the same number of groups -- the same program -- at every n)
    levels = min(m, max_groups)
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
        u = cut[g, t] if g else 0
        segments.append((u, t))
        t, g = u, g - 1
    return segments[::-1]


def num_blocks(n: int, b: int) -> int:
    return -(-n // b)


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

    def _key_span(self, j):
        """First and last position covered by keys ``j`` (an integer array, ``< s``)."""
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
        first_end = self._key_span(np.arange(nkb) * b)[1]
        last_start = self._key_span(np.minimum(np.arange(nkb) * b + b - 1, self.s - 1))[0]
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
            step = max(1, _CHUNK_ELEMENTS // (self.block_size ** 2 * idx.shape[1]))
            for c0 in range(0, rows.size, step):
                sl = slice(c0, c0 + step)
                m = _tile_mask(xnp, self, rows[sl], idx[sl], valid[sl],
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
        start, end = self._key_span(j)
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
        ``valid (G, R)`` which slots are real.

        Query blocks are sorted by how many key blocks they reach and cut into
        contiguous groups minimising padded work plus a fixed cost per group
        (a small dynamic programme over the distinct counts), so a few global rows
        that reach every block do not pad the many local rows, and a handful of edge
        rows do not cost a group of their own."""
        return self._plan(None)

    @cached_property
    def scan_plan(self) -> tuple:
        """:attr:`plan` in at most ``_SCAN_GROUPS`` groups, a group more only where it saves
        ``_SCAN_SPLIT`` of the work: each group is one loop body of the scanned form, and
        a pattern gets the same groups (the same program) at every ``n``."""
        return self._plan(_SCAN_GROUPS)

    def _plan(self, max_groups) -> tuple:
        sup = self.support
        b = self.block_size
        counts = np.maximum(sup.sum(axis=1), 1)
        order = np.argsort(-counts, kind="stable")
        vals, first = np.unique(-counts[order], return_index=True)
        vals, bounds = -vals, np.r_[first, order.size]
        segments = _cuts(vals, bounds, b * b, max_groups)
        groups = []
        for u, t in segments:
            rows = np.sort(order[bounds[u]:bounds[t]])
            r = int(vals[u])
            idx = np.argsort(~sup[rows], axis=1, kind="stable")[:, :r]
            valid = np.take_along_axis(sup[rows], idx, axis=1)
            groups.append((rows, idx, valid))
        return tuple(groups)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return (f"BlockLayout({self.pattern!r}, n={self.n}, s={self.s}, "
                f"block_size={self.block_size}{extra})")


# ---------------------------------------------------------------------------------
# Pattern builders
# ---------------------------------------------------------------------------------

def _check_window(window):
    if isinstance(window, numbers.Integral) and not isinstance(window, bool):
        window = (int(window), int(window))
    if (not isinstance(window, tuple) or len(window) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                       for w in window)):
        raise TypeError(f"window must be an int or a pair (left, right) of ints; got {window!r}")
    if min(window) < 0:
        raise ValueError(f"window sizes must be >= 0; got {window!r}")
    return tuple(int(w) for w in window)


def _self_attention(pattern: str, n: int, s) -> int:
    n = check_positive_int("n", n)
    if s is not None and s != n:
        raise ValueError(f"the {pattern} pattern is defined for self-attention (n == s); "
                         f"got n={n}, s={s}")
    return n


def block_layout(blocks, *, n: int, s: int | None = None, block_size: int,
                 causal: bool = False) -> BlockLayout:
    """A layout from a user's block matrix (e.g. a DeepSpeed or Triton block layout).

    ``blocks`` is a boolean ``(ceil(n/block_size), ceil(s/block_size))`` array-like.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import block_layout
    >>> lay = block_layout(np.eye(3, dtype=bool), n=6, block_size=2)  # block diagonal
    >>> lay.dense_mask().sum(axis=1)
    array([2, 2, 2, 2, 2, 2])
    """
    n = check_positive_int("n", n)
    s = n if s is None else check_positive_int("s", s)
    b = check_positive_int("block_size", block_size)
    return BlockLayout(n=n, s=s, block_size=b, blocks=np.asarray(blocks), causal=bool(causal),
                       pattern="custom")


def local_layout(n: int, *, window, s: int | None = None, block_size: int = 64,
                 causal: bool = False) -> BlockLayout:
    """Sliding window: query ``i`` sees keys ``i - left ... i + right`` (token level).

    ``window`` is ``w`` (``left = right = w``, or ``right = 0`` when ``causal``) or a pair
    ``(left, right)``. This is FlashAttention's ``window_size=(left, right)``
    convention: a symmetric window covers ``2w + 1`` keys, a causal one ``w + 1``
    (Mistral's ``sliding_window=W`` is ``window=W - 1``). With ``n != s`` queries are
    end-aligned (query ``i`` is at key position ``i + s - n``). ``block_size`` only sets
    the granularity of the computation, not the pattern.

    Examples
    --------
    >>> from arrayattn import local_layout
    >>> local_layout(4, window=1, causal=True, block_size=2).dense_mask().astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [0, 1, 1, 0],
           [0, 0, 1, 1]])
    """
    n = check_positive_int("n", n)
    s = n if s is None else check_positive_int("s", s)
    b = check_positive_int("block_size", block_size)
    left, right = _check_window(window)
    if causal:
        right = 0
    blocks = np.zeros((num_blocks(n, b), num_blocks(s, b)), dtype=bool)
    return BlockLayout(n=n, s=s, block_size=b, blocks=blocks, window=(left, right),
                       causal=bool(causal), pattern="local",
                       params={"window": (left, right), "causal": bool(causal)})


def strided_layout(n: int, *, stride: int, block_size: int = 64, causal: bool = True,
                   s: int | None = None) -> BlockLayout:
    """Child et al.'s *strided* pattern on blocks (Sparse Transformer, eq. for A(1), A(2)).

    With ``I, J`` block indices and ``l = stride`` (in blocks): query block ``I`` sees
    key blocks with ``I - l < J <= I`` (the previous ``l`` blocks) and with
    ``(I - J) mod l == 0`` (every ``l``-th block), ``J <= I`` when ``causal``; without
    ``causal`` both parts are mirrored (``|I - J| < l`` or ``(I - J) mod l == 0``).
    ``block_size=1`` is the paper's token-level pattern; larger blocks are how it runs
    in blocksparse kernels. The paper splits the two parts over heads or merges them;
    this is the merged (union) form.

    Examples
    --------
    >>> from arrayattn import strided_layout
    >>> strided_layout(6, stride=2, block_size=1).dense_mask().astype(int)
    array([[1, 0, 0, 0, 0, 0],
           [1, 1, 0, 0, 0, 0],
           [1, 1, 1, 0, 0, 0],
           [0, 1, 1, 1, 0, 0],
           [1, 0, 1, 1, 1, 0],
           [0, 1, 0, 1, 1, 1]])
    """
    n = _self_attention("strided", n, s)
    b = check_positive_int("block_size", block_size)
    stride = check_positive_int("stride", stride)
    nb = num_blocks(n, b)
    diff = np.arange(nb)[:, None] - np.arange(nb)[None, :]
    blocks = (np.abs(diff) < stride) | (diff % stride == 0)
    if causal:
        blocks &= diff >= 0
    return BlockLayout(n=n, s=n, block_size=b, blocks=blocks, causal=bool(causal),
                       pattern="strided", params={"stride": stride, "causal": bool(causal)})


def fixed_layout(n: int, *, stride: int, summary: int = 1, block_size: int = 64,
                 causal: bool = True, s: int | None = None) -> BlockLayout:
    """Child et al.'s *fixed* pattern on blocks (Sparse Transformer).

    With ``l = stride`` and ``c = summary`` (in blocks): query block ``I`` sees the key
    blocks of its own chunk (``J // l == I // l``) and the last ``c`` blocks of every
    chunk (``J mod l >= l - c``, the "summary" blocks), ``J <= I`` when ``causal``.
    ``block_size=1`` is the paper's token-level pattern.

    Examples
    --------
    >>> from arrayattn import fixed_layout
    >>> fixed_layout(6, stride=3, summary=1, block_size=1).dense_mask().astype(int)
    array([[1, 0, 0, 0, 0, 0],
           [1, 1, 0, 0, 0, 0],
           [1, 1, 1, 0, 0, 0],
           [0, 0, 1, 1, 0, 0],
           [0, 0, 1, 1, 1, 0],
           [0, 0, 1, 1, 1, 1]])
    """
    n = _self_attention("fixed", n, s)
    b = check_positive_int("block_size", block_size)
    stride = check_positive_int("stride", stride)
    summary = check_positive_int("summary", summary)
    if summary > stride:
        raise ValueError(f"summary must be <= stride; got summary={summary}, stride={stride}")
    nb = num_blocks(n, b)
    ib, jb = np.arange(nb)[:, None], np.arange(nb)[None, :]
    blocks = (ib // stride == jb // stride) | (jb % stride >= stride - summary)
    if causal:
        blocks &= jb <= ib
    return BlockLayout(n=n, s=n, block_size=b, blocks=blocks, causal=bool(causal),
                       pattern="fixed",
                       params={"stride": stride, "summary": summary, "causal": bool(causal)})


def longformer_layout(n: int, *, window, global_tokens=(), block_size: int = 64,
                      causal: bool = False, s: int | None = None) -> BlockLayout:
    """Longformer: a token-level sliding window plus symmetric global attention.

    ``window`` as in :func:`local_layout` (Longformer's window size ``w`` covers
    ``w/2`` tokens on each side, i.e. ``window=w // 2``); ``global_tokens`` are token
    indices (e.g. ``[0]`` for [CLS], or the question tokens) that attend to every key
    and are attended by every query. Dilation is not modelled.

    Examples
    --------
    >>> from arrayattn import longformer_layout
    >>> longformer_layout(5, window=1, global_tokens=[0], block_size=2).dense_mask().astype(int)
    array([[1, 1, 1, 1, 1],
           [1, 1, 1, 0, 0],
           [1, 1, 1, 1, 0],
           [1, 0, 1, 1, 1],
           [1, 0, 0, 1, 1]])
    """
    n = _self_attention("longformer", n, s)
    b = check_positive_int("block_size", block_size)
    left, right = _check_window(window)
    if causal:
        right = 0
    g = np.asarray(global_tokens, dtype=np.int64).reshape(-1)
    blocks = np.zeros((num_blocks(n, b), num_blocks(n, b)), dtype=bool)
    return BlockLayout(n=n, s=n, block_size=b, blocks=blocks, window=(left, right),
                       global_tokens=g, causal=bool(causal), pattern="longformer",
                       params={"window": (left, right), "global_tokens": g.tolist(),
                               "causal": bool(causal)})


def bigbird_layout(n: int, *, block_size: int = 64, num_window_blocks: int = 3,
                   num_global_blocks: int = 2, num_random_blocks: int = 3, seed=0,
                   global_blocks=None, causal: bool = False,
                   s: int | None = None) -> BlockLayout:
    """BigBird (ITC): sliding blocks + global blocks + random blocks, on blocks.

    * window: query block ``I`` sees key blocks ``I - w//2 ... I + w//2`` for an odd
      ``w = num_window_blocks`` (``I - w + 1 ... I`` when ``causal``);
    * global: the ``num_global_blocks`` global blocks (by default the first
      ``ceil(g/2)`` and the last ``floor(g/2)`` blocks, as in the reference
      implementation; or ``global_blocks``) see every block and are seen by every block;
    * random: every other query block sees ``num_random_blocks`` key blocks drawn
      uniformly without replacement from the blocks not already in its window or
      global (past blocks only when ``causal``), with
      ``numpy.random.default_rng(seed)`` on the host: same seed, same layout, on every
      backend. Rows with fewer candidates take them all.

    Examples
    --------
    >>> from arrayattn import bigbird_layout
    >>> lay = bigbird_layout(64, block_size=8, num_random_blocks=1, seed=0)
    >>> lay.blocks.sum(axis=1)  # global rows: all 8; others window 3 + global 2 + random 1
    array([8, 5, 6, 6, 6, 6, 5, 8])
    >>> lay.blocks[1].astype(int)  # block 1's window already contains global block 0
    array([1, 1, 1, 1, 0, 0, 0, 1])
    """
    n = _self_attention("bigbird", n, s)
    seed = check_seed(seed)
    causal = check_flag("causal", causal)
    b = check_positive_int("block_size", block_size)
    w = check_positive_int("num_window_blocks", num_window_blocks)
    r = check_positive_int("num_random_blocks", num_random_blocks, minimum=0)
    nb = num_blocks(n, b)
    if global_blocks is None:
        g = check_positive_int("num_global_blocks", num_global_blocks, minimum=0)
        first = (g + 1) // 2
        gb = np.unique(np.r_[np.arange(min(first, nb)),
                             np.arange(max(nb - (g - first), 0), nb)]).astype(np.int64)
    else:
        gb = np.unique(np.asarray(global_blocks, dtype=np.int64).reshape(-1))
        if gb.size and (gb[0] < 0 or gb[-1] >= nb):
            raise ValueError(f"global_blocks must be block indices in [0, {nb}); "
                             f"got {gb.tolist()}")
    if not causal and w % 2 == 0:
        raise ValueError(f"num_window_blocks must be odd for a centred window; got {w}")
    ib, jb = np.arange(nb)[:, None], np.arange(nb)[None, :]
    if causal:
        window = (jb <= ib) & (jb > ib - w)
    else:
        window = np.abs(ib - jb) <= w // 2
    is_g = np.zeros(nb, dtype=bool)
    is_g[gb] = True
    blocks = window | is_g[:, None] | is_g[None, :]
    if r:
        cand = ~blocks
        if causal:
            cand &= jb <= ib
        keys = np.random.default_rng(seed).random((nb, nb))
        keys[~cand] = np.inf
        pick = np.argsort(keys, axis=1, kind="stable")[:, :r]
        chosen = np.zeros_like(blocks)
        np.put_along_axis(chosen, pick, True, axis=1)
        blocks |= chosen & cand
    if causal:
        blocks &= jb <= ib
    return BlockLayout(n=n, s=n, block_size=b, blocks=blocks, causal=bool(causal),
                       pattern="bigbird",
                       params={"num_window_blocks": w, "global_blocks": gb.tolist(),
                               "num_random_blocks": r, "seed": seed, "causal": bool(causal)})


# ---------------------------------------------------------------------------------
# Block-sparse attention
# ---------------------------------------------------------------------------------

def host_indices(xp, a, device):
    """Host integers (block indices, positions) to ``xp`` int32 on ``device`` (every
    library has int32; JAX without x64 has no int64, and these indices are small)."""
    return xp_from_host(xp, np.asarray(a, dtype=np.int32), dtype=xp.int32, device=device)


def _chunk_masks(layout: BlockLayout, rows, idx, valid, *, causal: bool):
    """Host description of one chunk: first and last positions of the gathered keys
    ``(G, R*b)`` (the same array unless keys are intervals), slot codes (0 = padding,
    1 = reachable, 2 = allowed by a whole block or a global key), query positions
    ``(G, b)`` and, for global queries, a flag ``(G, b)``."""
    b = layout.block_size
    ar = np.arange(b)
    kpos = (idx[:, :, None] * b + ar).reshape(idx.shape[0], -1)
    kvalid = np.repeat(valid, b, axis=1) & (kpos < layout.s)
    full = np.repeat(layout.blocks[rows[:, None], idx], b, axis=1)
    qpos = rows[:, None] * b + ar
    gq = None
    if layout.global_tokens.size:
        g = np.zeros(max(layout.n, layout.s) + b * 2, dtype=bool)
        g[layout.global_tokens] = True
        full = full | g[kpos]
        gq = g[qpos]
        if not gq.any():
            gq = None
    code = np.where(kvalid, np.where(full, 2, 1), 0)
    # A row can skip the token-level rules when every slot is already decided.
    needs_rules = layout.window is not None or gq is not None or causal
    kstart, kend = layout._key_span(np.minimum(kpos, layout.s - 1))
    return kstart, kend, code, qpos + layout.shift, gq, needs_rules


def _tile_mask(xp, layout: BlockLayout, rows, idx, valid, *, causal: bool, device):
    """The pattern's boolean ``(G, b, R*b)`` mask over the gathered tiles of query blocks
    ``rows`` and key blocks ``idx`` (no key mask), built on ``device`` from ``O(G R b)``
    host integers. The one place the pattern's token-level rules are applied."""
    return _mask_from(xp, layout, _mask_tables(xp, layout, rows, idx, valid, causal=causal,
                                               device=device), causal=causal)


def _mask_tables(xp, layout: BlockLayout, rows, idx, valid, *, causal: bool, device):
    """:func:`_chunk_masks` as device int32 arrays, by name (only those the rules use):
    ``code (G, R*b)``, ``kend``/``kstart (G, R*b)``, ``apos (G, b)``, ``gq (G, b)``."""
    kstart, kend, code, apos, gq, needs_rules = _chunk_masks(layout, rows, idx, valid,
                                                             causal=causal)
    host = {"code": code}
    if needs_rules:
        host.update(kend=kend, apos=apos)
        if kstart is not kend:
            host["kstart"] = kstart
        if gq is not None:
            host["gq"] = gq
    return {name: host_indices(xp, a, device) for name, a in host.items()}


def _mask_from(xp, layout: BlockLayout, t: dict, *, causal: bool):
    """The ``(G, b, R*b)`` mask from the tables of :func:`_mask_tables` (any leading
    shape of the ``G`` axis: a scanned chunk's slice of them)."""
    code_x = xp.expand_dims(t["code"], axis=-2)                              # (G, 1, Rb)
    allowed = code_x == 2
    if "apos" not in t:
        return allowed
    kend_x = xp.expand_dims(t["kend"], axis=-2)                              # (G, 1, Rb)
    kstart_x = xp.expand_dims(t["kstart"], axis=-2) if "kstart" in t else kend_x
    apos_x = xp.expand_dims(t["apos"], axis=-1)                              # (G, b, 1)
    reach = code_x >= 1
    if layout.window is not None:
        left, right = layout.window
        allowed = allowed | (reach & (kstart_x >= apos_x - left) & (kend_x <= apos_x + right))
    if "gq" in t:
        allowed = allowed | (reach & (xp.expand_dims(t["gq"], axis=-1) > 0))
    if causal:
        allowed = allowed & (kend_x <= apos_x)
    return allowed


def _tile_bias(xp, bias, rows, idx, layout: BlockLayout):
    """The bias on the gathered tiles ``(..., G, b, R*b)`` of query blocks ``rows (G,)``
    and key blocks ``idx (G, R)`` (device integers): its query rows, then each group's
    key positions (padding slots read a clamped, masked-off entry)."""
    b, n, s = layout.block_size, layout.n, layout.s
    info = xp.__array_namespace_info__()
    index = info.default_dtypes(device=xp_device(bias))["indexing"]   # torch: int64 only
    ar = xp.arange(b, dtype=index, device=xp_device(bias))
    qrows = xp.minimum(xp.astype(rows, index)[:, None] * b + ar, n - 1)
    rb = xp.take(bias, xp.reshape(qrows, (-1,)), axis=bias.ndim - 2)
    rb = xp.reshape(rb, (*rb.shape[:-2], rows.shape[0], b, s))
    kpos = xp.astype(idx, index)[:, :, None] * b + ar
    cols = xp.minimum(xp.reshape(kpos, (idx.shape[0], 1, -1)), s - 1)
    return xp.take_along_axis(rb, xp.broadcast_to(cols, (*rb.shape[:-1], cols.shape[-1])),
                              axis=-1)


def _blocks(xp, x, nb: int, b: int, *, device):
    """``x (..., t, c)`` padded with zero rows to ``nb * b`` tokens, as ``(..., nb, b, c)``."""
    pad = nb * b - x.shape[-2]
    if pad:
        x = xp.concat([x, xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype,
                                   device=device)], axis=-2)
    return xp.reshape(x, (*x.shape[:-2], nb, b, x.shape[-1]))


def block_sparse_attention(p, q, k, v, layout: BlockLayout, *, causal: bool, key_mask,
                           bias=None):
    """The gather plan of ``layout`` run group by group on
    :func:`arrayattn.reference.sparse.gathered_attention`. ``q`` is already scaled; all in
    the working dtype. Rows too long for the memory budget (global rows reach every
    block) are split over their key blocks too, and the partial softmaxes merged by
    log-sum-exp (:func:`arrayattn.reference.sparse.merge_attention`)."""
    xp, dev = p.xp, p.device
    b, n = layout.block_size, p.n
    nqb, nkb = layout.blocks.shape
    causal = causal or layout.causal
    qb = _blocks(xp, q, nqb, b, device=dev)
    kb = _blocks(xp, k, nkb, b, device=dev)
    vb = _blocks(xp, v, nkb, b, device=dev)
    km = None if key_mask is None else _blocks(xp, key_mask[..., None], nkb, b, device=dev)
    batch = math.prod(p.batch)
    per_slot = batch * (b * b + b * (p.d + p.dv))    # one key block of one query block

    def sizes(r):   # query blocks per chunk, key blocks per part of a row
        step = max(1, _CHUNK_ELEMENTS // (r * per_slot + batch * b * (p.d + p.dv)))
        return step, min(r, max(1, _CHUNK_ELEMENTS // per_slot))

    def attend_part(qc, rows, idx, allowed):
        if km is not None:
            kmc = xp.take(km, xp.reshape(idx, (-1,)), axis=km.ndim - 3)
            allowed = allowed & xp.reshape(kmc, (*kmc.shape[:-3], idx.shape[0], 1,
                                                 idx.shape[1] * b))
        tile_bias = None if bias is None else _tile_bias(xp, bias, rows, idx, layout)
        return reference.gathered_attention(qc, kb, vb, idx, allowed, tile_bias)

    work = layout.count_computed() * batch * (xp.finfo(q.dtype).bits // 8)
    if numpy_engine(xp, work):
        # The NumPy engine runs the chunks in threads (each reads the shared blocks,
        # writes its own output).
        chunks = []
        for rows_all, idx_all, valid_all in layout.plan:
            step, span = sizes(idx_all.shape[1])
            chunks += [(rows_all[c0:c0 + step], idx_all[c0:c0 + step],
                        valid_all[c0:c0 + step], span)
                       for c0 in range(0, rows_all.size, step)]

        def attend_chunk(chunk):
            rows, idx_rows, valid_rows, span = chunk
            rows_x = host_indices(xp, rows, dev)
            qc = xp.take(qb, rows_x, axis=qb.ndim - 3)
            acc = lse = None
            for r0 in range(0, idx_rows.shape[1], span):
                idx, valid = idx_rows[:, r0:r0 + span], valid_rows[:, r0:r0 + span]
                allowed = _tile_mask(xp, layout, rows, idx, valid, causal=causal,
                                     device=dev)
                o, l = attend_part(qc, rows_x, host_indices(xp, idx, dev), allowed)
                acc, lse = (o, l) if acc is None else reference.merge_attention(acc, lse,
                                                                                o, l)
            return acc                                                 # (..., G, b, dv)

        outs = parallel_map(attend_chunk, chunks) if len(chunks) > 1 else [
            attend_chunk(chunks[0])]
        perm = np.concatenate([c[0] for c in chunks])
    else:
        outs, perm = _scanned(xp, layout, qb, p.dv, sizes, attend_part, causal=causal,
                              device=dev)
    out = outs[0] if len(outs) == 1 else xp.concat(outs, axis=-3)
    if not np.array_equal(perm, np.arange(nqb)):
        inv = np.empty(nqb, dtype=np.int64)
        inv[perm] = np.arange(perm.size)
        out = xp.take(out, host_indices(xp, inv, dev), axis=out.ndim - 3)
    out = xp.reshape(out, (*out.shape[:-3], nqb * b, p.dv))
    return out[..., :n, :] if nqb * b != n else out


_PER_KEY = ("code", "kend", "kstart")     # the mask tables with one entry per key slot


def _scanned(xp, layout: BlockLayout, qb, dv, sizes, attend_part, *, causal: bool,
             device):
    """The gather plan as loops that ``jax.jit`` traces once: per group of
    :attr:`BlockLayout.scan_plan`, a :func:`~arrayattn.reference.scan.scan` over chunks of
    ``step`` query blocks (the last block repeated to fill the last chunk, its repeats
    dropped after), and in each chunk a scan over parts of ``span`` key blocks (masked
    slots fill the last part), merged by log-sum-exp.  Returns the groups' outputs ``(..., G', b, dv)`` and the query
    block of each of their rows."""
    b = layout.block_size
    outs, perm = [], []
    for rows, idx, valid in layout.scan_plan:
        step, span = sizes(idx.shape[1])
        step = min(step, rows.size)
        chunks, parts = -(-rows.size // step), -(-idx.shape[1] // span)
        fill = chunks * step - rows.size
        rows, idx, valid = (np.concatenate([x, np.repeat(x[-1:], fill, axis=0)])
                            for x in (rows, idx, valid))
        pad = parts * span - idx.shape[1]
        idx = np.pad(idx, ((0, 0), (0, pad)))
        valid = np.pad(valid, ((0, 0), (0, pad)))
        t = _mask_tables(xp, layout, rows, idx, valid, causal=causal, device=device)
        # (chunks, step, parts, span [* b]) and (chunks, step, b): scanned along axis 0,
        # then each chunk's parts along axis -2
        t = {name: xp.reshape(a, (chunks, step, parts, span * b) if name in _PER_KEY
                              else (chunks, step, b)) for name, a in t.items()}
        t["idx"] = xp.reshape(host_indices(xp, idx, device), (chunks, step, parts, span))
        t["rows"] = xp.reshape(host_indices(xp, rows, device), (chunks, step))
        names = list(t)
        per_part = [name for name in names if name in ("idx", *_PER_KEY)]

        def chunk(_, *tables):
            c = dict(zip(names, tables))
            qc = xp.take(qb, c["rows"], axis=qb.ndim - 3)

            def attend(*tiles):
                tile = {**c, **dict(zip(per_part, tiles))}
                allowed = _mask_from(xp, layout, tile, causal=causal)
                return attend_part(qc, c["rows"], tile["idx"], allowed)

            if parts == 1:                        # whole rows at once: nothing to merge
                return None, attend(*(c[name][..., 0, :] for name in per_part))[0]
            empty = (xp.zeros((step, b, dv), dtype=qb.dtype, device=device),
                     xp.full((step, b), -xp.inf, dtype=qb.dtype, device=device))
            (acc, _), _ = scan(lambda merged, *tiles: (
                reference.merge_attention(*merged, *attend(*tiles)), None),
                empty, [c[name] for name in per_part], axis=-2)
            return None, acc

        _, out = scan(chunk, None, [t[name] for name in names], axis=0)  # (chunks, ..., step, b, dv)
        out = xp.permute_dims(out, (*range(1, out.ndim - 3), 0,
                                    *range(out.ndim - 3, out.ndim)))
        out = xp.reshape(out, (*out.shape[:-4], chunks * step, *out.shape[-2:]))
        outs.append(out[..., :rows.size - fill, :, :])            # the repeats dropped
        perm.append(rows[:rows.size - fill])
    return outs, np.concatenate(perm)


def sparse_attention(q, k, v, /, *, layout: BlockLayout, scale=None, causal=False,
                     key_mask=None, bias=None):
    r"""Exact softmax attention restricted to a sparse pattern, computed block-sparse.

    .. math:: O = \operatorname{softmax}\!\left(Q K^\top \cdot \mathrm{scale} + B + M\right) V,
              \qquad M_{ij} = 0 \text{ if } (i, j) \in \text{pattern}, -\infty \text{ else}

    equal (to rounding) to ``softmax_attention(q, k, v, mask=layout.dense_mask())``,
    but for each query block only the key blocks the layout reaches are gathered and
    attended: time ``O(n r b d)`` and memory ``O(n r b)`` for ``r`` gathered blocks
    of ``b`` keys per query block, never ``O(n s)``.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    layout : BlockLayout
        The pattern, for exactly these ``n`` and ``s`` (it carries its block size);
        see :func:`local_layout`, :func:`strided_layout`, :func:`fixed_layout`,
        :func:`longformer_layout`, :func:`bigbird_layout`, :func:`block_layout`.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    causal : bool
        Additionally require ``j <= i + s - n`` (end-aligned). A causal layout is
        causal whatever this flag says.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key.
    bias : real floating array, shape ``(..., n, s)``, optional
        Added to the scaled logits (ALiBi, relative-position biases, an SDPA float
        mask); ``-inf`` entries act as masked; broadcast like ``mask``. Only the
        entries on the pattern's gathered tiles are read.

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q``; a query with no allowed key gives 0.

    Notes
    -----
    The computation is :func:`arrayattn.reference.sparse.gathered_attention` run over
    the layout's gather plan (host data). Under ``use_engine("reference")`` a problem
    of at most ``arrayattn._engine.DENSE_REFERENCE_MAX`` scores runs the dense definition
    :func:`arrayattn.reference.sparse.sparse_attention` on ``layout.dense_mask()``
    instead: what :mod:`arrayattn.testing` validates against, and what the gathered
    form is tested equal to.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import bigbird_layout, softmax_attention, sparse_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 40, 8)) for _ in range(3))
    >>> lay = bigbird_layout(40, block_size=4, num_random_blocks=1, seed=0)
    >>> out = sparse_attention(q, k, v, layout=lay)
    >>> ref = softmax_attention(q, k, v, mask=lay.dense_mask())
    >>> bool(np.allclose(out, ref))
    True
    """
    p = check_qkv(q, k, v)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout (see arrayattn.local_layout etc.); "
                        f"got {type(layout).__name__}")
    if (layout.n, layout.s) != (p.n, p.s):
        raise ValueError(
            f"layout was built for n={layout.n} queries and s={layout.s} keys but q has "
            f"n={p.n} (shape {tuple(q.shape)}) and k has s={p.s} (shape {tuple(k.shape)})"
        )
    causal = check_flag("causal", causal)
    check_key_mask(p, key_mask, q)
    scale = check_scale(scale, p.d)
    bias = check_bias(p, bias, q)
    xp = p.xp
    wq = xp.astype(q, p.work_dtype, copy=False)
    # Padded keys may hold anything (NaN, inf): their rows are replaced, not weighted by 0.
    wk, wv = zero_masked_keys(key_mask, xp.astype(k, p.work_dtype, copy=False),
                              xp.astype(v, p.work_dtype, copy=False))
    with entry(xp):
        if dense_reference(math.prod(p.batch) * p.n * p.s):
            allowed = reference.allowed_mask(
                xp, p.n, p.s, device=p.device, causal=causal, key_mask=key_mask,
                mask=layout.dense_mask(xp, device=p.device))
            out = reference.sparse_attention(wq, wk, wv, allowed, scale=scale, bias=bias)
        else:
            out = block_sparse_attention(p, wq * scale, wk, wv, layout, causal=causal,
                                         key_mask=key_mask, bias=bias)
    return xp.astype(out, p.dtype, copy=False)


def local_attention(q, k, v, /, *, window, causal=False, block_size=64, scale=None,
                    key_mask=None, bias=None):
    r"""Sliding-window attention: query ``i`` attends to keys ``i - left ... i + right``.

    Exact softmax attention on the band of :func:`local_layout` (``window`` = ``w`` for
    ``w`` keys on each side, ``w`` past keys when ``causal``, or a pair
    ``(left, right)``; FlashAttention's ``window_size`` convention), computed
    block-sparse in ``O(n (left + right + 2 b) d)`` time and memory. With ``n != s``
    queries are end-aligned (query ``i`` is at key position ``i + s - n``).

    Parameters
    ----------
    q, k, v : arrays ``(..., n, d)``, ``(..., s, d)``, ``(..., s, dv)``
    window : int or (int, int)
    causal : bool
        Keys after the query are excluded (``right = 0``).
    block_size : int
        Granularity of the computation (the result does not depend on it).
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    key_mask : boolean array ``(..., s)``, optional
    bias : real floating array ``(..., n, s)``, optional
        Added to the scaled logits, as in :func:`sparse_attention`.

    Returns
    -------
    array, shape ``(..., n, dv)``

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import local_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 30, 8)) for _ in range(3))
    >>> out = local_attention(q, k, v, window=4, causal=True, block_size=8)
    >>> bool(np.allclose(out[:, :5], softmax_attention(q[:, :5], k[:, :5], v[:, :5], causal=True)))
    True
    >>> bool(np.allclose(local_attention(q, k, v, window=30), softmax_attention(q, k, v)))
    True
    """
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    if p.s == 0:
        return p.zeros()
    layout = local_layout(p.n, s=p.s, window=window, block_size=block_size, causal=causal)
    return sparse_attention(q, k, v, layout=layout, scale=scale, causal=causal,
                            key_mask=key_mask, bias=bias)


# ---------------------------------------------------------------------------------
# Registry: uniform-call adapters build the layout from the inputs' n.
# ---------------------------------------------------------------------------------

def _pattern_call(builder, **fixed):
    def call(q, k, v, /, *, scale=None, causal=False, key_mask=None, bias=None, **options):
        check_qkv(q, k, v)
        causal = check_flag("causal", causal)
        opts = {**fixed, **options}
        layout = builder(q.shape[-2], s=k.shape[-2], **opts)
        return sparse_attention(q, k, v, layout=layout, scale=scale, causal=causal,
                                key_mask=key_mask, bias=bias)
    call.__name__ = f"{builder.__name__}_attention"
    return call


_SPARSE = dict(family="sparse", exact=False, causal=True, key_mask=True, normalized=True)

register(Variant(
    name="local", fn=local_attention, **_SPARSE,
    defaults={"window": 16, "block_size": 16}, parameter="window",
    complexity="O(n (2w + 2b) d) time and memory",
    citation="Child et al. 2019 (local heads); Beltagy et al. 2020 (sliding window)",
    notes="window = keys on each side (FlashAttention window_size); end-aligned when n != s.",
))
register(Variant(
    name="longformer", fn=sparse_attention, call=_pattern_call(longformer_layout),
    **_SPARSE, cross=False,
    defaults={"window": 8, "global_tokens": (0,), "block_size": 16}, parameter="window",
    complexity="O(n (2w + 2b + g) d) time and memory",
    citation="Beltagy et al. 2020, Longformer: The Long-Document Transformer",
    notes="Layout built from n by longformer_layout(window=, global_tokens=, block_size=).",
))
register(Variant(
    name="bigbird", fn=sparse_attention, call=_pattern_call(bigbird_layout),
    **_SPARSE, cross=False, random=True,
    defaults={"block_size": 8, "num_window_blocks": 3, "num_global_blocks": 2,
              "num_random_blocks": 2, "seed": 0},
    parameter="num_random_blocks",
    complexity="O(n (w + g + r) b d) time and memory",
    citation="Zaheer et al. 2020, Big Bird: Transformers for Longer Sequences",
    notes="Layout built from n by bigbird_layout(...); random blocks drawn on the host.",
))
register(Variant(
    name="strided", fn=sparse_attention, call=_pattern_call(strided_layout, causal=False),
    **_SPARSE, cross=False,
    defaults={"stride": 8, "block_size": 32}, parameter="stride",
    complexity="O(n (l + n/l) b d) time and memory",
    citation="Child et al. 2019, Generating Long Sequences with Sparse Transformers",
    notes="Block-level strided pattern (strided_layout); symmetric unless causal=True.",
))
register(Variant(
    name="fixed", fn=sparse_attention, call=_pattern_call(fixed_layout, causal=False),
    **_SPARSE, cross=False,
    defaults={"stride": 8, "summary": 1, "block_size": 32}, parameter="stride",
    complexity="O(n (l + c n/l) b d) time and memory",
    citation="Child et al. 2019, Generating Long Sequences with Sparse Transformers",
    notes="Block-level fixed pattern (fixed_layout); symmetric unless causal=True.",
))
