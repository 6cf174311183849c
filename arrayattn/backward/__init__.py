"""The backward pass: :func:`vjp`, the vector-Jacobian product of every variant.

``arrayattn.vjp(variant, q, k, v, do, **options)`` returns the cotangent of every
differentiable array the call received, keyed by its keyword name.  Each variant's
backward is written as explicit equations beside its reference form
(``arrayattn/reference/*_vjp.py``); the adapters in this package validate the call the
way the forward does, run that backward in the working dtype and hand it back here,
where grouped-query heads are summed over each group and every gradient is cast to its
argument's dtype.  :data:`TABLE` maps each public function to its adapter.
"""
from __future__ import annotations

from ..core.heads import group_heads
from ..core.checks import broadcast_batch, check_array, check_same_array_kind
from ..core.xp import xp_namespace
from ..registry.variant import Variant
from ..registry import get_variant
from ..exact.softmax import softmax_attention
from ..gated.api import (delta_attention, gated_delta_attention, gla_attention, retention,
                         ssd_attention)
from ..kernel.linear import efficient_attention, feature_attention, linear_attention
from ..lowrank.linformer import linformer_attention
from ..lowrank.luna import luna_attention
from ..lowrank.nystrom import landmark_attention, nystrom_attention
from ..random_features.performer import performer_attention
from ..sparse.pooling import pooling_attention
from ..random_features.rfa import rfa_attention
from ..sparse import local_attention, sparse_attention
from ..random_features import performer as _performer_forward
# the backward adapters, one module per family (named _x: arrayattn.backward.x stays
# the backward module, not shadowed by the forward module of the same name)
from . import delta as _delta
from . import exact as _exact
from . import gated as _gated
from . import kernel as _kernel
from . import linformer as _linformer
from . import lsh as _lsh
from . import luna as _luna
from . import nystrom as _nystrom
from . import performer as _performer
from . import pooling as _pooling
from . import rfa as _rfa
from . import sparse as _sparse
from .lsh import lsh_attention_vjp
from .nystrom import pinv_vjp

__all__ = ["vjp", "has_backward", "TABLE", "pinv_vjp", "lsh_attention_vjp"]

#: Public function, or registry name (for a record whose uniform call adapts its inputs,
#: e.g. draws gates or builds a layout) -> its backward adapter
#: ``adapter(q, k, v, do, /, **options) -> dict`` taking the options of that function (or
#: of that uniform call), returning gradients shaped like their arguments.
TABLE = {
    softmax_attention: _exact.softmax_attention_vjp,                # softmax, _blockwise
    linear_attention: _kernel.linear_attention_vjp,                 # linear_elu, _relu ...
    feature_attention: _kernel.feature_attention_vjp,
    efficient_attention: _kernel.efficient_attention_vjp,           # efficient
    performer_attention: _performer.performer_attention_vjp,
    _performer_forward.uniform_call: _performer.uniform_call_vjp,  # performer_* records
    rfa_attention: _rfa.rfa_attention_vjp,                          # rfa
    delta_attention: _delta.delta_attention_vjp,
    gated_delta_attention: _delta.gated_delta_attention_vjp,
    "deltanet": _delta.deltanet_vjp,                                # beta drawn from seed
    "gated_deltanet": _delta.gated_deltanet_vjp,                    # beta, g drawn from seed
    retention: _gated.retention_vjp,                                # retention
    gla_attention: _gated.gla_attention_vjp,                        # g passed as g=
    ssd_attention: _gated.ssd_attention_vjp,                        # a passed as a=
    "gla": _gated.gla_call_vjp,                                     # g drawn from seed
    "ssd": _gated.ssd_call_vjp,                                     # a drawn from seed
    nystrom_attention: _nystrom.nystrom_attention_vjp,              # nystrom_svd, _iterative
    landmark_attention: _nystrom.landmark_attention_vjp,            # landmark
    linformer_attention: _linformer.linformer_attention_vjp,
    "linformer": _linformer.linformer_call_vjp,                     # host e/f to q's library
    luna_attention: _luna.luna_attention_vjp,                       # p passed as p=
    "luna": _luna.luna_call_vjp,                                    # p (and W_K) from seed
    sparse_attention: _sparse.sparse_attention_vjp,
    local_attention: _sparse.local_attention_vjp,                   # local
    **_sparse.PATTERN_VJPS,                          # longformer, bigbird, strided, fixed
    pooling_attention: _pooling.pooling_attention_vjp,              # poolingformer
    "lsh": _lsh.lsh_uniform_vjp,         # q is the shared qk; lsh_attention_vjp: qk, v
}


