"""Sizes chosen per device: what is cache-sized on a CPU is launch-bound on a GPU.

The blockwise online softmax on a CPU wants a ``(block, block)`` score tile that stays
in cache (512: ~1 MiB in float32); on a GPU every block is a few kernel launches, and
bigger blocks amortise them (measured on an H100, 2026-11-22, n = 16384, 8 heads,
d = 64: block 4096 was 6x faster than block 512).

The block-sparse executor works in chunks of the same kind: on a CPU a chunk's score
tiles and gathered rows (``CPU_CHUNK`` elements, 4 MiB in float32) stay near the cache,
and the chunks run 1.3-2x faster than chunks eight times larger (NumPy and ``jax.jit``,
``n`` = 1024 to 16384, ``benchmarks/results/sparse.md``); on a GPU larger chunks
mean fewer launches.
"""
from __future__ import annotations

from ..reference.device import device_kind

__all__ = ["device_kind", "default_block_size", "chunk_elements", "CPU_BLOCK", "GPU_BLOCK",
           "CPU_CHUNK", "GPU_CHUNK"]

CPU_BLOCK = 512
GPU_BLOCK = 4096
#: Elements (scores plus gathered keys and values) of one block-sparse chunk.
CPU_CHUNK = 1 << 20
GPU_CHUNK = 1 << 23


def default_block_size(x) -> int:
    """The blockwise exact attention block for arrays like ``x`` (``block_size="auto"``)."""
    return GPU_BLOCK if device_kind(x) == "gpu" else CPU_BLOCK


def chunk_elements(x) -> int:
    """The block-sparse executor's chunk budget, in elements, for arrays like ``x``."""
    return GPU_CHUNK if device_kind(x) == "gpu" else CPU_CHUNK
