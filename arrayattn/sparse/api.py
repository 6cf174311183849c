"""The public sparse API: :func:`sparse_attention`, :func:`local_attention` and the
registry records of the patterns."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from .. import reference
from ..core.checks import (Problem, check_band, check_bias, check_flag, check_key_mask,
                           check_qkv, check_scale)
from .checks import check_layout
from ..core.pipeline import Spec, Working, run
from .executor import block_sparse_attention, plan_work
from .layout import BlockLayout
from .patterns import local_layout

__all__ = ["sparse_attention", "local_attention", "SparseCall", "checked_sparse",
           "checked_local", "checked_pattern", "dense_allowed", "SPEC", "LOCAL_SPEC",
           "pattern_call"]


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
    of at most ``arrayattn.core.engine.DENSE_REFERENCE_MAX`` scores runs the dense definition
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
    return run(SPEC, q, k, v, layout=layout, scale=scale, causal=causal, key_mask=key_mask,
               bias=bias)


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
    return run(LOCAL_SPEC, q, k, v, window=window, causal=causal, block_size=block_size,
               scale=scale, key_mask=key_mask, bias=bias)


@dataclass(frozen=True)
class SparseCall:
    """A validated sparse call: the problem, the layout (``None`` where the call builds
    its layout and the problem is empty), the scale, whether it is causal, the key mask
    and the bias (the caller's, or ``None``)."""

    p: Problem
    layout: BlockLayout | None
    scale: float
    causal: bool
    key_mask: Any
    bias: Any


def _checked_rest(p: Problem, q, layout, *, scale, causal: bool, key_mask, bias):
    check_key_mask(p, key_mask, q)
    return SparseCall(p, layout, check_scale(scale, p.d), causal, key_mask,
                      check_bias(p, bias, q))


def checked_sparse(q, k, v, *, layout, scale=None, causal=False, key_mask=None,
                   bias=None) -> SparseCall:
    """Validate a :func:`sparse_attention` call once (shared with its backward)."""
    p = check_qkv(q, k, v)
    layout = check_layout(p, layout, q, k)
    return _checked_rest(p, q, layout, scale=scale, causal=check_flag("causal", causal),
                         key_mask=key_mask, bias=bias)


def checked_local(q, k, v, *, window, causal=False, block_size=64, scale=None,
                  key_mask=None, bias=None) -> SparseCall:
    """Validate a :func:`local_attention` call once and build its band layout (none
    when there is no query, key or head)."""
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    check_band("window", window)
    layout = None if p.empty else local_layout(p.n, s=p.s, window=window,
                                               block_size=block_size, causal=causal)
    return _checked_rest(p, q, layout, scale=scale, causal=causal, key_mask=key_mask,
                         bias=bias)


def checked_pattern(builder, fixed: dict, q, k, v, *, scale=None, causal=False,
                    key_mask=None, bias=None, **options) -> SparseCall:
    """Validate a registry pattern call once: its layout is ``builder(n, s=s, **fixed,
    **options)`` (none for an empty problem: no layout of no tokens)."""
    p = check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    layout = None if p.n == 0 or p.s == 0 else builder(p.n, s=p.s, **{**fixed, **options})
    return _checked_rest(p, q, layout, scale=scale, causal=causal, key_mask=key_mask,
                         bias=bias)


def dense_allowed(call: SparseCall):
    """The ``(..., n, s)`` mask of the dense definition (the layout's dense mask, causal
    and key mask) of a checked call: what :func:`sparse_attention` and its backward use
    where they run the dense reference form."""
    p = call.p
    return reference.allowed_mask(p.xp, p.n, p.s, device=p.device, causal=call.causal,
                                  key_mask=call.key_mask,
                                  mask=call.layout.dense_mask(p.xp, device=p.device))


def _dense(call: SparseCall, w: Working):
    return reference.sparse_attention(w.q, w.k, w.v, dense_allowed(call), scale=call.scale,
                                      bias=call.bias)


def _gathered(call: SparseCall, w: Working, *, threads: bool):
    """The block-sparse executor on the layout's gather plan: scans over chunks of query
    blocks (the reference form), or its chunks on the NumPy engine's threads."""
    return block_sparse_attention(call.p, w.q, w.k, w.v, call.layout, scale=call.scale,
                                  causal=call.causal, key_mask=call.key_mask, bias=call.bias,
                                  threads=threads)


def _work(call: SparseCall, w: Working) -> int:
    """The bytes of the scores the gather plan computes (the executor's estimate)."""
    return plan_work(call.p, call.layout)


def _scores(call: SparseCall) -> int:
    return math.prod(call.p.batch) * call.p.n * call.p.s


#: The pipeline of :func:`sparse_attention`.
SPEC = Spec(name="sparse_attention", check=checked_sparse,
            reference=partial(_gathered, threads=False),
            engine=partial(_gathered, threads=True), work=_work, dense=_dense,
            scores=_scores,
            none_means={"scale": "1/sqrt(d)", "key_mask": "every key is real",
                        "bias": "no bias"})
#: The pipeline of :func:`local_attention`.
LOCAL_SPEC = replace(SPEC, name="local_attention", check=checked_local)


# ---------------------------------------------------------------------------------
# Registry: uniform-call adapters build the layout from the inputs' n.
# ---------------------------------------------------------------------------------

def pattern_call(builder, **fixed):
    spec = replace(SPEC, name=f"{builder.__name__}_attention",
                   check=partial(checked_pattern, builder, fixed))

    def call(q, k, v, /, *, scale=None, causal=False, key_mask=None, bias=None, **options):
        return run(spec, q, k, v, scale=scale, causal=causal, key_mask=key_mask, bias=bias,
                   **options)
    call.__name__ = f"{builder.__name__}_attention"
    return call
