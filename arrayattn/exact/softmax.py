"""Exact softmax attention, dense and blockwise (FlashAttention's online softmax).

.. math::

    \\operatorname{Attn}(Q, K, V) = \\operatorname{softmax}(Q K^\\top \\cdot \\text{scale}
    + \\text{masks})\\, V

Vaswani et al. 2017, "Attention Is All You Need"; the blockwise recurrence is that of
Dao et al. 2022 / Dao 2023 ("FlashAttention", "FlashAttention-2"), itself the online
softmax of Milakov & Gimelshein 2018.
"""
from __future__ import annotations

import math
from dataclasses import replace

from .. import reference
from ..core.heads import grouped_query_heads
from .._numpy import exact as engine
# the call record and its checks (kept importable from here: the backward and paged use them)
from .checks import Call, checked_call
from ..core.pipeline import Spec, Working, run

__all__ = ["softmax_attention", "Call", "checked_call", "SPEC", "engine_takes"]


@grouped_query_heads
def softmax_attention(q, k, v, /, *, scale=None, causal=False, key_mask=None, mask=None,
                      bias=None, block_size=None, window=None, softcap=None,
                      alibi_slopes=None, query_mask=None, return_lse=False,
                      dropout_mask=None, dropout_p=0.0, cu_seqlens_q=None,
                      cu_seqlens_k=None, score_mod=None, mask_mod=None):
    r"""Exact scaled dot-product attention, with every option a kernel author tests.

    .. math:: O = \operatorname{softmax}\!\left(\ell(Q K^\top \cdot \mathrm{scale})
              + B + M\right) V

    where :math:`\ell` is the softcap and ``score_mod`` (in that order), :math:`B` the
    additive ``bias`` and ALiBi, and :math:`M_{ij} = -\infty` for every key ``j`` that
    query ``i`` may not see (window, causal, masks, packed segments, ``mask_mod``): the
    pipeline of :mod:`arrayattn.reference.logits`.

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
        ``j <= i + (s - n)``; the same as ``window=(None, 0)``.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key; masked keys get weight 0.
    mask : boolean array, shape ``(..., n, s)``, optional
        ``True`` where query ``i`` may attend to key ``j``. Combined (AND) with
        ``causal`` and ``key_mask``.
    bias : real floating array, shape ``(..., n, s)``, optional
        Added to the scaled logits (ALiBi, T5/relative-position biases, a float
        mask as SDPA's float ``attn_mask``); broadcasts like ``mask``; ``-inf`` entries
        act as masked (a row with no finite entry returns zeros).  Cast to the working
        dtype.
    block_size : int or "auto", optional
        When given, run the blockwise online-softmax algorithm (FlashAttention) over
        query and key blocks of this size: memory ``O((n + s) d + block^2)`` per batch
        element instead of ``O(n s)``, same result to rounding.  ``"auto"`` chooses per
        device: 512 on a CPU (a cache-sized tile), 4096 on a GPU (fewer launches; the
        registry record ``softmax_blockwise`` uses it).
    window : (int or None, int or None), optional
        FlashAttention's ``window_size``: query ``i`` sees keys
        ``i + s - n - left <= j <= i + s - n + right``; ``None`` or ``-1`` is unbounded on
        that side.  With ``causal=True``, ``right`` is capped at 0.
    softcap : float, optional
        Logits become ``softcap * tanh(logits / softcap)`` after scaling, before
        ``score_mod``, bias and masks (Gemma 2, FlashAttention); ``0`` or ``None``: off.
    alibi_slopes : array, shape ``(h,)`` or ``(b, h)``, optional
        Adds ``-slope_h * |i + s - n - j|`` to the logits (FlashAttention's convention;
        per packed segment with ``cu_seqlens``).  No cotangent in :func:`~arrayattn.vjp`.
    query_mask : boolean array, shape ``(..., n)``, optional
        ``False`` marks a padded query: its row returns zeros (and zero gradients).
    return_lse : bool
        Also return the natural-log log-sum-exp of each row's visible final logits,
        shape ``(..., n)``, in the working dtype; ``-inf`` (``log 0``) for a row that
        sees no key or is padded (FlashAttention stores ``+inf`` there).
    dropout_mask : boolean array, shape ``(..., n, s)``, optional
        The keep-mask of dropout, applied after the softmax: ``O = (P * keep) V / (1 - p)``.
    dropout_p : float
        The dropout rate ``p`` in ``[0, 1)`` the keep-mask was drawn with.
    cu_seqlens_q, cu_seqlens_k : integer arrays, shape ``(B + 1,)``, optional
        Packed variable-length sequences (``flash_attn_varlen_func``): ``q (..., total_q,
        d)``, ``k, v (..., total_k, .)``; segment ``b`` is queries ``cu_q[b]:cu_q[b+1]``
        and keys ``cu_k[b]:cu_k[b+1]``, attending only inside itself, causal, window and
        ALiBi end-aligned per segment.  Equal to running the segments one by one.
    score_mod : callable, optional
        FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, called on the
        (soft-capped) logits with broadcast index arrays of the caller's namespace
        (``b`` the first batch axis, ``h`` the query head, axis -3).
    mask_mod : callable, optional
        FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool``; ``False`` hides a key.

    Returns
    -------
    array, shape ``(..., n, dv)``, or ``(out, lse)`` with ``return_lse=True``
        Same namespace, device and dtype as ``q``. A query that may attend to no key
        returns zeros. float16/bfloat16 inputs are computed in float32.

    Raises
    ------
    TypeError
        Non-floating or mismatched dtypes, arrays of different libraries, non-boolean
        masks, non-integer ``cu_seqlens``.
    ValueError
        Shapes that do not fit (the message names the argument and both shapes),
        ``block_size <= 0``, a malformed window or ``cu_seqlens``.

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
    >>> out, lse = softmax_attention(q, k, v, window=(1, 0), softcap=5.0, return_lse=True)
    >>> lse.shape
    (2, 5)
    """
    return run(SPEC, q, k, v, scale=scale, causal=causal, key_mask=key_mask, mask=mask,
               bias=bias, block_size=block_size, window=window, softcap=softcap,
               alibi_slopes=alibi_slopes, query_mask=query_mask, return_lse=return_lse,
               dropout_mask=dropout_mask, dropout_p=dropout_p, cu_seqlens_q=cu_seqlens_q,
               cu_seqlens_k=cu_seqlens_k, score_mod=score_mod, mask_mod=mask_mod)


