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
forms never form a cumulative product, and every decay they exponentiate is a sum of log
gates over a stretch that ends where it is used (``sum_(j < l <= t) g_l``), so every factor
is ``<= 1``, a gate of 0 (``g = -inf``) is an exact restart and nothing overflows.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .chunks import in_chunks, unchunk
from .scan import scan

__all__ = ["decay_matrix", "sum_after", "within_chunks", "gla_recurrent", "gla_chunked",
           "unit_lower_inverse", "delta_recurrent", "delta_chunked"]


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


def _outer(a, b):
    """``a^T b`` of row vectors ``a (..., f)``, ``b (..., e)``: ``(..., f, e)``."""
    return a[..., :, None] * b[..., None, :]


def _row_times(a, s):
    """``a s`` of a row vector ``a (..., f)`` and ``s (..., f, e)``: ``(..., e)``."""
    return (a[..., None, :] @ s)[..., 0, :]


def gla_recurrent(q, k, v, g, s0):
    """``S_t = diag(exp g_t) S_(t-1) + k_t^T v_t``, ``o_t = q_t S_t``, one token at a
    time: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, g)

    def token(s, qt, kt, vt, gt):
        s = xp.exp(gt)[..., :, None] * s + _outer(kt, vt)
        return s, _row_times(qt, s)

    s, out = scan(token, s0, (q, k, v, g), axis=-2)
    return out, s


def sum_after(g):
    """``sum_(l > j) g_l`` along the tokens (axis -2): the log decay from token ``j`` to
    the end of its stretch (a reversed cumulative sum, shifted: ``-inf`` gates stay exact)."""
    xp = array_namespace(g)
    rev = xp.flip(xp.cumulative_sum(xp.flip(g[..., 1:, :], axis=-2), axis=-2), axis=-2)
    return xp.concat([rev, xp.zeros_like(g[..., :1, :])], axis=-2)


def within_chunks(q, k, v, g):
    """``(W, G, A)`` inside chunks ``(..., c, .)`` of ``c = 2^L`` tokens with per-dimension
    gates: ``W_t = sum_(j <= t) (q_t * exp(sum_(j < l <= t) g_l)) . k_j v_j``, and the log
    decays ``G_t = sum_(l <= t) g_l`` (chunk start -> ``t``) and ``A_j = sum_(l > j) g_l``
    (``j`` -> chunk end).  By halving: each pair ``j < t`` is split at exactly one level
    into a left half (``j``) and a right half (``t``) that meet at the pivot ``p``, the
    left half's last token, where the decay factors as ``exp(sum_(p < l <= t) g)
    exp(sum_(j < l <= p) g)``, both ``<= 1`` and each a sum inside its own half; one
    matmul per level covers all such pairs.  The sums inside blocks of ``h`` tokens are
    built from those of ``h / 2`` by adding a neighbour block's total (no cumulative sum:
    under ``jax.jit`` each is a tree of reduce-windows, and the compile time with it)."""
    xp = array_namespace(q, k, v, g)
    c = q.shape[-2]
    out = xp.sum(q * k, axis=-1, keepdims=True) * v                  # j = t: no decay
    up, after = g, xp.zeros_like(g)      # blocks of h = 1: sum_(b <= l <= t), sum_(j < l <= e)
    h = 1
    while h < c:
        qs, ks, vs, ups, afters = (xp.reshape(x, (*x.shape[:-2], c // (2 * h), 2, h,
                                                  x.shape[-1])) for x in (q, k, v, up, after))
        to_t = xp.exp(ups[..., 1, :, :])                                     # p -> t
        to_p = xp.exp(afters[..., 0, :, :])                                  # j -> p
        a = (qs[..., 1, :, :] * to_t) @ xp.matrix_transpose(ks[..., 0, :, :] * to_p)
        add = a @ vs[..., 0, :, :]
        out = out + xp.reshape(xp.stack([xp.zeros_like(add), add], axis=-3), out.shape)
        # blocks of 2h: the right half's sums gain the left half's total, and vice versa
        left_total, right_total = ups[..., 0, -1:, :], ups[..., 1, -1:, :]
        up = xp.reshape(xp.stack([ups[..., 0, :, :], ups[..., 1, :, :] + left_total],
                                 axis=-3), g.shape)
        after = xp.reshape(xp.stack([afters[..., 0, :, :] + right_total,
                                     afters[..., 1, :, :]], axis=-3), g.shape)
        h *= 2
    return out, up, after


def gla_chunked(q, k, v, g, s0, chunk_size: int):
    """The gated recurrence by chunks of ``c`` tokens: inside a chunk query ``t`` reads
    key ``j <= t`` through ``q_t diag(D_tj) k_j^T`` (one gate per token: the
    :func:`decay_matrix` mask on ``Q K^T``; per key dimension: :func:`within_chunks`,
    ``c`` rounded up to a power of 2); the state entering the chunk reaches ``t`` through
    ``exp(G_t)``, ``G_t = sum_(l <= t) g_l`` from the chunk start, and leaves it decayed by
    ``exp(G_c)``: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, g)
    n, per_dim = q.shape[-2], g.shape[-1] != 1
    c = min(chunk_size, max(n, 1))
    c = 2 ** (c - 1).bit_length() if per_dim else c
    qc, kc, vc, gc = (in_chunks(x, c) for x in (q, k, v, g))
    if per_dim:
        within, up, after = within_chunks(qc, kc, vc, gc)
        into, to_end = xp.exp(up), xp.exp(after)
    else:
        d = decay_matrix(gc)[..., 0]
        within = ((qc @ xp.matrix_transpose(kc)) * d) @ vc
        # the state -> t is the first key's gate then D's first column (two factors <= 1),
        # a key -> the chunk end D's last row: no cumulative sum beside D's
        into = xp.exp(gc[..., :1, :]) * d[..., :, :1]
        to_end = xp.matrix_transpose(d[..., -1:, :])
    upd = xp.matrix_transpose(kc * to_end) @ vc                     # keys -> chunk end

    def chunk(s, q_i, into_i, upd_i):
        return xp.matrix_transpose(into_i[..., -1:, :]) * s + upd_i, (q_i * into_i) @ s

    s, across = scan(chunk, s0, (qc, into, upd), axis=-3)
    return unchunk(within + across, n), s


