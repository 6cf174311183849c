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

The package, one job per module: :mod:`.layout` (the pattern as host data and its
gather plan), :mod:`.patterns` (the builders), :mod:`.tiles` (a layout's tiles on the
device), :mod:`.executor` (the block-sparse executor, shared with Poolingformer and the
backwards) and :mod:`.api` (the public functions and the registry records).
"""
from .api import checked_sparse, local_attention, sparse_attention
from .executor import block_sparse_attention
from .layout import BlockLayout, num_blocks
from .patterns import (bigbird_layout, block_layout, fixed_layout, local_layout,
                       longformer_layout, strided_layout)
from .tiles import host_indices

__all__ = [
    "BlockLayout", "block_layout", "local_layout", "strided_layout", "fixed_layout",
    "longformer_layout", "bigbird_layout", "sparse_attention", "local_attention",
    "block_sparse_attention", "host_indices", "num_blocks", "checked_sparse",
]
