r"""Reference forms: kernel (linear) attention and efficient attention.

.. math::

    O_i = \frac{\varphi_q(q_i)^\top \sum_{j \in J_i} \varphi_k(k_j) v_j^\top}
               {\varphi_q(q_i)^\top \sum_{j \in J_i} \varphi_k(k_j)}

Katharopoulos et al. 2020, "Transformers are RNNs".  The values are augmented with a
column of ones, ``[v, 1]``, so that one product gives the numerator and (last column) the
denominator: the state is ``Sz = [S, z] = sum_j phi_k(k_j) [v_j, 1]^T`` of shape
``(..., m, dv + 1)``.  The causal forms (end-aligned: ``j <= i + s - n``) follow fla's
``fla/ops/linear_attn/naive.py``: the recurrence, the cumulative sum of outer products,
and the chunked form (quadratic inside a chunk, the state between chunks).
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .masks import masked_softmax, zero_masked_keys
from .chunks import in_chunks, unchunk
from .scan import scan, running_sum

__all__ = ["kernel_attention", "kernel_recurrent", "kernel_cumsum", "kernel_chunked",
           "guarded_divide", "linear_attention", "efficient_attention"]


def guarded_divide(num, eps: float):
    """``num[..., :-1] / num[..., -1:]`` (numerator over denominator); a row whose
    ``|den| <= eps`` returns zeros (no visible key).  Nothing is added to ``den``."""
    xp = array_namespace(num)
    den = num[..., -1:]
    return num[..., :-1] / xp.where(xp.abs(den) > eps, den, xp.inf)   # finite / inf = 0


def kernel_recurrent(phi_q, phi_k, v1, sz0):
    """The RNN form, one token at a time: ``Sz_t = Sz_(t-1) + phi_k(k_t) [v_t, 1]^T``,
    ``num_t = phi_q(q_t) Sz_t`` (``n == s``).  Returns ``(num, Sz_n)``."""

    def token(sz, qt, kt, vt):
        sz = sz + kt[..., :, None] * vt[..., None, :]
        return sz, (qt[..., None, :] @ sz)[..., 0, :]

    sz, num = scan(token, sz0, (phi_q, phi_k, v1), axis=-2)
    return num, sz


def kernel_cumsum(phi_q, phi_k, v1, sz0):
    """A cumulative sum of every token's outer product (``O(n m dv)`` memory)."""
    xp = array_namespace(phi_q, phi_k, v1)
    sz = sz0[..., None, :, :] + xp.cumulative_sum(
        phi_k[..., :, :, None] * v1[..., :, None, :], axis=-3)      # (..., n, m, dv+1)
    return (phi_q[..., :, None, :] @ sz)[..., 0, :], sz[..., -1, :, :]


def kernel_chunked(phi_q, phi_k, v1, sz0, chunk_size: int):
    """Chunks of ``c`` tokens: within a chunk the masked quadratic form
    ``tril(phi_Q phi_K^T) [V, 1]``; the state entering chunk ``b`` is ``Sz0`` plus the
    sum of the chunk states ``phi_K_c^T [V_c, 1]`` before it (``Sz0=None``: no earlier
    state)."""
    xp = array_namespace(phi_q, phi_k, v1)
    n = phi_q.shape[-2]
    c = min(chunk_size, n)
    qc, kc, vc = (in_chunks(x, c) for x in (phi_q, phi_k, v1))
    kv = xp.matrix_transpose(kc) @ vc                                # (..., nc, m, dv+1)
    before, sz = running_sum(kv, sz0, axis=-3)                       # states into, out
    past = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(phi_q)))
    within = xp.where(past, qc @ xp.matrix_transpose(kc), 0.0) @ vc
    num = qc @ before + within
    return unchunk(num, n), sz


def kernel_attention(phi_q, phi_k, v, *, causal=False, key_mask=None, method="chunked",
                     chunk_size=64, eps=0.0, state=None, normalize=True):
    r"""Kernel attention on features: ``(O, Sz)`` with ``O (..., n, dv)`` and the final
    state ``Sz = [S, z] (..., m, dv + 1)`` (``state``: the ``Sz`` of earlier keys, seen by
    every query).  ``method`` picks the causal form; all are equal to rounding.
    ``normalize=False`` returns the numerator alone (fla's unnormalised linear
    attention)."""
    xp = array_namespace(phi_q, phi_k, v)
    finish = (lambda num: guarded_divide(num, eps)) if normalize else (lambda num: num[..., :-1])
    phi_k, v = zero_masked_keys(key_mask, phi_k, v)   # in neither numerator nor denominator
    ones = xp.ones((*v.shape[:-1], 1), dtype=v.dtype, device=device(v))
    v1 = xp.concat([v, ones], axis=-1)       # [v, 1]: the last column is the denominator
    sz0 = xp.matrix_transpose(phi_k[..., :0, :]) @ v1[..., :0, :]   # the sum over no keys
    sz0 = sz0 if state is None else sz0 + state
    if not causal:
        sz = sz0 + xp.matrix_transpose(phi_k) @ v1
        return finish(phi_q @ sz), sz
    n, s = phi_q.shape[-2], phi_k.shape[-2]
    if s > n:        # keys before the first query are seen by every query: into the state
        sz0 = sz0 + xp.matrix_transpose(phi_k[..., :s - n, :]) @ v1[..., :s - n, :]
        phi_k, v1 = phi_k[..., s - n:, :], v1[..., s - n:, :]
    elif n > s:      # queries before the first key: zero keys in front (they add nothing)
        phi_k, v1 = (xp.concat([xp.zeros((*x.shape[:-2], n - s, x.shape[-1]),
                                         dtype=x.dtype, device=device(x)), x], axis=-2)
                     for x in (phi_k, v1))
    if n == 0:
        num, sz = phi_q @ sz0, sz0
    elif method == "recurrent":
        num, sz = kernel_recurrent(phi_q, phi_k, v1, sz0)
    elif method == "cumsum":
        num, sz = kernel_cumsum(phi_q, phi_k, v1, sz0)
    else:            # no earlier state and no key before the first query: none to add
        empty = state is None and s <= n
        num, sz = kernel_chunked(phi_q, phi_k, v1, None if empty else sz0, chunk_size)
    return finish(num), sz


def linear_attention(q, k, v, *, feature_map, causal=False, key_mask=None,
                     method="chunked", chunk_size=64, eps=0.0, normalize=True):
    r"""Linear attention ``phi_q(Q) (phi_k(K)^T V) / phi_q(Q) (phi_k(K)^T 1)``
    (Katharopoulos et al. 2020) with ``feature_map`` a
    :class:`~arrayattn.kernel.feature_maps.FeatureMap`; returns ``(O, Sz)``."""
    k, v = zero_masked_keys(key_mask, k, v)   # padding may hold NaN: never fed to the map
    return kernel_attention(feature_map.query(q), feature_map.key(k), v, causal=causal,
                            key_mask=key_mask, method=method, chunk_size=chunk_size,
                            eps=eps, normalize=normalize)


def efficient_attention(q, k, v, *, key_mask=None):
    r"""Efficient attention (Shen et al. 2021): ``softmax_d(Q) (softmax_s(K)^T V)``, the
    softmax over the features of each query and over the (unmasked) keys of each
    feature."""
    xp = array_namespace(q, k, v)
    k, v = zero_masked_keys(key_mask, k, v)
    rho_q = masked_softmax(q, axis=-1)
    rho_k = masked_softmax(k, None if key_mask is None else key_mask[..., None], axis=-2)
    return rho_q @ (xp.matrix_transpose(rho_k) @ v)
