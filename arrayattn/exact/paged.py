"""Attention over a paged KV cache (vLLM's PagedAttention; FlashAttention's
``flash_attn_with_kvcache`` with ``block_table``).

The keys and values of sequence ``b`` live in pages of a shared cache: page
``block_table[b, m]`` holds its tokens ``m * page .. (m + 1) * page - 1``, and only the first
``cache_seqlens[b]`` tokens are real.  The result equals gathering the pages into dense
``k, v`` and attending with a key mask, queries end-aligned with each sequence's own
length: query ``i`` of sequence ``b`` sits at position ``cache_seqlens[b] - n + i``.  A slot
past a sequence's length never enters arithmetic, whatever it holds (NaN included).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from ..core.checks import check_array, check_same_array_kind
from ..core.heads import group_heads
from ..core.pipeline import run
from ..core.xp import xp_device, xp_namespace
from .checks import Call, checked_call
from .softmax import SPEC

__all__ = ["paged_attention", "gather_pages", "paged_inputs", "PagedCall", "checked_paged",
           "PAGED_SPEC"]


def gather_pages(cache, block_table):
    """The dense ``(b, h_kv, max_blocks * page, d)`` view of ``cache (num_blocks, page,
    h_kv, d)`` through ``block_table (b, max_blocks)``."""
    xp = xp_namespace(cache, block_table)
    b, m = block_table.shape
    flat = xp.take(cache, xp.reshape(block_table, (-1,)), axis=0)
    dense = xp.reshape(flat, (b, m * cache.shape[1], *cache.shape[2:]))
    return xp.permute_dims(dense, (0, 2, 1, 3))


def paged_inputs(q, k_cache, v_cache, block_table, cache_seqlens):
    """Validated ``(k, v, key_mask, shift)``: the gathered caches, the real slots, and the
    per-sequence alignment ``cache_seqlens[b] - n`` as a ``(b, 1, n)`` array."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        check_array(name, x)
    xp = xp_namespace(q, k_cache, v_cache, block_table, cache_seqlens,
                      names=("q", "k_cache", "v_cache", "block_table", "cache_seqlens"))
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache),
                    ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        check_same_array_kind(xp, "q", q, name, x)
    if q.ndim != 4:
        raise ValueError(f"q must have shape (b, h, n, d); got shape {tuple(q.shape)}")
    if k_cache.ndim != 4 or v_cache.ndim != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError("k_cache and v_cache must have shapes (num_blocks, page, h_kv, d) "
                         f"and (num_blocks, page, h_kv, dv); got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for name, x, ndim in (("block_table", block_table, 2), ("cache_seqlens", cache_seqlens, 1)):
        if not xp.isdtype(x.dtype, "integral"):
            raise TypeError(f"{name} must have an integer dtype; got {x.dtype}")
        if x.ndim != ndim or x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must have {ndim} dimension(s) with b = {q.shape[0]} "
                             f"first; got shape {tuple(x.shape)}")
    k, v = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    slots = xp.arange(k.shape[-2], device=xp_device(k))
    key_mask = (slots[None, :] < cache_seqlens[:, None])[:, None, :]
    n = q.shape[-2]
    shift = xp.astype(cache_seqlens - n, xp.int64)[:, None, None] + xp.zeros(
        (1, 1, n), dtype=xp.int64)
    return k, v, key_mask, shift


@dataclass(frozen=True)
class PagedCall:
    """A validated :func:`paged_attention` call: the exact attention ``call`` on the gathered
    pages (query heads grouped over the cache's heads where they differ), the arrays it
    works on, and how to merge the heads back (``None``: not grouped)."""

    call: Call
    q: Any
    k: Any
    v: Any
    ungroup: Callable | None = None

    @property
    def p(self):
        return self.call.p

    @property
    def key_mask(self):
        return self.call.key_mask


