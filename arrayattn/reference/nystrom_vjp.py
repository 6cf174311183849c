r"""Backward of Nyströmformer, the two-softmax landmark attention and ``pinv``.

The forward (:mod:`arrayattn.reference.nystrom`), with ``c = scale`` and the landmarks
:math:`\tilde Q, \tilde K` the (masked) segment means,

.. math::

    F = \operatorname{softmax}(c\,Q\tilde K^\top),\ A = \operatorname{softmax}(c\,\tilde
    Q\tilde K^\top),\ B = \operatorname{softmax}(c\,\tilde Q K^\top),\ Z = A^+,\
    W = B V,\ Y = Z W,\ O = F Y,

is differentiated right to left with the output cotangent :math:`dO`:

.. math::

    dY = F^\top dO,\ dF = dO\,Y^\top,\ dZ = dY\,W^\top,\ dW = Z^\top dY,\
    dB = dW\,V^\top,\ dV = B^\top dW,

    dA = \text{pinv-vjp}(A, Z, dZ),\qquad dS_X = X \circ (dX - \operatorname{rowsum}(X
    \circ dX))\ \text{for } X \in \{F, A, B\},

    dQ = c\,dS_F \tilde K + \text{spread}(c\,dS_A \tilde K + c\,dS_B K),\quad
    dK = c\,dS_B^\top \tilde Q + \text{spread}(c\,dS_F^\top Q + c\,dS_A^\top \tilde Q),

where ``spread`` is the adjoint of the segment mean: each landmark's cotangent divided by
its count of real tokens and handed to those tokens (a masked token gets 0).

**pinv, SVD** (Golub and Pereyra 1973): where the rank of :math:`A` is locally constant,
:math:`dZ = -Z\,dA\,Z + ZZ^\top dA^\top (I - AZ) + (I - ZA)\,dA^\top Z^\top Z`, whose
adjoint is

.. math::

    \bar A = -Z^\top \bar Z Z^\top + (I - AZ)\,\bar Z^\top Z Z^\top
             + Z^\top Z\,\bar Z^\top (I - ZA).

A rank change is a point where ``pinv`` is not continuous, let alone differentiable; with
a cutoff ``rtol`` the formula is that of the truncated pseudo-inverse.

**pinv, Razavi's iteration**: the iterates :math:`Z_0 = A^\top/(\lVert A\rVert_1\lVert
A\rVert_\infty)`, :math:`Z_{k+1} = \tfrac14 Z_k T_3` with :math:`X = A Z_k`,
:math:`T_1 = 7I - X`, :math:`T_2 = 15I - X T_1`, :math:`T_3 = 13I - X T_2` are recomputed
(a stored list of the few ``m x m`` iterates) and walked backwards:
:math:`\bar T_3 = \tfrac14 Z_k^\top \bar Z_{k+1}`, :math:`\bar T_2 = -X^\top \bar T_3`,
:math:`\bar T_1 = -X^\top \bar T_2`, :math:`\bar X = -\bar T_3 T_2^\top - \bar T_2
T_1^\top - \bar T_1`, :math:`\bar A \mathrel{+}= \bar X Z_k^\top`, :math:`\bar Z_k =
\tfrac14 \bar Z_{k+1} T_3^\top + A^\top \bar X`; then through :math:`Z_0` and the norms
(a maximum's cotangent split evenly among its ties, as torch and JAX do).

Array API only, no host reads, no in-place updates.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .masks import masked_softmax, zero_masked_keys
from .nystrom import (and_masks, as_columns, as_rows, depthwise_conv, landmarks, pinv_razavi,
                      pinv_svd, razavi_scale, razavi_step, segment_sums)

__all__ = ["masked_segment_means_vjp", "pinv_svd_vjp", "pinv_razavi_vjp",
           "nystrom_attention_vjp", "landmark_attention_vjp", "depthwise_conv_vjp"]


def _t(x):
    return array_namespace(x).matrix_transpose(x)


def _eye(a, size):
    xp = array_namespace(a)
    return xp.eye(size, dtype=a.dtype, device=device(a))


def _segment_spread(g, n: int):
    """Adjoint of :func:`segment_sums`: row ``j`` of ``g (..., m, c)`` copied to every
    token of segment ``j``, ``(..., n, c)``."""
    xp = array_namespace(g)
    lead, (m, c) = tuple(g.shape[:-2]), tuple(g.shape[-2:])
    base, extra = divmod(n, m)
    long_ = xp.broadcast_to(g[..., :extra, None, :], (*lead, extra, base + 1, c))
    short = xp.broadcast_to(g[..., extra:, None, :], (*lead, m - extra, base, c))
    return xp.concat([xp.reshape(long_, (*lead, extra * (base + 1), c)),
                      xp.reshape(short, (*lead, (m - extra) * base, c))], axis=-2)


def masked_segment_means_vjp(dmeans, n: int, keep=None):
    """Cotangent of ``x (..., n, c)`` from that of its segment means ``dmeans (..., m, c)``
    (:func:`~arrayattn.reference.masked_segment_means`): ``dx_i = keep_i dmean_j /
    count_j`` for token ``i`` of segment ``j`` (0 for a dropped token)."""
    xp = array_namespace(dmeans)
    m = dmeans.shape[-2]
    if keep is None:
        ones = xp.ones((n, 1), dtype=dmeans.dtype, device=device(dmeans))
        return _segment_spread(dmeans / segment_sums(ones, m), n)
    counts = segment_sums(xp.astype(keep[..., None], dmeans.dtype), m)     # (..., m, 1)
    spread = _segment_spread(dmeans / xp.where(counts > 0, counts, 1.0), n)
    return xp.where(keep[..., None], spread, 0.0)


def _softmax_vjp(p, dp, allowed=None):
    """``dS = P * (dP - rowsum(P * dP))`` on the allowed entries, 0 elsewhere."""
    xp = array_namespace(p, dp)
    ds = p * (dp - xp.sum(p * dp, axis=-1, keepdims=True))
    return ds if allowed is None else xp.where(allowed, ds, 0.0)


def pinv_svd_vjp(a, z, dz):
    r"""Cotangent of ``a (..., p, q)`` from that of ``z = pinv(a)`` (Golub and Pereyra
    1973): :math:`-Z^\top \bar Z Z^\top + (I - AZ)\bar Z^\top Z Z^\top + Z^\top Z \bar
    Z^\top (I - ZA)`; valid where the rank of ``a`` is locally constant."""
    zt, dzt = _t(z), _t(dz)
    p, q = a.shape[-2], a.shape[-1]
    return (-(zt @ dz @ zt) + (_eye(a, p) - a @ z) @ (dzt @ (z @ zt))
            + (zt @ z) @ (dzt @ (_eye(a, q) - z @ a)))


def _norm_vjp(xp, absa, dnorm, axis, init):
    """Cotangent of ``|A|`` from that of ``max(sum(|A|, axis))`` (per matrix, or over the
    whole batch for ``init="global"``); a maximum's cotangent is split among its ties."""
    sums = xp.sum(absa, axis=axis)                                   # (..., q) or (..., p)
    if init == "global":
        hit = xp.astype(sums == xp.max(sums), absa.dtype)
        weights = hit / xp.sum(hit)
        dsums = weights * dnorm
    else:
        hit = xp.astype(sums == xp.max(sums, axis=-1, keepdims=True), absa.dtype)
        weights = hit / xp.sum(hit, axis=-1, keepdims=True)
        dsums = weights * dnorm[..., 0]                             # dnorm (..., 1, 1)
    return xp.expand_dims(dsums, axis=axis)