def _reference(call: Call, w: Working):
    lg = replace(call.logits, poison=w.bad)
    if call.block_size:
        out, lse = reference.attention_blockwise(w.q, w.k, w.v, lg, block_size=call.block_size,
                                                 dropout=call.dropout)
    else:
        out, lse = reference.attention(w.q, w.k, w.v, lg, dropout=call.dropout)
    return (out, lse) if call.return_lse else out


def _engine(call: Call, w: Working):
    lg, blocks = call.logits, call.block_size
    opts = dict(scale=lg.scale, causal=lg.right == 0, key_mask=lg.key_mask, mask=lg.mask)
    if blocks:
        return engine.blockwise(w.q, w.k, w.v, block_size=blocks, out_shape=call.p.out_shape,
                                **opts)
    return engine.dense(w.q, w.k, w.v, **opts)


def engine_takes(call: Call, w: Working) -> bool:
    """Whether the NumPy engine takes a checked call (forward or backward): logits with
    scale, causal and masks only -- no bias, dropout or ``lse`` -- and no key taken out for
    holding a non-finite value (the engine has no NaN rows; asked on NumPy only, so
    ``any`` syncs no device)."""
    lg = call.logits
    return (lg.plain and lg.bias is None and call.dropout is None and not call.return_lse
            and (w.bad is None or not call.p.xp.any(w.bad)))


def _work(call: Call, w: Working):
    """The engine's largest temporary (a query block's scores), or ``None`` where the
    engine does not take the call (:func:`engine_takes`)."""
    if not engine_takes(call, w):
        return None
    p = call.p
    tile = p.n * (min(call.block_size, p.s) if call.block_size else p.s)
    return tile * math.prod(p.batch) * 4


def _empty(call: Call):
    p = call.p
    if not call.return_lse:
        return p.zeros()
    lse = p.xp.full((*p.batch, p.n), -p.xp.inf, dtype=p.work_dtype, device=p.device)
    return p.zeros(), lse


#: The pipeline of :func:`softmax_attention` (and of :func:`~arrayattn.paged_attention`).
SPEC = Spec(name="softmax_attention", check=checked_call, reference=_reference,
            engine=_engine, work=_work, poison=lambda call: True, empty=_empty,
            none_means={"scale": "1/sqrt(d)", "key_mask": "every key is real",
                        "mask": "no mask", "bias": "no bias",
                        "block_size": "dense (one block)", "window": "no window",
                        "softcap": "no soft cap", "alibi_slopes": "no ALiBi",
                        "query_mask": "every query is real", "dropout_mask": "no dropout",
                        "cu_seqlens_q": "one sequence", "cu_seqlens_k": "one sequence",
                        "score_mod": "identity", "mask_mod": "every key visible"})
