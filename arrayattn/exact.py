"""Exact softmax attention, dense and blockwise (FlashAttention's online softmax).

.. math::

    \\operatorname{Attn}(Q, K, V) = \\operatorname{softmax}(Q K^\\top \\cdot \\text{scale}
    + \\text{masks})\\, V

Vaswani et al. 2017, "Attention Is All You Need"; the blockwise recurrence is that of
Dao et al. 2022 / Dao 2023 ("FlashAttention", "FlashAttention-2"), itself the online
softmax of Milakov & Gimelshein 2018.
"""
from __future__ import annotations

from . import reference
from ._devices import default_block_size
from ._engine import entry, numpy_engine
from ._heads import grouped_query_heads
from ._numpy import exact as engine
from ._validate import (Problem, check_bias, check_flag, check_key_mask, check_mask,
                        check_positive_int, check_qkv, check_scale)
from .reference.masks import zero_masked_keys
from .registry import Variant, register

__all__ = ["softmax_attention"]


@grouped_query_heads
def softmax_attention(q, k, v, /, *, scale=None, causal=False, key_mask=None, mask=None,
                      bias=None, block_size=None):
    r"""Exact scaled dot-product attention.

    .. math:: O = \operatorname{softmax}\!\left(Q K^\top \cdot \mathrm{scale} + B + M\right) V

    where :math:`B` is the optional additive ``bias`` and :math:`M_{ij} = -\infty` for
    every key ``j`` that query ``i`` may not see.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
        Queries. Leading dimensions (batch, heads) broadcast against ``k`` and ``v``.
    k : array, shape ``(..., s, d)``
        Keys.
    v : array, shape ``(..., s, dv)``
        Values.
    scale : float, optional
        Multiplies the logits; ``None`` means ``1/sqrt(d)``.
    causal : bool
        End-aligned causal masking (as FlashAttention-2): query ``i`` sees key
        ``j <= i + (s - n)``.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key; masked keys get weight 0.
    mask : boolean array, shape ``(..., n, s)``, optional
        ``True`` where query ``i`` may attend to key ``j``. Combined (AND) with
        ``causal`` and ``key_mask``.
    bias : real floating array, shape ``(..., n, s)``, optional
        Added to the scaled logits (ALiBi slopes, T5/relative-position biases, a float
        mask as SDPA's float ``attn_mask``); broadcasts like ``mask``; ``-inf`` entries
        act as masked (a row with no finite entry returns zeros).  Cast to the working
        dtype.
    block_size : int or "auto", optional
        When given, run the blockwise online-softmax algorithm (FlashAttention) over
        query and key blocks of this size: memory ``O((n + s) d + block^2)`` per batch
        element instead of ``O(n s)``, same result to rounding.  ``"auto"`` chooses per
        device: 512 on a CPU (a cache-sized tile), 4096 on a GPU (fewer launches; the
        registry record ``softmax_blockwise`` uses it).

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q``. A query that may attend to no key
        returns zeros. float16/bfloat16 inputs are computed in float32.

    Raises
    ------
    TypeError
        Non-floating or mismatched dtypes, arrays of different libraries, non-boolean
        masks.
    ValueError
        Shapes that do not fit (the message names the argument and both shapes),
        ``block_size <= 0``.

    Notes
    -----
    The row maximum of the logits is subtracted before ``exp`` (it cancels in the
    ratio), so logits up to ``|q.k.scale| ~ 1e4`` are safe in float32.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    >>> out = softmax_attention(q, k, v, causal=True)
    >>> out.shape
    (2, 5, 4)
    >>> bool(np.allclose(out[:, 0], v[:, 0]))  # the first query sees only the first key
    True
    >>> bool(np.allclose(softmax_attention(q, k, v, block_size=2), softmax_attention(q, k, v)))
    True
    """
    p, opts, block_size = checked_call(q, k, v, scale=scale, causal=causal,
                                       key_mask=key_mask, mask=mask, bias=bias,
                                       block_size=block_size)
    if p.s == 0:
        return p.zeros()
    xp = p.xp
    wq, wk, wv = working_qkv(p, q, k, v, key_mask)
    bias = opts.pop("bias")
    blocks = block_size is not None and (block_size < p.n or block_size < p.s)
    tile = p.n * (min(block_size, p.s) if blocks else p.s)
    with entry(xp):
        if bias is None and numpy_engine(xp, tile * _batch_size(p) * 4):
            out = (engine.blockwise(wq, wk, wv, block_size=block_size, out_shape=p.out_shape,
                                    **opts) if blocks else engine.dense(wq, wk, wv, **opts))
        elif blocks:
            out = reference.softmax_attention_blockwise(wq, wk, wv, block_size=block_size,
                                                        bias=bias, **opts)
        else:
            out = reference.softmax_attention(wq, wk, wv, bias=bias, **opts)
    return xp.astype(out, p.dtype, copy=False)


def checked_call(q, k, v, *, scale, causal, key_mask, mask, bias, block_size):
    """Validate a :func:`softmax_attention` call: ``(problem, options, block_size)`` with
    the options the reference forms take (``bias`` cast to the working dtype) and
    ``block_size`` resolved (``None`` for the dense form)."""
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    check_key_mask(p, key_mask, q)
    check_mask(p, mask, q)
    bias = check_bias(p, bias, q)
    if isinstance(block_size, str) and block_size == "auto":
        block_size = default_block_size(q)
    block_size = check_positive_int("block_size", block_size, allow_none=True)
    scale = check_scale(scale, p.d)
    opts = dict(scale=scale, causal=causal, key_mask=key_mask, mask=mask, bias=bias)
    return p, opts, block_size


def working_qkv(p: Problem, q, k, v, key_mask):
    """``q, k, v`` in the working dtype, the rows of masked keys zeroed."""
    xp = p.xp
    wk, wv = zero_masked_keys(key_mask, xp.astype(k, p.work_dtype, copy=False),
                              xp.astype(v, p.work_dtype, copy=False))
    return xp.astype(q, p.work_dtype, copy=False), wk, wv


def _batch_size(p: Problem) -> int:
    size = 1
    for b in p.batch:
        size *= b
    return size


register(Variant(
    name="softmax",
    fn=softmax_attention,
    family="exact",
    exact=True,
    causal=True,
    key_mask=True,
    mask=True,
    normalized=True,
    complexity="O(n s d) time, O(n s) memory",
    citation="Vaswani et al. 2017, Attention Is All You Need",
))

register(Variant(
    name="softmax_blockwise",
    fn=softmax_attention,
    family="exact",
    exact=True,
    causal=True,
    key_mask=True,
    mask=True,
    normalized=True,
    defaults={"block_size": "auto"},
    parameter="block_size",
    complexity="O(n s d) time, O((n + s) d + block^2) memory",
    citation="Dao et al. 2022, FlashAttention; Dao 2023, FlashAttention-2",
))