def pinv_razavi_vjp(a, dz, iters: int, init: str = "per_matrix"):
    """Cotangent of ``a`` from that of ``z = pinv_razavi(a, iters, init)``: the iterates
    recomputed and walked backwards (equations in the module docstring)."""
    xp = array_namespace(a, dz)
    absa = xp.abs(a)
    inv, col, row = razavi_scale(a, init)
    eye = _eye(a, a.shape[-2])
    zs = [_t(a) * inv]                      # the inputs Z_0 .. Z_{iters-1} of the steps
    for _ in range(iters - 1):
        zs.append(razavi_step(a, zs[-1]))     # the forward's steps, bit for bit
    zs = zs[:iters]
    da = xp.zeros(a.shape, dtype=a.dtype, device=device(a))
    g = dz
    for z in reversed(zs):
        x = a @ z
        t1 = 7.0 * eye - x
        t2 = 15.0 * eye - x @ t1
        t3 = 13.0 * eye - x @ t2
        dt3 = 0.25 * (_t(z) @ g)
        dt2 = -(_t(x) @ dt3)
        dt1 = -(_t(x) @ dt2)
        dx = -(dt3 @ _t(t2)) - dt2 @ _t(t1) - dt1
        da = da + dx @ _t(z)
        g = 0.25 * (g @ _t(t3)) + _t(a) @ dx
    # Z0 = A^T inv, inv = 1 / (||A||_1 ||A||_inf)
    da = da + _t(g) * inv
    dinv = xp.sum(g * _t(a)) if init == "global" else xp.sum(
        g * _t(a), axis=(-2, -1), keepdims=True)
    dcol, drow = -dinv * inv * inv * row, -dinv * inv * inv * col
    dabs = _norm_vjp(xp, absa, dcol, -2, init) + _norm_vjp(xp, absa, drow, -1, init)
    return da + xp.sign(a) * dabs


