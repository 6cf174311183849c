"""The backward adapter of :func:`arrayattn.softmax_attention` (dense and blockwise,
every option)."""
from __future__ import annotations

from dataclasses import replace

from .. import reference
from .._engine import entry, numpy_engine
from .._numpy import exact_vjp as engine
from ..exact import checked_call, working_qkv
from ..reference.exact_vjp import sum_to_shape

__all__ = ["softmax_attention_vjp"]


def softmax_attention_vjp(q, k, v, do, /, *, return_lse=False, **options):
    """``{"q", "k", "v"[, "bias"]}`` of :func:`~arrayattn.softmax_attention` (of its
    output; ``return_lse`` is accepted and ignored): the dense backward, or
    FlashAttention-2's blockwise backward when ``block_size`` is given; on NumPy the
    engine's row-block backward (:mod:`arrayattn._numpy.exact_vjp`) for large problems
    without the kernel options."""
    call = checked_call(q, k, v, **options)
    p, lg = call.p, call.logits
    xp = p.xp
    args = {"q": q, "k": k, "v": v}
    if options.get("bias") is not None:
        args["bias"] = options["bias"]
    if p.s == 0:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in args.items()}
    wq, wk, wv, bad = working_qkv(p, q, k, v, lg.key_mask)
    lg = replace(lg, poison=bad)
    wdo = xp.astype(do, p.work_dtype, copy=False)
    with entry(xp):
        if (lg.plain and lg.bias is None and call.dropout is None
                and numpy_engine(xp, p.n * p.s * 4) and not xp.any(bad)):
            grads = engine.vjp(wq, wk, wv, wdo, scale=lg.scale, causal=lg.right == 0,
                               key_mask=lg.key_mask, mask=lg.mask)
        elif call.block_size is not None:
            grads = reference.attention_blockwise_vjp(wq, wk, wv, wdo, lg,
                                                      block_size=call.block_size,
                                                      dropout=call.dropout)
        else:
            grads = reference.attention_vjp(wq, wk, wv, wdo, lg, dropout=call.dropout)
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}
