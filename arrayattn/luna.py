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

import numpy as np

from . import reference
from ._engine import entry
from ._validate import (check_array, check_flag, check_key_mask, check_no_causal,
                        check_positive_int, check_qkv, check_same_array_kind, check_scale,
                        check_seed)
from ._xp import xp_device, xp_from_host

__all__ = ["luna_attention", "checked_luna", "uniform_inputs", "uniform_call", "UNIFORM_PACKED"]

_NOT_CAUSAL = (
    "every packed token P' attends to all s keys, and every output attends to every "
    "packed token, so each output depends on every key and value; the paper's causal "
    "Luna needs a different (cumulative, per-position) packing that is not implemented"
)


def _check_projection(p, name, w, ref, rows, cols_name):
    if w is None:
        return None
    w = check_array(name, w)
    check_same_array_kind(p.xp, "q", ref, name, w)
    if not p.xp.isdtype(w.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype; got {w.dtype}")
    if w.ndim < 2 or w.shape[-2] != rows:
        raise ValueError(
            f"{name} must have shape (..., dv, {cols_name}) with dv={rows} (the value "
            f"dimension of the packed sequence); got shape {tuple(w.shape)}"
        )
    return w


def checked_luna(q, k, v, p, *, scale, causal, key_mask, unpack_key_proj,
                 unpack_value_proj):
    """The forward's checks, shared with the backward: ``(problem, pack problem, scale,
    (q, k, v, p, W_K, W_V))``, the arrays in the working dtype (``W = None`` if absent)."""
    prob = check_qkv(q, k, v)
    check_no_causal(check_flag("causal", causal), "luna_attention", _NOT_CAUSAL)
    check_key_mask(prob, key_mask, q)
    p = check_array("p", p)
    packp = check_qkv(p, k, v, names=("p", "k", "v"))
    check_same_array_kind(prob.xp, "q", q, "p", p)
    wk = _check_projection(prob, "unpack_key_proj", unpack_key_proj, q, prob.dv, "d")
    wv = _check_projection(prob, "unpack_value_proj", unpack_value_proj, q, prob.dv,
                           "dv2")
    if wk is None and prob.dv != prob.d:
        raise ValueError(
            f"the unpack step attends with keys P' of dimension dv={prob.dv} but q has "
            f"d={prob.d}; pass unpack_key_proj of shape (dv, d) = ({prob.dv}, {prob.d})"
        )
    if wk is not None and wk.shape[-1] != prob.d:
        raise ValueError(
            f"unpack_key_proj must map dv={prob.dv} to d={prob.d}; got shape "
            f"{tuple(wk.shape)}"
        )
    scale = check_scale(scale, prob.d)
    xp, wd = prob.xp, prob.work_dtype
    return prob, packp, scale, tuple(None if x is None else xp.astype(x, wd, copy=False)
                                     for x in (q, k, v, p, wk, wv))


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
    prob, packp, scale, (wq, wk_, wv_, wp, proj_k, proj_v) = checked_luna(
        q, k, v, p, scale=scale, causal=causal, key_mask=key_mask,
        unpack_key_proj=unpack_key_proj, unpack_value_proj=unpack_value_proj)
    return_packed = check_flag("return_packed", return_packed)
    xp, wd = prob.xp, prob.work_dtype
    with entry(xp):
        if prob.s == 0:
            # No key: every packed token attends to nothing (zeros), and so every output
            # is a mean of zero values.
            packed = xp.zeros((*packp.batch, packp.n, prob.dv), dtype=wd, device=prob.device)
            values = packed if proj_v is None else packed @ proj_v
            out = xp.zeros((*prob.batch, prob.n, values.shape[-1]), dtype=wd,
                           device=prob.device)
        else:
            out, packed = reference.luna_attention(
                wq, wk_, wv_, wp, scale=scale, key_mask=key_mask, unpack_key_proj=proj_k,
                unpack_value_proj=proj_v)
    out = xp.astype(out, prob.dtype, copy=False)
    if return_packed:
        return out, xp.astype(packed, packp.dtype, copy=False)
    return out


UNIFORM_PACKED = 16


def uniform_call(q, k, v, /, *, num_packed=UNIFORM_PACKED, seed=0, **options):
    """Registry adapter: ``P`` and (when ``dv != d``) ``W_K`` drawn on the host with
    ``numpy.random.default_rng(seed)`` (``seed`` a non-negative integer)."""
    p, options = uniform_inputs(q, k, v, num_packed=num_packed, seed=seed, **options)
    return luna_attention(q, k, v, p, **options)


def uniform_inputs(q, k, v, /, *, num_packed=UNIFORM_PACKED, seed=0, **options):
    """``(P, options)`` of the uniform call: ``P`` drawn, and ``W_K`` added to the
    other options when ``dv != d`` and none is given (shared with the backward)."""
    prob = check_qkv(q, k, v)
    xp = prob.xp
    num_packed = check_positive_int("num_packed", num_packed)
    d, dv = prob.d, prob.dv
    rng = np.random.default_rng(check_seed(seed))
    p = xp_from_host(xp, rng.standard_normal((num_packed, d)), dtype=q.dtype,
                     device=xp_device(q))
    if dv != d and options.get("unpack_key_proj") is None:
        wk = rng.standard_normal((dv, d)) / np.sqrt(dv)
        options = {**options, "unpack_key_proj": xp_from_host(xp, wk, dtype=q.dtype,
                                                              device=xp_device(q))}
    return p, options