def delta_recurrent(q, k, v, beta, g, s0):
    """``S_t = exp(g_t) (I - beta_t k_t^T k_t) S_(t-1) + beta_t k_t^T v_t``, i.e. the
    memory at key ``k_t`` moved a fraction ``beta_t`` towards ``v_t``: ``(O, S_n)``."""
    xp = array_namespace(q, k, v, beta, g)

    def token(s, qt, kt, vt, bt, gt):
        s = xp.exp(gt)[..., None] * s
        s = s + _outer(kt, bt * (vt - _row_times(kt, s)))
        return s, _row_times(qt, s)

    s, out = scan(token, s0, (q, k, v, beta[..., None], g), axis=-2)
    return out, s


def unit_lower_inverse(a):
    """``(I + A)^(-1)`` of a strictly lower triangular ``A (..., c, c)``, by forward
    substitution one row at a time (fla's UT transform): with the rows ``< i`` of
    ``T = (I + A)^(-1)`` known, ``T_i = e_i - A_i T``.  A unit triangular matrix needs no
    pivoting; ``linalg.solve`` would lower to a pivoted LU and a permutation loop under
    ``jax.jit``, this to one loop over the ``c`` rows."""
    xp = array_namespace(a)
    eye = xp.eye(a.shape[-1], dtype=a.dtype, device=device(a))

    def row(t, i):                            # rows >= i of t are still 0
        e_i = eye[i, :]
        return t + e_i[:, None] * (e_i - _row_times(a[..., i, :], t))[..., None, :], None

    t, _ = scan(row, xp.zeros_like(a), (range(a.shape[-1]),), axis=0)
    return t


def delta_chunked(q, k, v, beta, g, s0, chunk_size: int):
    """The delta rule by chunks (Yang et al. 2024's WY/UT form, with gates): inside a
    chunk with decays ``Gam = D_tj`` the updates are ``U = T (V - diag(exp G) K S_0) =
    u - w S_0`` with ``u = T V``, ``w = T diag(exp G) K`` (fla's ``u`` and ``w``),
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
    t = unit_lower_inverse(bc * strict) * xp.matrix_transpose(bc)
    qk = (qc @ xp.matrix_transpose(kc)) * gam
    into = xp.exp(gc[..., :1, :]) * gam[..., :, :1]                 # as in gla_chunked
    to_end = xp.matrix_transpose(gam[..., -1:, :])                  # (..., nc, c, 1)
    u, w = t @ vc, t @ (kc * into)

    def chunk(s, q_i, k_i, u_i, w_i, qk_i, into_i):
        u_i = u_i - w_i @ s                                         # U
        out = (q_i * into_i) @ s + qk_i @ u_i
        return into_i[..., -1:, :] * s + xp.matrix_transpose(k_i) @ u_i, out

    s, out = scan(chunk, s0, (qc, kc * to_end, u, w, qk, into), axis=-3)
    return unchunk(out, n), s