def nystrom_attention_vjp(q, k, v, do, *, num_landmarks: int, scale: float,
                          pinv: str = "iterative", pinv_iters: int = 6,
                          pinv_init: str = "per_matrix", pinv_rtol: float | None = None,
                          key_mask=None, query_mask=None):
    """``{"q": dQ, "k": dK, "v": dV}`` of :func:`~arrayattn.reference.nystrom_attention`
    (broadcast batch shape), by the equations of the module docstring."""
    xp = array_namespace(q, k, v, do)
    n, s, m = q.shape[-2], k.shape[-2], num_landmarks
    k0, v0, qt, kt, qvalid, kvalid = landmarks(q, k, v, m, key_mask, query_mask)
    ks = kt * scale
    allowed_f = as_columns(kvalid)
    allowed_a = and_masks(as_rows(qvalid), as_columns(kvalid))
    allowed_b = and_masks(as_rows(qvalid), as_columns(key_mask))
    kernel_f = masked_softmax(q @ _t(ks), allowed_f)
    kernel_a = masked_softmax(qt @ _t(ks), allowed_a)
    kernel_b = masked_softmax((qt * scale) @ _t(k0), allowed_b)
    if pinv == "svd":
        eps = float(xp.finfo(kernel_a.dtype).eps)
        z = pinv_svd(kernel_a, m * eps if pinv_rtol is None else pinv_rtol)
    else:
        z = pinv_razavi(kernel_a, pinv_iters, pinv_init)
    w = kernel_b @ v0
    y = z @ w
    # right to left, backwards
    dy, df = _t(kernel_f) @ do, do @ _t(y)
    dz, dw = dy @ _t(w), _t(z) @ dy
    db, dv0 = dw @ _t(v0), _t(kernel_b) @ dw
    if pinv == "svd":
        da = pinv_svd_vjp(kernel_a, z, dz)
    else:
        da = pinv_razavi_vjp(kernel_a, dz, pinv_iters, pinv_init)
    dsf = _softmax_vjp(kernel_f, df, allowed_f)
    dsa = _softmax_vjp(kernel_a, da, allowed_a)
    dsb = _softmax_vjp(kernel_b, db, allowed_b)
    dqt = dsa @ ks + scale * (dsb @ k0)
    dkt = scale * (_t(dsf) @ q + _t(dsa) @ qt)
    dq = dsf @ ks + masked_segment_means_vjp(dqt, n, query_mask)
    dk0 = scale * (_t(dsb) @ qt) + masked_segment_means_vjp(dkt, s, key_mask)
    dk, dv = zero_masked_keys(key_mask, dk0, dv0)
    return {"q": dq, "k": dk, "v": dv}


def landmark_attention_vjp(q, k, v, do, *, num_landmarks: int, scale: float, key_mask=None,
                           query_mask=None):
    """``{"q": dQ, "k": dK, "v": dV}`` of :func:`~arrayattn.reference.landmark_attention`:
    ``O = F (B V)``, the equations above without the middle factor."""
    n, s = q.shape[-2], k.shape[-2]
    k0, v0, qt, kt, qvalid, kvalid = landmarks(q, k, v, num_landmarks, key_mask, query_mask)
    ks = kt * scale
    allowed_f = as_columns(and_masks(qvalid, kvalid))
    allowed_b = and_masks(as_rows(qvalid), as_columns(key_mask))
    kernel_f = masked_softmax(q @ _t(ks), allowed_f)
    kernel_b = masked_softmax((qt * scale) @ _t(k0), allowed_b)
    w = kernel_b @ v0
    df, dw = do @ _t(w), _t(kernel_f) @ do
    db, dv0 = dw @ _t(v0), _t(kernel_b) @ dw
    dsf = _softmax_vjp(kernel_f, df, allowed_f)
    dsb = _softmax_vjp(kernel_b, db, allowed_b)
    dq = dsf @ ks + masked_segment_means_vjp(scale * (dsb @ k0), n, query_mask)
    dk0 = scale * (_t(dsb) @ qt) + masked_segment_means_vjp(scale * (_t(dsf) @ q), s,
                                                            key_mask)
    dk, dv = zero_masked_keys(key_mask, dk0, dv0)
    return {"q": dq, "k": dk, "v": dv}


def depthwise_conv_vjp(v, kernel, do, key_mask=None):
    r"""``(dV, dW)`` of :func:`~arrayattn.reference.depthwise_conv`: :math:`dV =
    \operatorname{conv}(dO, \operatorname{flip}(W))` (masked keys 0), :math:`dW_t =
    \sum_{i,c} dO_{ic}\,V_{i+t-\lfloor K/2\rfloor, c}`; ``dW`` has the broadcast batch
    shape ``(..., K)``."""
    xp = array_namespace(v, kernel, do)
    width, n = kernel.shape[-1], v.shape[-2]
    dv = zero_masked_keys(key_mask, depthwise_conv(do, xp.flip(kernel, axis=-1)))
    v = zero_masked_keys(key_mask, v)
    pad = xp.zeros((*v.shape[:-2], width // 2, v.shape[-1]), dtype=v.dtype, device=device(v))
    padded = xp.concat([pad, v, pad], axis=-2)
    dw = xp.stack([xp.sum(do * padded[..., t:t + n, :], axis=(-2, -1))
                   for t in range(width)], axis=-1)
    return dv, dw
