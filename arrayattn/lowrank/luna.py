"""Luna: linear unified nested attention (pack, then unpack).

Ma, Kong, Wang, Zhou, May, Ma & Zettlemoyer 2021, "Luna: Linear Unified Nested
Attention" (NeurIPS 2021), section 3.1.  An extra sequence ``P`` of ``l`` tokens first
attends to the keys and values (pack), and the queries then attend to the packed
sequence (unpack):

.. math::

    P' = \\operatorname{Attn}(P, K, V), \\qquad O = \\operatorname{Attn}(Q, P' W_K, P' W_V),

both exact softmax attention over ``l`` keys or from ``l`` queries: ``O((n + s) l d)``.
"""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..core.checks import check_qkv
from .checks import (LUNA_UNIFORM_L, LunaCall, checked_luna, checked_luna_uniform,
                     luna_uniform_draw)
from ..core.pipeline import Spec, Working, run, working

__all__ = ["luna_attention", "checked_luna", "uniform_inputs", "SPEC", "UNIFORM_SPEC",
           "uniform_call", "UNIFORM_PACKED"]


def luna_attention(q, k, v, p, /, *, scale=None, causal=False, key_mask=None,
                   unpack_key_proj=None, unpack_value_proj=None, return_packed=False):
    r"""Luna pack-and-unpack attention (Ma et al. 2021).

    .. math::

        P' = \operatorname{softmax}\!\left(P K^\top \cdot \mathrm{scale} + M\right) V,
        \qquad
        O = \operatorname{softmax}\!\left(Q (P' W_K)^\top \cdot \mathrm{scale}\right)
        P' W_V,

    with ``M`` the key mask.  ``W_K`` and ``W_V`` default to the identity (the form
    ``Attn(Q, P', P')``).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
        Queries (already projected: ``X W_Q`` of the unpack attention).
    k : array, shape ``(..., s, d)``
        Keys (``C W_K`` of the pack attention).
    v : array, shape ``(..., s, dv)``
        Values (``C W_V`` of the pack attention).
    p : array, shape ``(..., l, d)``
        The extra sequence, already projected as the pack queries (``P W_Q``); ``l`` is
        usually small (the paper uses 16-256).  Leading dimensions broadcast.
    scale : float, optional
        Logit scale of both attentions; ``None`` means ``1/sqrt(d)``.
    causal : bool
        Must be False: raises ``ValueError`` (see Notes).
    key_mask : boolean array, shape ``(..., s)``, optional
        Padded keys take no part in the pack step (the unpack step sees only the ``l``
        packed tokens, all real).
    unpack_key_proj : array, shape ``(..., dv, d)``, optional
        ``W_K`` applied to the packed sequence to make the unpack keys.  Without it
        the keys are ``P'`` itself, which needs ``dv == d``.
    unpack_value_proj : array, shape ``(..., dv, dv2)``, optional
        ``W_V`` applied to the packed sequence to make the unpack values (default
        ``P'``).
    return_packed : bool
        Also return ``P'`` (the paper's second output ``Y_P``, the next layer's ``P``).

    Returns
    -------
    array, shape ``(..., n, dv2)`` (``dv2 = dv`` without ``unpack_value_proj``)
        Same namespace, device and dtype as ``q``; with ``return_packed`` the pair
        ``(out, packed)``, ``packed`` of shape ``(..., l, dv)``.

    Notes
    -----
    Where the paper puts projections: ``Y_P = Attn(P, C)`` and ``Y_X = Attn(X, Y_P)``,
    each ``Attn`` with its own ``W_Q, W_K, W_V`` (per head), and ``P`` of the first
    layer a learned positional embedding.  arrayattn has no learned parameters: the
    pack projections (``P W_Q``, ``C W_K``, ``C W_V``) and the unpack query projection
    (``X W_Q``) are applied by the caller before the call; the unpack key and value
    projections act on ``P'``, which exists only inside the call, so they are the
    optional ``unpack_key_proj`` / ``unpack_value_proj`` arguments.  The output
    projection, the layer norm that the paper applies to ``Y_P`` before the next
    layer, and the sharing of weights across layers are left to the caller.

    The output is **not** linear in ``v``: the unpack keys are built from the packed
    values, so :func:`arrayattn.attention_matrix` does not describe it.  Rows of
    both attentions sum to 1, so a constant ``v`` is returned unchanged.

    Not causal: every packed token mixes all keys.  The paper's causal variant packs
    cumulatively per position with a different activation; it is not implemented.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import luna_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 50, 8)) for _ in range(3))
    >>> p = rng.standard_normal((16, 8))          # l = 16 packed tokens, shared
    >>> out, packed = luna_attention(q, k, v, p, return_packed=True)
    >>> out.shape, packed.shape
    ((2, 50, 8), (2, 16, 8))
    >>> const = luna_attention(q, k, np.full((50, 3), 2.5), p,
    ...                        unpack_key_proj=rng.standard_normal((3, 8)))
    >>> bool(np.allclose(const, 2.5))
    True
    """
    return run(SPEC, q, k, v, p=p, scale=scale, causal=causal, key_mask=key_mask,
               unpack_key_proj=unpack_key_proj, unpack_value_proj=unpack_value_proj,
               return_packed=return_packed)


