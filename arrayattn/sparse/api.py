"""The public sparse API: :func:`sparse_attention`, :func:`local_attention` and the
registry records of the patterns."""
from __future__ import annotations

import math

from .. import reference
from .._engine import dense_reference, entry
from .._validate import (check_bias, check_flag, check_key_mask, check_qkv, check_scale)
from ..reference.masks import zero_masked_keys
from ..registry import Variant, register
from .executor import block_sparse_attention, use_threads
from .layout import BlockLayout
from .patterns import (bigbird_layout, fixed_layout, local_layout, longformer_layout,
                       strided_layout)

__all__ = ["sparse_attention", "local_attention", "checked_sparse", "dense_allowed"]


def checked_sparse(q, k, v, *, layout, scale, causal, key_mask, bias):
    """:func:`sparse_attention`'s checks (shared with its backward): ``(p, (wq, wk, wv),
    scale, causal, bias)``, inputs in the working dtype, masked keys' rows zeroed."""
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
    xp, wd = p.xp, p.work_dtype
    # Padded keys may hold anything (NaN, inf): their rows are replaced, not weighted by 0.
    wk, wv = zero_masked_keys(key_mask, xp.astype(k, wd, copy=False),
                              xp.astype(v, wd, copy=False))
    return (p, (xp.astype(q, wd, copy=False), wk, wv), check_scale(scale, p.d), causal,
            check_bias(p, bias, q))


def dense_allowed(p, layout: BlockLayout, causal: bool, key_mask):
    """The ``(..., n, s)`` mask of the dense definition (the layout's dense mask, causal
    and key mask) of a call checked as ``p``: what :func:`sparse_attention` and its
    backward use where they run the dense reference form."""
    return reference.allowed_mask(p.xp, p.n, p.s, device=p.device, causal=causal,
                                  key_mask=key_mask,
                                  mask=layout.dense_mask(p.xp, device=p.device))


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
    p, (wq, wk, wv), scale, causal, bias = checked_sparse(
        q, k, v, layout=layout, scale=scale, causal=causal, key_mask=key_mask, bias=bias)
    xp = p.xp
    with entry(xp):
        if dense_reference(math.prod(p.batch) * p.n * p.s):
            allowed = dense_allowed(p, layout, causal, key_mask)
            out = reference.sparse_attention(wq, wk, wv, allowed, scale=scale, bias=bias)
        else:
            out = block_sparse_attention(p, wq * scale, wk, wv, layout, causal=causal,
                                         key_mask=key_mask, bias=bias,
                                         threads=use_threads(p, layout))
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
        p = check_qkv(q, k, v)
        causal = check_flag("causal", causal)
        if p.n == 0 or p.s == 0:     # no layout of no tokens: zeros (empty-row convention)
            return p.zeros()
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