def vjp(variant, q, k, v, do, /, **options) -> dict:
    r"""The vector-Jacobian product of a variant: the gradients of ``<do, f(q, k, v)>``.

    Parameters
    ----------
    variant : str, Variant or callable
        A registry name (its default options apply, as in the uniform call), a
        :class:`~arrayattn.Variant`, or a public function such as
        :func:`~arrayattn.softmax_attention`.
    q, k, v : arrays
        The forward's inputs.
    do : array, shape ``(..., n, dv)``
        The cotangent of the output (the output's shape, same namespace and device).
    **options
        The forward's options.  Array options that are differentiable (``bias``, gates,
        ``beta``, ``initial_state`` ...) get a cotangent too.

    Returns
    -------
    dict
        ``{"q": dq, "k": dk, "v": dv, ...}``: one entry per differentiable array argument,
        each with that argument's shape, dtype, namespace and device.  Random matrices
        drawn from ``seed`` and boolean masks get none.  Grouped-query heads: ``dk``,
        ``dv`` are summed over each group.

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, do = (rng.standard_normal((2, 6, 4)) for _ in range(4))
    >>> g = arrayattn.vjp("softmax", q, k, v, do, causal=True)
    >>> sorted(g), g["q"].shape
    (['k', 'q', 'v'], (2, 6, 4))
    >>> bool(np.allclose(g["q"][:, 0], 0.0))   # the first query sees one key only
    True
    """
    rec, fn, adapter = _resolve(variant)
    if adapter is None:
        name = rec.name if rec is not None else getattr(fn, "__name__", repr(fn))
        raise NotImplementedError(f"no backward is registered for {name}")
    if rec is not None:
        options = {**rec.defaults, **options}
        if rec.prepare is not None:
            options = rec.prepare(q, options)
    _check_cotangent(q, k, v, do, *(adapter.output(options) if hasattr(adapter, "output")
                                    else ({}, None)))
    grouped = group_heads(q, k, v, options) if hasattr(q, "shape") else None
    if grouped is None:
        grads = adapter(q, k, v, do, **options)
    else:
        qg, kg, vg, opts, _ = grouped
        xp = xp_namespace(q, do)
        dog = xp.reshape(do, (*qg.shape[:-2], *do.shape[-2:]))
        grads = adapter(qg, kg, vg, dog, **opts)
    names = getattr(adapter, "argument_names", ("q", "k", "v"))   # e.g. phi_q, phi_k, v
    return _like_arguments(grads, {**dict(zip(names, (q, k, v))), **options})


def _resolve(variant):
    """``(record or None, function, adapter or None)`` of a name, record or function."""
    rec = variant if isinstance(variant, Variant) else (
        get_variant(variant) if isinstance(variant, str) else None)
    fn = (rec.call or rec.fn) if rec is not None else variant
    adapter = TABLE.get(rec.name) if rec is not None else None
    return rec, fn, adapter if adapter is not None else TABLE.get(fn)


def has_backward(variant) -> bool:
    """Whether :func:`vjp` knows the backward of ``variant`` (name, record or function)."""
    return _resolve(variant)[2] is not None


def _check_cotangent(q, k, v, do, extra, dv):
    """``do`` must have the output's shape; ``extra``: other arrays (by name) whose batch
    axes broadcast into the output, ``dv``: its last axis when it is not ``v``'s."""
    check_array("do", do)
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, min_ndim=2)
    xp = xp_namespace(q, do, names=("q", "do"))
    check_same_array_kind(xp, "q", q, "do", do)
    if not xp.isdtype(do.dtype, "real floating"):
        raise TypeError(f"do must have a real floating dtype; got {do.dtype}")
    lead = {"q": tuple(q.shape[:-2]), "k": tuple(k.shape[:-2]), "v": tuple(v.shape[:-2]),
            **{name: tuple(x.shape[:-2]) for name, x in extra.items()
               if getattr(x, "ndim", 0) >= 2}}
    hq, hk = (q.shape[-3], k.shape[-3]) if q.ndim >= 3 and k.ndim >= 3 else (0, 0)
    if hk and hq != hk and hk != 1 and hq % hk == 0:       # grouped-query heads
        lead["k"] = lead["v"] = (*lead["k"][:-1], 1)
        lead.update({name: (*x[:-1], 1) for name, x in lead.items()     # per key head
                     if name not in ("q", "k", "v") and x and x[-1] == hk})
    batch = broadcast_batch(list(lead.items()))
    expected = (*batch, q.shape[-2], v.shape[-1] if dv is None else dv)
    if tuple(do.shape) != expected:
        raise ValueError(f"do must have the output's shape {expected}; got shape "
                         f"{tuple(do.shape)}")


def _like_arguments(grads: dict, arguments: dict) -> dict:
    """Each gradient reshaped (grouped heads) and cast to its argument's shape and dtype."""
    out = {}
    for name, g in grads.items():
        arg = arguments[name]
        if not hasattr(g, "shape"):      # a structured cotangent (LinearAttentionState)
            out[name] = g
            continue
        xp = xp_namespace(arg, g)
        if tuple(g.shape) != tuple(arg.shape):
            g = xp.reshape(g, tuple(arg.shape))
        out[name] = xp.astype(g, arg.dtype, copy=False)
    return out
