"""The backward adapter of :func:`arrayattn.softmax_attention` (dense and blockwise)."""
from __future__ import annotations

from .. import reference
from .._engine import entry, numpy_engine
from .._numpy import exact_vjp as engine
from ..exact import checked_call, working_qkv
from ..reference.exact_vjp import sum_to_shape

__all__ = ["softmax_attention_vjp"]


def softmax_attention_vjp(q, k, v, do, /, *, scale=None, causal=False, key_mask=None,
                          mask=None, bias=None, block_size=None):
    """``{"q", "k", "v"[, "bias"]}`` of :func:`~arrayattn.softmax_attention`: the dense
    backward, or FlashAttention-2's blockwise backward when ``block_size`` is given; on
    NumPy the engine's row-block backward (:mod:`arrayattn._numpy.exact_vjp`) when the
    problem is large enough to pay."""
    p, opts, block_size = checked_call(q, k, v, scale=scale, causal=causal,
                                       key_mask=key_mask, mask=mask, bias=bias,
                                       block_size=block_size)
    xp = p.xp
    if p.s == 0:
        grads = {"q": xp.zeros(q.shape, dtype=q.dtype, device=p.device),
                 "k": xp.zeros(k.shape, dtype=k.dtype, device=p.device),
                 "v": xp.zeros(v.shape, dtype=v.dtype, device=p.device)}
        if bias is not None:
            grads["bias"] = xp.zeros(bias.shape, dtype=bias.dtype, device=p.device)
        return grads
    wq, wk, wv = working_qkv(p, q, k, v, key_mask)
    wdo = xp.astype(do, p.work_dtype, copy=False)
    with entry(xp):
        if opts["bias"] is None and numpy_engine(xp, p.n * p.s * 4):
            grads = engine.vjp(wq, wk, wv, wdo, scale=opts["scale"], causal=opts["causal"],
                               key_mask=key_mask, mask=mask)
        elif block_size is not None and (block_size < p.n or block_size < p.s):
            grads = reference.softmax_attention_blockwise_vjp(wq, wk, wv, wdo,
                                                              block_size=block_size, **opts)
        else:
            grads = reference.softmax_attention_vjp(wq, wk, wv, wdo, **opts)
    args = {"q": q, "k": k, "v": v, "bias": bias}
    return {name: sum_to_shape(g, args[name].shape) for name, g in grads.items()}
