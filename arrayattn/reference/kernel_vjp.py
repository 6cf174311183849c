r"""Backward of kernel (linear) attention, its feature maps, and efficient attention.

**Kernel attention on features** (:func:`arrayattn.reference.kernel_attention`).  With the
masked keys' rows of :math:`\varphi_K` and :math:`V` set to zero, :math:`V_1 = [V, 1]`,
the state :math:`S_z = S_0 + \varphi_K^\top V_1` (``S_0`` the initial ``state``, or 0) and
:math:`N = \varphi_Q S_z` (last column the denominator :math:`\delta`),
:math:`O = N_{:, :-1} / \delta`.  With the output cotangent :math:`dO`:

.. math::

    dN_{:, :-1} = dO / \delta, \qquad
    dN_{:, -1} = -\operatorname{rowsum}(dO \circ O) / \delta

(a row with :math:`|\delta| \le \varepsilon` has zero output and zero cotangent;
``normalize=False``: :math:`O = N_{:, :-1}`, :math:`dN = [dO, 0]`), then, non-causal,

.. math::

    d\varphi_Q = dN\, S_z^\top, \quad dS_z = \varphi_Q^\top dN, \quad
    d\varphi_K = V_1\, dS_z^\top, \quad dV = (\varphi_K\, dS_z)_{:, :-1}, \quad
    dS_0 = dS_z.

**Causal** (end-aligned; the keys before the first query are folded into :math:`S_0`, the
queries before the first key see zero keys, as in the forward): with the prefix state
:math:`S_t = S_0 + \sum_{j \le t} \varphi_{k,j} v_{1,j}^\top` and the reverse-time
(suffix) state :math:`G_j = \sum_{t \ge j} \varphi_{q,t}^\top dN_t`,

.. math::

    d\varphi_{q,t} = dN_t\, S_t^\top, \quad
    d\varphi_{k,j} = G_j\, v_{1,j}, \quad dv_{1,j} = G_j^\top \varphi_{k,j}, \quad
    dS_0 = G_0 .

It is computed **chunked**, like the forward's chunked form: in chunks of ``c`` tokens,
with :math:`A = \operatorname{tril}(\varphi_Q \varphi_K^\top)` and
:math:`dA = \operatorname{tril}(dN\, V_1^\top)` inside the chunk,
:math:`B_b` the state entering chunk ``b`` (``S_0`` plus the exclusive prefix sum of the
chunk states :math:`\varphi_{K_c}^\top V_{1,c}`) and :math:`G^{>}_b` the exclusive
*suffix* sum of the chunk cotangents :math:`\varphi_{Q_c}^\top dN_c`,

.. math::

    d\varphi_{Q_b} = dN_b B_b^\top + dA\, \varphi_{K_b}, \quad
    d\varphi_{K_b} = V_{1,b} (G^{>}_b)^\top + dA^\top \varphi_{Q_b}, \quad
    dV_{1,b} = \varphi_{K_b} G^{>}_b + A^\top dN_b .

Memory: one ``m x (dv + 1)`` state per chunk and one ``c x c`` block per chunk -- never an
``(n, m, dv)`` or ``(n, n)`` array.  The forward's three causal methods (recurrent,
cumsum, chunked) compute the same function, so they share this one backward (the
``method`` argument is accepted and does not change the result beyond rounding).

**Feature maps** (:math:`dx = \varphi'(x)^\top d\varphi`): ``elu+1``: :math:`d\varphi`
where :math:`x > 0`, :math:`e^x d\varphi` elsewhere (at :math:`x = 0` both sides give 1);
``relu``: :math:`d\varphi` where :math:`x > 0`, else 0 (the subgradient 0 at
:math:`x = 0`); ``cosine`` :math:`[1, u]`, :math:`u = x / \lVert x \rVert`:
:math:`dx = (du - u (u \cdot du)) / \lVert x \rVert` (a zero row, where the map is not
continuous, is computed as ``x / 1``, whose derivative is :math:`du`, as autodiff of the
forward gives); ``taylor`` :math:`[1, y, \mathrm{vec}(y y^\top)/\sqrt2]`, :math:`y = a x`:
:math:`dx = a (dy + (dP + dP^\top) y / \sqrt2)` with :math:`dP` the ``d x d`` block of
the cotangent.

**Efficient attention** (Shen et al.): :math:`O = \rho_Q C`, :math:`C = \rho_K^\top V`,
:math:`\rho_Q = \operatorname{softmax}_{\text{features}}(Q)`,
:math:`\rho_K = \operatorname{softmax}_{\text{keys}}(K)` (masked keys weight 0):

.. math::

    dC = \rho_Q^\top dO, \quad d\rho_Q = dO\, C^\top, \quad dV = \rho_K\, dC, \quad
    d\rho_K = V\, dC^\top,

    dQ = \rho_Q \circ (d\rho_Q - \operatorname{rowsum}(\rho_Q \circ d\rho_Q)), \quad
    dK = \rho_K \circ (d\rho_K - \operatorname{colsum}(\rho_K \circ d\rho_K)).

Array API only, no host reads, no in-place updates; a masked key never enters an
arithmetic operation (its rows are replaced by zeros with ``where`` first) and gets
exactly zero gradient.
"""
from __future__ import annotations


