"""The pattern builders: a :class:`~arrayattn.BlockLayout` from a paper's pattern (local,
strided, fixed, Longformer, BigBird) or from a user's block matrix."""
from __future__ import annotations

import numpy as np

from ..core.checks import check_band, check_flag, check_positive_int, check_seed
from .layout import BlockLayout, num_blocks

__all__ = ["block_layout", "local_layout", "strided_layout", "fixed_layout",
           "longformer_layout", "bigbird_layout"]


def _self_attention(pattern: str, n: int, s) -> int:
    """``n``, checked, for a pattern defined for self-attention only (``s`` is ``n``)."""
    n = check_positive_int("n", n)
    if s is not None and s != n:
        raise ValueError(f"the {pattern} pattern is defined for self-attention (n == s); "
                         f"got n={n}, s={s}")
    return n


def _block_grid(n: int, b: int):
    """Query and key block indices ``(nb, 1)``, ``(1, nb)`` of ``n`` tokens in blocks of
    ``b`` (broadcast against each other: the block matrix's coordinates)."""
    nb = num_blocks(n, b)
    return np.arange(nb)[:, None], np.arange(nb)[None, :]


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
    left, right = check_band("window", window)
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
    ib, jb = _block_grid(n, b)
    diff = ib - jb
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
    ib, jb = _block_grid(n, b)
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
    left, right = check_band("window", window)
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
    gb = _global_blocks(nb, num_global_blocks, global_blocks)
    if not causal and w % 2 == 0:
        raise ValueError(f"num_window_blocks must be odd for a centred window; got {w}")
    ib, jb = _block_grid(n, b)
    if causal:
        window = (jb <= ib) & (jb > ib - w)
    else:
        window = np.abs(ib - jb) <= w // 2
    is_g = np.zeros(nb, dtype=bool)
    is_g[gb] = True
    blocks = window | is_g[:, None] | is_g[None, :]
    if r:
        blocks |= _random_blocks(blocks, r, seed, causal=causal)
    if causal:
        blocks &= jb <= ib
    return BlockLayout(n=n, s=n, block_size=b, blocks=blocks, causal=bool(causal),
                       pattern="bigbird",
                       params={"num_window_blocks": w, "global_blocks": gb.tolist(),
                               "num_random_blocks": r, "seed": seed, "causal": bool(causal)})


def _global_blocks(nb: int, num_global_blocks: int, global_blocks) -> np.ndarray:
    """BigBird's global blocks: ``global_blocks``, or the first ``ceil(g/2)`` and the last
    ``floor(g/2)`` of the ``nb`` blocks for ``g = num_global_blocks``."""
    if global_blocks is None:
        g = check_positive_int("num_global_blocks", num_global_blocks, minimum=0)
        first = (g + 1) // 2
        return np.unique(np.r_[np.arange(min(first, nb)),
                               np.arange(max(nb - (g - first), 0), nb)]).astype(np.int64)
    gb = np.unique(np.asarray(global_blocks, dtype=np.int64).reshape(-1))
    if gb.size and (gb[0] < 0 or gb[-1] >= nb):
        raise ValueError(f"global_blocks must be block indices in [0, {nb}); "
                         f"got {gb.tolist()}")
    return gb


def _random_blocks(blocks: np.ndarray, r: int, seed: int, *, causal: bool) -> np.ndarray:
    """``r`` blocks per row drawn uniformly without replacement (host RNG ``seed``) from
    those not in ``blocks`` (past blocks only when ``causal``); all of them when fewer."""
    nb = blocks.shape[0]
    ib, jb = _block_grid(nb, 1)
    cand = ~blocks
    if causal:
        cand &= jb <= ib
    keys = np.random.default_rng(seed).random((nb, nb))
    keys[~cand] = np.inf
    pick = np.argsort(keys, axis=1, kind="stable")[:, :r]
    chosen = np.zeros_like(blocks)
    np.put_along_axis(chosen, pick, True, axis=1)
    return chosen & cand
