r"""Reference forms: Random Feature Attention (Peng et al. 2021), plain and gated.

.. math::

    \phi(x) = m^{-1/2}[\sin(w\hat x), \cos(w\hat x)],\quad \hat x = x/\|x\|,\quad
    w = \omega/\sigma,\qquad
    \mathbb E[\phi(\hat q)\cdot\phi(\hat k)] = \exp(-\|\hat q - \hat k\|^2/(2\sigma^2)),

and kernel attention on these features.  The gated recurrence (causal, ``n = s``):
``S_t = g_t S_(t-1) + (1 - g_t) phi(k_t) [v_t, 1]^T``, ``o_t = phi(q_t) S_t`` divided by
its last column; the chunked form computes the decays in log space, every factor ``<= 1``.
"""
from __future__ import annotations


from array_api_compat import array_namespace, device

from .kernel import guarded_divide, kernel_attention
from .chunks import in_chunks, unchunk
from .masks import zero_masked_keys
from .scan import scan

__all__ = ["random_fourier_features", "rfa_attention", "gated_rfa", "gated_recurrent",
           "gated_chunked"]


def random_fourier_features(x, omega, *, sigma: float):
    r"""``[sin(w x̂), cos(w x̂)]`` with ``w = ω/σ`` and ``x̂ = x/‖x‖`` (a zero row stays
    zero), without the constant ``m^-1/2``: ``(..., t, 2m)``."""
    xp = array_namespace(x, omega)
    norm = xp.linalg.vector_norm(x, axis=-1, keepdims=True)
    t = (x / xp.where(norm == 0, 1.0, norm)) @ xp.matrix_transpose(omega / sigma)
    return xp.concat([xp.sin(t), xp.cos(t)], axis=-1)


def gated_recurrent(phi_q, phi_k, v1, g):
    """``Sz_t = g_t Sz_(t-1) + (1 - g_t) phi_k(k_t) [v_t, 1]^T``, ``num_t = phi_q(q_t)
    Sz_t``, one token at a time."""
    xp = array_namespace(phi_q, phi_k, v1, g)
    sz0 = xp.matrix_transpose(phi_k[..., :0, :]) @ v1[..., :0, :]   # the sum over no keys

    def token(sz, qt, kt, vt, gt):
        gt = gt[..., None]                                       # (..., 1, 1)
        sz = gt * sz + (1 - gt) * (kt[..., :, None] * vt[..., None, :])
        return sz, (qt[..., None, :] @ sz)[..., 0, :]

    return scan(token, sz0, (phi_q, phi_k, v1, g[..., None]), axis=-2)[1]


def gated_chunked(phi_q, phi_k, v1, g, chunk_size: int):
    """The same numerators by chunks of ``c`` tokens, in log space.  Inside a chunk key
    ``j`` reaches query ``t >= j`` with ``(1 - g_j) exp(E_tj)``, ``E_tj = sum_(j < l <= t)
    log g_l`` (a masked cumulative sum per pair, so a weight near 1 is not the difference
    of two large prefix sums); the state entering a chunk reaches its query ``t`` with
    ``exp(a_t)``, ``a_t = sum_(l <= t) log g_l`` from the chunk start."""
    xp = array_namespace(phi_q, phi_k, v1, g)
    n = phi_q.shape[-2]
    c = min(chunk_size, n)
    tiny = xp.finfo(phi_q.dtype).smallest_normal          # g = 0: a restart, to rounding
    lg = xp.log(xp.maximum(g, tiny))
    w = 1 - g
    # padding at the end: zero features, log g = 0, weight 0; those outputs are dropped
    qc, kc, vc = (in_chunks(x, c) for x in (phi_q, phi_k, v1))
    lc, wc = (in_chunks(x[..., None], c)[..., 0] for x in (lg, w))
    strict = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(phi_q)), k=-1)
    seg = xp.cumulative_sum(xp.where(strict, lc[..., :, None], 0.0), axis=-2)   # E_tj
    # mask last: a NaN gate of a future key must not reach earlier rows through 0 * NaN
    decay = xp.where(strict | xp.eye(c, dtype=xp.bool, device=device(phi_q)),
                     xp.exp(seg) * wc[..., None, :], 0.0)
    num = ((qc @ xp.matrix_transpose(kc)) * decay) @ vc             # within each chunk
    into = xp.exp(xp.cumulative_sum(lc, axis=-1))                    # state -> query t
    upd = xp.matrix_transpose(kc * (wc * xp.exp(seg[..., -1, :]))[..., None]) @ vc
    state0 = xp.zeros_like(upd[..., 0, :, :])                        # no earlier key

    def chunk(state, num_i, q_i, into_i, upd_i):
        out = num_i + into_i * (q_i @ state)
        return into_i[..., -1:, :] * state + upd_i, out

    out = scan(chunk, state0, (num, qc, into[..., None], upd), axis=-3)[1]
    return unchunk(out, n)


def gated_rfa(phi_q, phi_k, v, g, *, key_mask=None, method="chunked", chunk_size=64,
              eps=0.0):
    r"""Gated RFA on features: ``o_t = phi_q(q_t) S_t / phi_q(q_t) z_t`` with
    ``[S, z]_t = g_t [S, z]_(t-1) + (1 - g_t) phi_k(k_t) [v_t, 1]^T``.  A masked key is
    skipped (``g = 1``); a gate outside ``[0, 1]`` makes the outputs from there on NaN
    (checking it would read the device)."""
    xp = array_namespace(phi_q, phi_k, v, g)
    g = xp.where((g >= 0.0) & (g <= 1.0), g, xp.nan)
    if key_mask is not None:
        g = xp.where(key_mask, g, 1.0)
    phi_k, v = zero_masked_keys(key_mask, phi_k, v)
    v1 = xp.concat([v, xp.ones((*v.shape[:-1], 1), dtype=v.dtype, device=device(v))],
                   axis=-1)
    form = gated_recurrent if method == "recurrent" else (
        lambda *a: gated_chunked(*a, chunk_size))
    return guarded_divide(form(phi_q, phi_k, v1, g), eps)


def rfa_attention(q, k, v, omega, *, sigma: float, causal=False, gate=None, key_mask=None,
                  method="chunked", chunk_size=64, eps=0.0):
    r"""RFA: kernel attention on :func:`random_fourier_features` of ``q`` and ``k``
    (``m^-1/2`` of both sides on the query side, so the denominator compared with
    ``eps`` is the estimate itself); with ``gate``, the gated recurrence."""
    phi_q = random_fourier_features(q, omega, sigma=sigma) * (1.0 / omega.shape[0])
    phi_k = random_fourier_features(k, omega, sigma=sigma)
    if gate is not None:
        return gated_rfa(phi_q, phi_k, v, gate, key_mask=key_mask, method=method,
                         chunk_size=chunk_size, eps=eps)
    return kernel_attention(phi_q, phi_k, v, causal=causal, key_mask=key_mask,
                            method=method, chunk_size=chunk_size, eps=eps)[0]