import math

from array_api_compat import array_namespace, device

from .exact_vjp import sum_to_shape
from .chunks import in_chunks, unchunk
from .masks import masked_softmax, zero_masked_keys
from .scan import running_sum

__all__ = ["kernel_attention_vjp", "elu_plus_one_vjp", "relu_vjp", "cosine_features_vjp",
           "taylor_features_vjp", "linear_attention_vjp", "efficient_attention_vjp"]


def _t(x):
    return array_namespace(x).matrix_transpose(x)


def _output_cotangent(num, do, eps: float, normalize: bool):
    """``dN = [dO / den, -rowsum(dO O) / den]`` (zero where ``|den| <= eps``), or
    ``[dO, 0]`` without normalisation."""
    xp = array_namespace(num, do)
    if not normalize:
        return xp.concat([do, xp.zeros((*do.shape[:-1], 1), dtype=do.dtype,
                                       device=device(do))], axis=-1)
    den = num[..., -1:]
    ok = xp.abs(den) > eps
    inv = 1.0 / xp.where(ok, den, 1.0)
    out = num[..., :-1] * inv
    dnum = xp.where(ok, do * inv, 0.0)
    dden = xp.where(ok, -xp.sum(do * out, axis=-1, keepdims=True) * inv, 0.0)
    return xp.concat([dnum, dden], axis=-1)


def _pad_rows(x, rows: int, *, front: bool = False):
    xp = array_namespace(x)
    if not rows:
        return x
    zeros = xp.zeros((*x.shape[:-2], rows, x.shape[-1]), dtype=x.dtype, device=device(x))
    return xp.concat([zeros, x] if front else [x, zeros], axis=-2)


def _causal_chunked_vjp(phi_q, phi_k, v1, do, sz0, chunk_size: int, eps: float,
                        normalize: bool):
    """The chunked causal backward on aligned sequences (``n`` queries, ``n`` keys, key
    ``t`` the last one query ``t`` sees): ``(dphi_q, dphi_k, dv1, dS0)``."""
    xp = array_namespace(phi_q, phi_k, v1, do)
    n = phi_q.shape[-2]
    c = min(chunk_size, n)
    qc, kc, vc, dc = (in_chunks(x, c) for x in (phi_q, phi_k, v1, do))
    past = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(phi_q)))
    # forward, recomputed: B_b = S0 + sum_{b' < b} phi_K_b'^T V1_b', A = tril(phi_Q phi_K^T)
    before, _ = running_sum(_t(kc) @ vc, sz0, axis=-3)
    a = xp.where(past, qc @ _t(kc), 0.0)
    num = qc @ before + a @ vc                                   # (..., nc, c, dv + 1)
    dn = _output_cotangent(num, dc, eps, normalize)              # padded rows: do = 0
    # backward: dA = tril(dN V1^T); G>_b = sum_{b' > b} phi_Q_b'^T dN_b'
    da = xp.where(past, dn @ _t(vc), 0.0)
    dstate = _t(qc) @ dn                                         # (..., nc, m, dv + 1)
    after, ds0 = running_sum(dstate, axis=-3, reverse=True)
    dq = dn @ _t(before) + da @ kc
    dk = vc @ _t(after) + _t(da) @ qc
    dv1 = kc @ after + _t(a) @ dn
    return tuple(unchunk(x, n) for x in (dq, dk, dv1)) + (ds0,)