def checked_paged(q, k_cache, v_cache, /, *, block_table=None, cache_seqlens=None,
                  **options) -> PagedCall:
    """Validate a :func:`paged_attention` call once: ``q`` and the caches here, the
    options by exact attention's check on the gathered pages."""
    for bad in ("key_mask", "cu_seqlens_q", "cu_seqlens_k"):
        if options.get(bad) is not None:
            raise TypeError(f"paged_attention takes no {bad}: the cache lengths mask the keys")
    k, v, key_mask, shift = paged_inputs(q, k_cache, v_cache, block_table, cache_seqlens)
    grouped = group_heads(q, k, v, {**options, "key_mask": key_mask})
    if grouped is None:
        return PagedCall(checked_call(q, k, v, key_mask=key_mask, shift=shift, **options),
                         q, k, v)
    qg, kg, vg, opts, ungroup = grouped
    shift = xp_namespace(q).expand_dims(shift, axis=1)
    return PagedCall(checked_call(qg, kg, vg, shift=shift, **opts), qg, kg, vg, ungroup)


def _finish(call: PagedCall, out):
    return out if call.ungroup is None else call.ungroup(out)


def _on_exact(fn):
    return None if fn is None else (lambda call, *rest: fn(call.call, *rest))


#: The pipeline of :func:`paged_attention`: exact attention's steps on the gathered pages.
PAGED_SPEC = replace(SPEC, name="paged_attention", check=checked_paged,
                     reference=_on_exact(SPEC.reference), engine=_on_exact(SPEC.engine),
                     work=_on_exact(SPEC.work), poison=_on_exact(SPEC.poison),
                     empty=_on_exact(SPEC.empty),
                     inputs=lambda call: (call.q, call.k, call.v), finish=_finish)


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, /, **options):
    r"""Exact attention of ``q`` over a paged KV cache.

    .. math:: O_b = \operatorname{softmax}(\ell(Q_b K_b^\top \cdot \mathrm{scale}) + M_b)\,
              V_b, \quad K_b = [\,\text{page } T_{b,0};\ \text{page } T_{b,1};\ \dots]

    Parameters
    ----------
    q : array, shape ``(b, h, n, d)``
        Queries (arrayattn's layout), the last ``n`` positions of each sequence.
    k_cache : array, shape ``(num_blocks, page, h_kv, d)``
        Key pages (FlashAttention's layout); ``h`` a multiple of ``h_kv`` (grouped heads).
    v_cache : array, shape ``(num_blocks, page, h_kv, dv)``
        Value pages.
    block_table : integer array, shape ``(b, max_blocks)``
        The pages of each sequence, in order.
    cache_seqlens : integer array, shape ``(b,)``
        The number of real tokens of each sequence (queries included).
    **options
        Any option of :func:`~arrayattn.softmax_attention` but ``key_mask`` and
        ``cu_seqlens``: ``scale``, ``causal`` and ``window`` (aligned at each sequence's
        end), ``softcap``, ``alibi_slopes``, ``mask``, ``bias``, ``query_mask``,
        ``score_mod``, ``mask_mod``, ``return_lse``, ``block_size`` ...

    Returns
    -------
    array, shape ``(b, h, n, dv)`` (and ``lse (b, h, n)`` with ``return_lse=True``)

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> rng = np.random.default_rng(0)
    >>> k_cache, v_cache = rng.standard_normal((2, 6, 4, 3, 8))   # 6 pages of 4 tokens
    >>> q = rng.standard_normal((2, 3, 1, 8))                      # one new token each
    >>> table, lens = np.array([[4, 1], [0, 5]]), np.array([7, 3])
    >>> out = arrayattn.paged_attention(q, k_cache, v_cache, table, lens, causal=True)
    >>> k = np.concatenate([k_cache[4], k_cache[1]])[:7].transpose(1, 0, 2)
    >>> v = np.concatenate([v_cache[4], v_cache[1]])[:7].transpose(1, 0, 2)
    >>> bool(np.allclose(out[0], arrayattn.softmax_attention(q[0], k, v)))
    True
    """
    return run(PAGED_SPEC, q, k_cache, v_cache, block_table=block_table,
               cache_seqlens=cache_seqlens, **options)
