r"""Reference forms: decay-gated and delta-rule linear attention.

.. math::

    \text{gated:}\quad S_t = \operatorname{diag}(\alpha_t)\, S_{t-1} + k_t^\top v_t,
    \qquad
    \text{delta:}\quad S_t = \alpha_t (I - \beta_t k_t^\top k_t)\, S_{t-1}
                             + \beta_t k_t^\top v_t,
    \qquad o_t = q_t S_t

with row vectors ``q_t, k_t (1, dk)``, ``v_t (1, dv)`` and the state ``S (dk, dv)``.
GLA has one ``alpha`` per key dimension; RetNet's retention (a constant scalar ``alpha``
per head) and Mamba-2's SSD (a scalar per head and token) are GLA with one gate per token
(``g (..., n, 1)``), so one recurrence and one chunked form serve all three;
DeltaNet (``alpha = 1``) and gated DeltaNet the delta rule.  Gates are given in log space,
``g = log alpha <= 0``, shaped ``(..., n, dk)`` or ``(..., n, 1)`` (one per token).

Each has its recurrence (one token at a time, as fla's ``naive.py`` files) and a chunked
form: quadratic inside a chunk of ``c`` tokens, the state between chunks.  The chunked
forms never form a cumulative product: the decay from key ``j`` to query ``t`` is
``exp(sum_(j < l <= t) g_l)``, a masked sum per pair inside a chunk, so every factor is
``<= 1``, a gate of 0 (``g = -inf``) is an exact restart and nothing overflows.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

__all__ = ["decay_matrix", "gla_recurrent", "gla_chunked", "delta_recurrent",
           "delta_chunked", "in_chunks"]


def in_chunks(x, c: int):
    """``x (..., n, f)`` zero-padded to whole chunks, as ``(..., n/c, c, f)``."""
    xp = array_namespace(x)
    pad = -x.shape[-2] % c
    x = xp.concat([x, xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype,
                               device=device(x))], axis=-2)
    return xp.reshape(x, (*x.shape[:-2], x.shape[-2] // c, c, x.shape[-1]))


def decay_matrix(g):
    """``D[..., t, j, :] = exp(sum_(j < l <= t) g_l)`` for ``j <= t``, else 0, from
    ``g (..., c, f)``: ``(..., c, c, f)``.  The masked cumulative sum runs down each
    column, so a decay near 1 is not the difference of two large prefix sums."""
    xp = array_namespace(g)
    c = g.shape[-2]
    below = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(g)), k=-1)[..., None]
    seg = xp.cumulative_sum(xp.where(below, g[..., :, None, :], 0.0), axis=-3)
    # mask last: a NaN gate of a later token must not reach earlier rows through 0 * NaN
    return xp.where(below | xp.eye(c, dtype=xp.bool, device=device(g))[..., None],
                    xp.exp(seg), 0.0)


def _token(xp, t, *arrays):
    idx = xp.asarray([t], device=device(arrays[0]))   # eager JAX compiles one step, not n
    return [xp.take(x, idx, axis=-2) for x in arrays]


def gla_recurrent(q, k, v, g, s0):
    """``S_t = diag(exp g_t) S_(t-1) + k_t^T v_t``, ``o_t = q_t S_t``, one token at a
    time: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, g)
    s, out = s0, []
    for t in range(q.shape[-2]):
        qt, kt, vt, gt = _token(xp, t, q, k, v, g)
        s = xp.exp(xp.matrix_transpose(gt)) * s + xp.matrix_transpose(kt) @ vt
        out.append(qt @ s)
    return xp.concat(out, axis=-2), s