def kernel_attention_vjp(phi_q, phi_k, v, do, *, causal=False, key_mask=None,
                         method="chunked", chunk_size=64, eps=0.0, state=None,
                         normalize=True):
    r"""The cotangents of :func:`~arrayattn.reference.kernel_attention`'s output ``O``.

    Takes the forward's arguments and options and the output cotangent ``do (..., n,
    dv)``; returns ``{"phi_q", "phi_k", "v"}`` (and ``"state"`` when a ``state`` was
    given), each with its argument's shape (broadcast batch dimensions summed).  The
    equations are in the module docstring; the causal backward is the chunked one for
    every ``method`` (the forms are equal), with chunks of ``chunk_size`` tokens.
    The cotangent of the returned final state is not taken (the output only).
    """
    xp = array_namespace(phi_q, phi_k, v, do)
    shapes = {"phi_q": phi_q.shape, "phi_k": phi_k.shape, "v": v.shape}
    phi_k, v = zero_masked_keys(key_mask, phi_k, v)   # in neither numerator nor denominator
    v1 = xp.concat([v, xp.ones((*v.shape[:-1], 1), dtype=v.dtype, device=device(v))],
                   axis=-1)
    sz0 = _t(phi_k[..., :0, :]) @ v1[..., :0, :]                  # the sum over no keys
    sz0 = sz0 if state is None else sz0 + state
    n, s = phi_q.shape[-2], phi_k.shape[-2]
    if not causal or n == 0:
        sz = sz0 + _t(phi_k) @ v1
        dn = _output_cotangent(phi_q @ sz, do, eps, normalize)
        dsz = _t(phi_q) @ dn
        dq, dk, dv1, ds0 = dn @ _t(sz), v1 @ _t(dsz), phi_k @ dsz, dsz
    else:
        lead = max(s - n, 0)     # keys before the first query: seen by all, in the state
        if lead:
            sz0 = sz0 + _t(phi_k[..., :lead, :]) @ v1[..., :lead, :]
        kt, vt = (_pad_rows(x[..., lead:, :], max(n - s, 0), front=True)
                  for x in (phi_k, v1))
        dq, dk, dv1, ds0 = _causal_chunked_vjp(phi_q, kt, vt, do, sz0, chunk_size, eps,
                                               normalize)
        dk, dv1 = dk[..., max(n - s, 0):, :], dv1[..., max(n - s, 0):, :]
        if lead:                 # the folded keys' cotangents come from dS0
            dk = xp.concat([v1[..., :lead, :] @ _t(ds0), dk], axis=-2)
            dv1 = xp.concat([phi_k[..., :lead, :] @ ds0, dv1], axis=-2)
    dk, dv = zero_masked_keys(key_mask, dk, dv1[..., :-1])       # masked keys: exactly 0
    grads = {"phi_q": dq, "phi_k": dk, "v": dv}
    if state is not None:
        grads["state"], shapes["state"] = ds0, state.shape
    return {name: sum_to_shape(g, shapes[name]) for name, g in grads.items()}


# --- feature maps: dx = phi'(x)^T dphi -------------------------------------------------

def elu_plus_one_vjp(x, dphi):
    r"""``elu(x) + 1``: ``dphi`` where ``x > 0``, ``exp(x) dphi`` elsewhere (``x = 0``:
    both one-sided slopes are 1)."""
    xp = array_namespace(x, dphi)
    return xp.where(x > 0, dphi, xp.exp(xp.clip(x, max=0.0)) * dphi)


