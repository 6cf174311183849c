"""What the conventions of shipped kernels (xFormers, FlashInfer, vLLM, the Triton tutorial)
share: the head dims a library accepts, the inputs judged in arrayattn's ``(b, h, n, d)``
layout, and a paged cache drawn from per-sequence lengths.

These conventions judge in arrayattn's own layout: ``call`` hands back the output as
``(..., h, n, dv)`` (a differentiable transpose of what the kernel returned), the ``do`` of
the backward is drawn in that layout, and :meth:`ShippedConvention.to_judge` moves the
kernel's input gradients there.  The referee is arrayattn's ``softmax`` (or
:func:`arrayattn.paged_attention`) with arrayattn's option names: no port profile is
involved, the adapter maps the library's semantics itself."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .base import Call, Convention, host

__all__ = ["ShippedConvention", "nearest_dim", "draw_pages", "gather_dense"]


def nearest_dim(d: int, dims: tuple) -> int:
    """The smallest of ``dims`` at least ``d`` (the largest when none is)."""
    fit = [x for x in sorted(dims) if x >= d]
    return fit[0] if fit else max(dims)


class ShippedConvention(Convention):
    """A convention judged in ``(b, h, n, d)``: subclasses set ``head_dims`` (the head
    sizes the library's kernels accept; ``None``: any) and map inputs with
    :meth:`kernel_layout` / :meth:`grad_to_bhnd`."""

    head_dims: tuple | None = None

    def normalize(self, case):
        if self.head_dims is not None:
            d = nearest_dim(case.d, self.head_dims)
            dv = d if self.equal_dims else nearest_dim(case.dv, self.head_dims)
            if (d, dv) != (case.d, case.dv):
                case = replace(case, d=d, dv=dv)
        return case

    def build(self, case):
        """:meth:`build_valid` of the case made valid (a case may come un-normalized, as
        the search's dtype probe does)."""
        return self.build_valid(self.normalize(case))

    def call(self, fn, t, case):
        return self.call_valid(fn, t, self.normalize(case))

    def build_valid(self, case):  # pragma: no cover - abstract
        raise NotImplementedError

    def call_valid(self, fn, t, case):  # pragma: no cover - abstract
        raise NotImplementedError

    def grad_to_bhnd(self, name: str, g):
        """A gradient of the kernel's input ``name`` in ``(b, h, n, d)``."""
        return g

    def to_judge(self, name, x):
        return x if name in ("out", "lse", "final_state") else self.grad_to_bhnd(name, x)

    def judged_call(self, t: dict, diff: tuple, params: dict, inputs: dict, notes=()) -> Call:
        """The :class:`Call` judged by arrayattn's ``softmax`` with ``params`` (arrayattn's
        options), ``inputs`` the host q, k, v, do in ``(b, h, n, d)`` (k, v the caches
        ``(num_blocks, page, h_kv, d)`` when ``params`` has a block table)."""
        return Call(t, diff, "softmax", None, "bhnd", params, grad_params=params,
                    inputs=inputs, notes=list(notes))


def draw_pages(rng, lengths, page: int, hkv: int, d: int, dv: int, spare: int = 1):
    """A shuffled paged cache holding ``lengths[b]`` tokens per sequence: ``(k_pages, v_pages
    (num_blocks, page, h_kv, d|dv), pages)`` where ``pages[b]`` lists sequence ``b``'s
    blocks in order; ``spare`` extra blocks never referenced.  Every slot (used or not)
    holds a standard normal value: a kernel that reads past a sequence's length reads
    finite garbage, and its output moves."""
    counts = [max(1, -(-int(n) // page)) for n in lengths]
    total = sum(counts) + spare
    order = rng.permutation(total)
    pages, at = [], 0
    for c in counts:
        pages.append(order[at:at + c].astype(np.int64))
        at += c
    k = rng.standard_normal((total, page, hkv, d))
    v = rng.standard_normal((total, page, hkv, dv))
    return k, v, pages


def gather_dense(cache: np.ndarray, pages, lengths) -> np.ndarray:
    """The tokens of every sequence, concatenated: ``(h_kv, sum(lengths), d)`` from a cache
    ``(num_blocks, page, h_kv, d)``."""
    parts = [cache[p].reshape(-1, *cache.shape[2:])[:int(n)] for p, n in zip(pages, lengths)]
    return np.ascontiguousarray(np.concatenate(parts).transpose(1, 0, 2))
