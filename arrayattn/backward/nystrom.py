"""The backward adapters of :func:`arrayattn.nystrom_attention` (``nystrom_svd``,
``nystrom_iterative``), :func:`arrayattn.landmark_attention` (``landmark``) and of
:func:`arrayattn.pinv` (:func:`pinv_vjp`).  The equations are in
:mod:`arrayattn.reference.nystrom_vjp`."""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..core.checks import check_array, check_same_array_kind
from ..lowrank.checks import checked_landmark, checked_nystrom, checked_pinv
from ..core.pipeline import working
from ..reference.exact_vjp import sum_to_shape

__all__ = ["nystrom_attention_vjp", "landmark_attention_vjp", "pinv_vjp"]


def nystrom_attention_vjp(q, k, v, do, /, *, num_landmarks=64, pinv="iterative",
                          pinv_iters=6, pinv_init="per_matrix", pinv_rtol=None, scale=None,
                          key_mask=None, query_mask=None, conv_kernel=None, causal=False):
    """``{"q", "k", "v"[, "conv_kernel"]}`` of :func:`~arrayattn.nystrom_attention`.

    The pseudo-inverse is differentiated as computed: ``"svd"`` by the closed form of
    the derivative of ``pinv`` (valid where the rank of the landmark matrix is constant),
    ``"iterative"`` through Razavi's iterations themselves.
    """
    call = checked_nystrom(
        q, k, v, num_landmarks=num_landmarks, pinv=pinv, pinv_iters=pinv_iters,
        pinv_init=pinv_init, pinv_rtol=pinv_rtol, scale=scale, key_mask=key_mask,
        query_mask=query_mask, conv_kernel=conv_kernel, causal=causal)
    p = call.p
    if p.empty:
        return _zero_grads(p, q=q, k=k, v=v, conv_kernel=conv_kernel)
    w = working(p, q, k, v, None)              # cast only: the equations mask the keys
    wdo = p.xp.astype(do, p.work_dtype, copy=False)
    with entry(p.xp):
        grads = reference.nystrom_attention_vjp(w.q, w.k, w.v, wdo, **call.options)
        if call.conv_kernel is not None:
            dv_conv, grads["conv_kernel"] = reference.depthwise_conv_vjp(
                w.v, call.conv_kernel, wdo, key_mask)
            grads["v"] = grads["v"] + dv_conv
    args = {"q": q, "k": k, "v": v, "conv_kernel": conv_kernel}
    return {name: sum_to_shape(g, args[name].shape) for name, g in grads.items()}


def landmark_attention_vjp(q, k, v, do, /, *, num_landmarks=64, scale=None, key_mask=None,
                           query_mask=None, causal=False):
    """``{"q", "k", "v"}`` of :func:`~arrayattn.landmark_attention`."""
    call = checked_landmark(q, k, v, num_landmarks=num_landmarks, scale=scale,
                            key_mask=key_mask, query_mask=query_mask, causal=causal)
    p = call.p
    if p.empty:
        return _zero_grads(p, q=q, k=k, v=v)
    w = working(p, q, k, v, None)              # cast only: the equations mask the keys
    wdo = p.xp.astype(do, p.work_dtype, copy=False)
    with entry(p.xp):
        grads = reference.landmark_attention_vjp(w.q, w.k, w.v, wdo, **call.options)
    args = {"q": q, "k": k, "v": v}
    return {name: sum_to_shape(g, args[name].shape) for name, g in grads.items()}


def _zero_grads(p, **args):
    """No token on one side: the output is zeros whatever the inputs, so are the
    gradients."""
    return {name: p.xp.zeros(x.shape, dtype=p.work_dtype, device=p.device)
            for name, x in args.items() if x is not None}


def pinv_vjp(a, dz, /, *, method="svd", iters=6, init="per_matrix", rtol=None):
    r"""The cotangent of ``a`` from the cotangent ``dz`` of ``z = pinv(a, ...)``.

    ``method="svd"``: the closed form of Golub and Pereyra (1973),
    :math:`\bar A = -Z^\top \bar Z Z^\top + (I - AZ)\bar Z^\top Z Z^\top + Z^\top Z \bar
    Z^\top (I - ZA)`.  It is the derivative only where the rank of ``a`` (counted with
    the cutoff ``rtol``) is locally constant: where a singular value crosses the cutoff,
    ``pinv`` jumps and has no derivative.  ``method="iterative"``: the exact derivative
    of the ``iters`` Razavi iterations as computed (including the scaling of ``Z_0`` by
    the norms), not of the true pseudo-inverse.

    Parameters
    ----------
    a : array, shape ``(..., p, q)``
    dz : array, shape ``(..., q, p)``
        Same namespace and device as ``a``.
    method, iters, init, rtol
        As in :func:`arrayattn.pinv`.

    Returns
    -------
    array, shape ``(..., p, q)``, ``a``'s dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.backward import pinv_vjp
    >>> a = np.array([[2.0, 1.0], [1.0, 3.0]])
    >>> da = pinv_vjp(a, np.eye(2))          # d trace(inv(a)) = -inv(a)^T inv(a)^T
    >>> z = np.linalg.inv(a)
    >>> bool(np.allclose(da, -(z @ z).T))
    True
    """
    xp, wa, iters, rtol = checked_pinv(a, method=method, iters=iters, init=init, rtol=rtol)
    dz = check_array("dz", dz)
    check_same_array_kind(xp, "a", a, "dz", dz)
    if not xp.isdtype(dz.dtype, "real floating"):
        raise TypeError(f"dz must have a real floating dtype; got {dz.dtype}")
    expected = (*a.shape[:-2], a.shape[-1], a.shape[-2])
    if tuple(dz.shape) != expected:
        raise ValueError(f"dz must have the shape of pinv(a), {expected}; got shape "
                         f"{tuple(dz.shape)}")
    wdz = xp.astype(dz, wa.dtype, copy=False)
    with entry(xp):
        if method == "iterative":
            da = reference.pinv_razavi_vjp(wa, wdz, iters, init)
        else:
            da = reference.pinv_svd_vjp(wa, reference.pinv_svd(wa, rtol), wdz)
    return xp.astype(da, a.dtype, copy=False)
