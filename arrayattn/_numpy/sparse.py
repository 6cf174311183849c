"""The NumPy engine of the block-sparse executor: the chunks of a gather plan run in
threads."""
from __future__ import annotations

from .parallel import parallel_map

__all__ = ["map_chunks"]


def map_chunks(fn, chunks) -> list:
    """``[fn(chunk) for chunk in chunks]``, in the engine's threads when there are several.

    Each chunk reads the call's shared blocks and returns its own output (query blocks
    of the forward, key blocks of the backward's key-major pass): nothing is written
    that another chunk reads."""
    if len(chunks) > 1:
        return parallel_map(fn, chunks)
    return [fn(chunk) for chunk in chunks]
