"""The backward adapter of :func:`arrayattn.softmax_attention` (dense and blockwise,
every option)."""
from __future__ import annotations

from dataclasses import replace

from .. import reference
from ..core.engine import entry
from .._numpy import exact_vjp as engine
from ..exact.softmax import checked_call, engine_takes
from ..core.pipeline import Spec, Working, implementation, working
from ..reference.exact_vjp import sum_to_shape

__all__ = ["softmax_attention_vjp", "VJP_SPEC"]


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
    w = working(p, q, k, v, lg.key_mask, poison=True)
    call = replace(call, logits=replace(lg, poison=w.bad))
    wdo = xp.astype(do, p.work_dtype, copy=False)
    with entry(xp):
        grads = implementation(VJP_SPEC, call, w)(call, w, wdo)
    return {name: sum_to_shape(grads[name], x.shape) for name, x in args.items()}


def _reference(call, w: Working, do) -> dict:
    if call.block_size is not None:
        return reference.attention_blockwise_vjp(w.q, w.k, w.v, do, call.logits,
                                                 block_size=call.block_size,
                                                 dropout=call.dropout)
    return reference.attention_vjp(w.q, w.k, w.v, do, call.logits, dropout=call.dropout)


def _engine(call, w: Working, do) -> dict:
    lg = call.logits
    return engine.vjp(w.q, w.k, w.v, do, scale=lg.scale, causal=lg.right == 0,
                      key_mask=lg.key_mask, mask=lg.mask)


def _work(call, w: Working):
    """The engine's scores ``n s`` in float32 bytes, or ``None`` where it does not take
    the call (:func:`arrayattn.exact.softmax.engine_takes`)."""
    p = call.p
    return p.n * p.s * 4 if engine_takes(call, w) else None


#: The backward of :func:`~arrayattn.softmax_attention`, as the pipeline chooses it
#: (:func:`arrayattn.core.pipeline.implementation`); each form takes the cotangent ``do``.
VJP_SPEC = Spec(name="softmax_attention_vjp", check=checked_call, reference=_reference,
                engine=_engine, work=_work)