def _result(call: LunaCall, out, packed):
    """What the call returns: ``out``, or ``(out, packed)`` with ``return_packed``, both
    in the caller's dtype."""
    xp = call.p.xp
    out = xp.astype(out, call.p.dtype, copy=False)
    return (out, xp.astype(packed, call.pack.dtype, copy=False)) if call.return_packed else out


def _reference(call: LunaCall, w: Working):
    out, packed = reference.luna_attention(
        w.q, w.k, w.v, call.packed_queries, scale=call.scale, key_mask=call.key_mask,
        unpack_key_proj=call.unpack_key_proj, unpack_value_proj=call.unpack_value_proj)
    return _result(call, out, packed)


def _empty(call: LunaCall):
    """No key: every packed token attends to nothing (zeros), and so every output is a
    mean of zero values.  No query or no batch element: the output is empty, but the
    packed sequence is still the keys packed (the reference form)."""
    prob, xp = call.p, call.p.xp
    with entry(xp):
        if prob.s > 0:
            return _reference(call, working(prob, *call.qkv, call.key_mask))
        packed = xp.zeros((*call.pack.batch, call.pack.n, prob.dv), dtype=prob.work_dtype,
                          device=prob.device)
        values = packed if call.unpack_value_proj is None else packed @ call.unpack_value_proj
        out = xp.zeros((*prob.batch, prob.n, values.shape[-1]), dtype=prob.work_dtype,
                       device=prob.device)
    return _result(call, out, packed)


_NONE_MEANS = {"scale": "1/sqrt(d)", "key_mask": "every key is real",
               "unpack_key_proj": "the identity (needs dv == d)",
               "unpack_value_proj": "the identity"}

#: The pipeline of :func:`luna_attention`.
SPEC = Spec(name="luna_attention", check=checked_luna, reference=_reference, empty=_empty,
            none_means=_NONE_MEANS)

#: The pipeline of the uniform call (``luna`` in the registry): ``P`` (and ``W_K`` when
#: ``dv != d``) drawn from ``seed`` by the check, ``q, k, v`` checked once.
UNIFORM_SPEC = Spec(name="luna", check=checked_luna_uniform, reference=_reference,
                    empty=_empty,
                    none_means={**_NONE_MEANS,
                                "unpack_key_proj": "the identity, or drawn when dv != d"})


UNIFORM_PACKED = LUNA_UNIFORM_L


def uniform_call(q, k, v, /, *, num_packed=UNIFORM_PACKED, seed=0, **options):
    """Registry adapter: ``P`` and (when ``dv != d``) ``W_K`` drawn on the host with
    ``numpy.random.default_rng(seed)`` (``seed`` a non-negative integer)."""
    return run(UNIFORM_SPEC, q, k, v, num_packed=num_packed, seed=seed, **options)


def uniform_inputs(q, k, v, /, *, num_packed=UNIFORM_PACKED, seed=0, **options):
    """``(P, options)`` of the uniform call: ``P`` drawn, and ``W_K`` added to the
    other options when ``dv != d`` and none is given (shared with the backward)."""
    return luna_uniform_draw(check_qkv(q, k, v), q, num_packed=num_packed, seed=seed,
                             options=options)