def gla_chunked(q, k, v, g, s0, chunk_size: int):
    """The gated recurrence by chunks of ``c`` tokens: inside a chunk query ``t`` reads
    key ``j <= t`` through ``q_t diag(D_tj) k_j^T`` (:func:`decay_matrix`); the state
    entering the chunk reaches ``t`` through ``exp(G_t)``, ``G_t = sum_(l <= t) g_l``
    from the chunk start, and leaves it decayed by ``exp(G_c)``: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, g)
    n = q.shape[-2]
    qc, kc, vc, gc = (in_chunks(x, min(chunk_size, max(n, 1))) for x in (q, k, v, g))
    d = decay_matrix(gc)                                            # (..., nc, c, c, f)
    if gc.shape[-1] == 1:     # one gate per token: a (c, c) decay mask on q k^T
        a = (qc @ xp.matrix_transpose(kc)) * d[..., 0]
    else:                     # one gate per key dimension: sum over it per pair
        a = xp.sum(qc[..., :, None, :] * kc[..., None, :, :] * d, axis=-1)
    within = a @ vc
    into = xp.exp(xp.cumulative_sum(gc, axis=-2))                   # state -> query t
    upd = xp.matrix_transpose(kc * d[..., -1, :, :]) @ vc           # keys -> chunk end
    s, out = s0, []
    for i in range(qc.shape[-3]):
        out.append(within[..., i, :, :] + (qc[..., i, :, :] * into[..., i, :, :]) @ s)
        s = xp.matrix_transpose(into[..., i, -1:, :]) * s + upd[..., i, :, :]
    return xp.concat(out, axis=-2)[..., :n, :], s


def delta_recurrent(q, k, v, beta, g, s0):
    """``S_t = exp(g_t) (I - beta_t k_t^T k_t) S_(t-1) + beta_t k_t^T v_t``, i.e. the
    memory at key ``k_t`` moved a fraction ``beta_t`` towards ``v_t``: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, beta, g)
    s, out = s0, []
    for t in range(q.shape[-2]):
        qt, kt, vt, bt, gt = _token(xp, t, q, k, v, beta[..., None], g)
        s = xp.exp(gt) * s
        s = s + xp.matrix_transpose(kt) @ (bt * (vt - kt @ s))
        out.append(qt @ s)
    return xp.concat(out, axis=-2), s


def delta_chunked(q, k, v, beta, g, s0, chunk_size: int):
    """The delta rule by chunks (Yang et al. 2024's WY/UT form, with gates): inside a
    chunk with decays ``Gam = D_tj`` the updates are ``U = T (V - diag(exp G) K S_0)``,
    ``T = (I + diag(beta) strict_tril(K K^T) * Gam)^(-1) diag(beta)``; then
    ``O = diag(exp G) Q S_0 + (tril(Q K^T) * Gam) U`` and
    ``S_c = exp(G_c) S_0 + (K * Gam_c)^T U``: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, beta, g)
    n = q.shape[-2]
    c = min(chunk_size, max(n, 1))
    qc, kc, vc, bc, gc = (in_chunks(x, c) for x in (q, k, v, beta[..., None], g))
    gam = decay_matrix(gc)[..., 0]                                  # (..., nc, c, c)
    eye = xp.eye(c, dtype=q.dtype, device=device(q))
    strict = (kc @ xp.matrix_transpose(kc)) * gam * (1.0 - eye)
    t = xp.linalg.solve(eye + bc * strict, eye * xp.matrix_transpose(bc))
    qk = (qc @ xp.matrix_transpose(kc)) * gam
    into = xp.exp(xp.cumulative_sum(gc, axis=-2))                   # (..., nc, c, 1)
    s, out = s0, []
    for i in range(qc.shape[-3]):
        u = t[..., i, :, :] @ (vc[..., i, :, :] - (kc[..., i, :, :] * into[..., i, :, :]) @ s)
        out.append((qc[..., i, :, :] * into[..., i, :, :]) @ s + qk[..., i, :, :] @ u)
        s = into[..., i, -1:, :] * s + xp.matrix_transpose(
            kc[..., i, :, :] * xp.matrix_transpose(gam[..., i, -1:, :])) @ u
    return xp.concat(out, axis=-2)[..., :n, :], s