def relu_vjp(x, dphi):
    r"""``max(x, 0)``: ``dphi`` where ``x > 0``, else 0 (at ``x = 0`` the subgradient 0,
    as torch and JAX take it)."""
    xp = array_namespace(x, dphi)
    return xp.where(x > 0, dphi, 0.0)


def cosine_features_vjp(x, dphi):
    r"""``[1, u]``, ``u = x / |x|``: ``dx = (du - u (u . du)) / |x|`` with ``du =
    dphi[..., 1:]``.  A zero row (where the map is discontinuous) is computed as ``x /
    1``: its cotangent is ``du``, what autodiff of the forward gives."""
    xp = array_namespace(x, dphi)
    nrm = xp.linalg.vector_norm(x, axis=-1, keepdims=True)
    safe = xp.where(nrm > 0, nrm, 1.0)
    u, du = x / safe, dphi[..., 1:]
    return (du - u * xp.sum(u * du, axis=-1, keepdims=True)) / safe


def taylor_features_vjp(x, dphi, input_scale: float = 1.0):
    r"""``[1, y, vec(y y^T)/sqrt(2)]``, ``y = a x``: ``dx = a (dy + (dP + dP^T) y /
    sqrt(2))``, ``dP`` the cotangent of the ``d x d`` block."""
    xp = array_namespace(x, dphi)
    d, a = x.shape[-1], input_scale
    y = x * a
    dp = xp.reshape(dphi[..., 1 + d:], (*x.shape[:-1], d, d))
    sym = ((dp + xp.matrix_transpose(dp)) @ y[..., :, None])[..., 0]
    return a * (dphi[..., 1:1 + d] + sym * (1.0 / math.sqrt(2.0)))


# --- linear attention and efficient attention -------------------------------------------

def linear_attention_vjp(q, k, v, do, *, feature_map, causal=False, key_mask=None,
                         method="chunked", chunk_size=64, eps=0.0, normalize=True):
    r"""``{"q", "k", "v"}`` of :func:`~arrayattn.reference.linear_attention`:
    :func:`kernel_attention_vjp` on the features, then each map's vjp
    (``feature_map.query_vjp(x, dphi)``, ``feature_map.key_vjp``)."""
    k, v = zero_masked_keys(key_mask, k, v)   # padding may hold NaN: never fed to the map
    g = kernel_attention_vjp(feature_map.query(q), feature_map.key(k), v, do, causal=causal,
                             key_mask=key_mask, method=method, chunk_size=chunk_size,
                             eps=eps, normalize=normalize)
    dk = zero_masked_keys(key_mask, feature_map.key_vjp(k, g["phi_k"]))
    return {"q": feature_map.query_vjp(q, g["phi_q"]), "k": dk, "v": g["v"]}


def efficient_attention_vjp(q, k, v, do, *, key_mask=None):
    r"""``{"q", "k", "v"}`` of :func:`~arrayattn.reference.efficient_attention`, by the
    equations above (softmax over the features of each query, over the unmasked keys of
    each feature; a masked key has weight 0 and gets zero gradient)."""
    xp = array_namespace(q, k, v, do)
    shapes = {"q": q.shape, "k": k.shape, "v": v.shape}
    k, v = zero_masked_keys(key_mask, k, v)
    rho_q = masked_softmax(q, axis=-1)
    rho_k = masked_softmax(k, None if key_mask is None else key_mask[..., None], axis=-2)
    c = _t(rho_k) @ v                                            # (..., d, dv)
    dc, drho_q = _t(rho_q) @ do, do @ _t(c)
    drho_k = v @ _t(dc)
    dq = rho_q * (drho_q - xp.sum(rho_q * drho_q, axis=-1, keepdims=True))
    dk = rho_k * (drho_k - xp.sum(rho_k * drho_k, axis=-2, keepdims=True))
    dk, dv = zero_masked_keys(key_mask, dk, rho_k @ dc)
    grads = {"q": dq, "k": dk, "v": dv}
    return {name: sum_to_shape(g, shapes[name]) for name, g in grads.items()}
