r"""Backward of the decay-gated family (retention, GLA, SSD): the vector-Jacobian products
of :func:`~arrayattn.reference.gla_recurrent` and :func:`~arrayattn.reference.gla_chunked`.

Forward, with row vectors ``q_t, k_t (1, dk)``, ``v_t, o_t (1, dv)``, the state
``S (dk, dv)`` and the gates ``a_t = exp(g_t)`` (one per key dimension, or one per token
broadcast over them):

.. math::

    S_t = \operatorname{diag}(a_t) S_{t-1} + k_t^\top v_t, \qquad o_t = q_t S_t,
    \qquad t = 1 \dots n .

Backward, with the output cotangent :math:`do_t` and the cotangent :math:`\bar S_n` of
the returned final state (0 when only the output is differentiated).  The reverse state
:math:`dS_t = \partial L / \partial S_t` runs backwards in time,

.. math::

    dS_t = q_t^\top do_t + \operatorname{diag}(a_{t+1})\, dS_{t+1},
    \qquad dS_n = q_n^\top do_n + \bar S_n,

and the gradients are

.. math::

    dq_t = do_t S_t^\top, \quad dk_t = v_t\, dS_t^\top, \quad dv_t = k_t\, dS_t, \quad
    dS_0 = \operatorname{diag}(a_1)\, dS_1,

    dg_t = a_t \odot \operatorname{rowsum}(S_{t-1} \odot dS_t)
    \quad (\text{a } d_k\text{-vector; one gate per token: its sum}).

**The gate gradient without the states** (fla's reverse cumulative sum).  Let
:math:`X_t = \operatorname{rowsum}(S_t \odot dS_t)`.  Expanding :math:`S_t` by the forward
recurrence, and :math:`dS_t` by the backward one,

.. math::

    X_t = dg_t + k_t \odot dk_t, \qquad X_t = q_t \odot dq_t + dg_{t+1},
    \qquad dg_{n+1} := \operatorname{rowsum}(S_n \odot \bar S_n),

(``rowsum(k_t^T v_t * dS_t) = k_t * (v_t dS_t^T)``,
``rowsum(q_t^T do_t * S_t) = q_t * (do_t S_t^T)``, and
``rowsum(S_t * diag(a_(t+1)) dS_(t+1)) = dg_(t+1)`` by the definition), so

.. math::

    dg_t = q_t \odot dq_t - k_t \odot dk_t + dg_{t+1}
         = \sum_{l \ge t} (q_l \odot dq_l - k_l \odot dk_l)
           + \operatorname{rowsum}(S_n \odot \bar S_n):

exact algebra, needing only ``dq`` and ``dk``.  A gate of 0 (``g_t = -inf``) has
``dg_t = a_t (...) = 0``; the sum gives that only to rounding, so those entries are set to
an exact 0 (which also restarts the sum there).  ``q`` and ``k`` here are the working
ones (``q`` scaled, masked keys zeroed); the adapters chain back through the scale and
the masks.

**Chunked.** Inside a chunk of ``c`` tokens, with log-gate sums from the chunk start
:math:`G_t = \sum_{l \le t} g_l` and the decays :math:`\text{in}_t = e^{G_t}` (state ->
token ``t``), :math:`\text{out}_j = e^{\sum_{l > j} g_l}` (token ``j`` -> chunk end),
:math:`\Gamma = e^{G_c}` and :math:`D_{tj} = e^{\sum_{j < l \le t} g_l}` (``j <= t``), the
forward is :math:`O = \text{within} + (Q \odot \text{in}) S_0`,
:math:`S_c = \operatorname{diag}(\Gamma) S_0 + (K \odot \text{out})^\top V`.  Its backward,
with the state :math:`S_0` entering the chunk (a forward scan over the chunks) and the
cotangent :math:`dH` of the state leaving it (a reverse scan), is

.. math::

    dQ = [(dP \odot D) K]_{\text{within}} + (dO\, S_0^\top) \odot \text{in},\quad
    dK = [(dP \odot D)^\top Q]_{\text{within}} + (V\, dH^\top) \odot \text{out},

    dV = [A^\top dO]_{\text{within}} + (K \odot \text{out})\, dH,\quad
    dS_0 = \operatorname{diag}(\Gamma)\, dH + (Q \odot \text{in})^\top dO,

with :math:`dP = dO\, V^\top` and :math:`A = (Q K^\top) \odot D`, both restricted to
``j <= t`` (one gate per token: ``D`` is a ``c x c`` matrix; per key dimension the
``within`` terms are summed by :func:`within_chunks_vjp`'s halving, each pair's decay a
product of two sums inside halves, as the forward).  Then
``dg = sum_(l >= t) (Q dQ - K dK)``: a reverse cumulative sum inside each chunk plus the
totals of the later chunks.  Memory: ``O(n (d + dv))`` plus ``c x c`` per chunk (per key
dimension ``O(n d)`` per halving level) and one ``dk x dv`` state per scan; no
``n x n`` matrix, no state per chunk is kept.  Every decay exponentiated is a sum of log
gates ``<= 0`` over a stretch, as in the forward.

**NaN gates.**  Called directly, these forms differentiate what they are given: a NaN
gate at token ``t`` leaves ``dq`` before ``t`` and ``dk``, ``dv`` from ``t`` on as they
are (nothing of them passes through ``g_t``) and makes every other gradient NaN.  The
public vjp follows the forward's rule instead (:mod:`arrayattn.reference.finite`): such a
token (or one with a non-finite key or value) is dropped before these forms run, ``dq`` of
the rows that see it is NaN and every other gradient of that batch element is NaN.

Array API only, no host reads, no in-place updates; the loops over tokens and chunks are
:func:`~arrayattn.reference.scan.scan` (``jax.lax.scan`` on JAX).
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .chunks import in_chunks
from .gated import decay_matrix, sum_after
from .scan import scan

__all__ = ["gla_recurrent_vjp", "gla_chunked_vjp", "within_chunks_vjp"]


def _t(x):
    return array_namespace(x).matrix_transpose(x)


def _states(q, k, v, g, s0, do, ds_n):
    """``S_0`` and ``dS_n`` broadcast to the batch of every input, ``(..., dk, dv)``."""
    xp = array_namespace(q, k, v, g, s0, do)
    batch = tuple(xp.broadcast_arrays(*(x[..., :1, :1] for x in (q, k, v, g, s0, do)))[0]
                  .shape[:-2])
    shape = (*batch, q.shape[-1], v.shape[-1])
    s0 = xp.broadcast_to(s0, shape)
    if ds_n is None:
        return s0, xp.zeros(shape, dtype=q.dtype, device=device(q))
    return s0, xp.broadcast_to(ds_n, shape)


def _gate_grad(xp, dg, g):
    """``dg`` (per key dimension) where the gate is not 0 (``d exp(g)/dg = 0`` at
    ``g = -inf``), summed over the dimensions for one gate per token."""
    dg = xp.where(g == -xp.inf, 0.0, dg)
    return dg if g.shape[-1] != 1 else xp.sum(dg, axis=-1, keepdims=True)


def gla_recurrent_vjp(q, k, v, g, s0, do, ds_n=None):
    """``{"q", "k", "v", "g", "initial_state"}`` of :func:`gla_recurrent`, one token at a
    time: a forward scan for ``S_t`` and ``dq_t = do_t S_t^T``, then a reverse scan for
    ``dS_t``, ``dk_t``, ``dv_t`` and ``dg_t = q_t dq_t - k_t dk_t + dg_(t+1)``.  ``g`` is
    ``(..., n, 1)`` or ``(..., n, dk)``; ``ds_n`` the final state's cotangent (optional).
    Memory ``O(n (dk + dv))`` and one state."""
    xp = array_namespace(q, k, v, g, s0, do)
    s0, ds_n = _states(q, k, v, g, s0, do, ds_n)
    a = xp.exp(g)

    def forward(s, kt, vt, at, dot):
        s = at[..., :, None] * s + kt[..., :, None] * vt[..., None, :]
        return s, (dot[..., None, :] @ _t(s))[..., 0, :]                 # dq_t = do_t S_t^T

    s_n, dq = scan(forward, s0, (k, v, a, do), axis=-2)

    def backward(carry, qt, kt, vt, at, gt, dot, dqt):
        ds, dg_next = carry                               # diag(a_(t+1)) dS_(t+1), dg_(t+1)
        ds = ds + qt[..., :, None] * dot[..., None, :]                   # dS_t
        dkt = (vt[..., None, :] @ _t(ds))[..., 0, :]                     # v_t dS_t^T
        dvt = (kt[..., None, :] @ ds)[..., 0, :]                         # k_t dS_t
        dgt = xp.where(gt == -xp.inf, 0.0, qt * dqt - kt * dkt + dg_next)
        return (at[..., :, None] * ds, dgt), (dkt, dvt, dgt)

    (ds0, _), (dk, dv, dg) = scan(backward, (ds_n, xp.sum(s_n * ds_n, axis=-1)),
                                  (q, k, v, a, g, do, dq), axis=-2, reverse=True)
    return {"q": dq, "k": dk, "v": dv, "g": _gate_grad(xp, dg, g), "initial_state": ds0}


def within_chunks_vjp(q, k, v, g, do):
    """``(dq, dk, dv)`` of :func:`~arrayattn.reference.within_chunks` (chunks of ``c =
    2^L`` tokens, per-dimension gates), by the same halving: at each level the pairs
    ``j < t`` of a left half (keys) and a right half (queries) meet at the pivot ``p``
    with ``D_tj = R_t L_j``, ``R_t = exp(sum_(p < l <= t) g)``,
    ``L_j = exp(sum_(j < l <= p) g)``; with ``dP = dO_right V_left^T`` and
    ``A = (Q R)(K L)^T``: ``dQ_right += R (dP (K L))``, ``dK_left += L (dP^T (Q R))``,
    ``dV_left += A^T dO_right``."""
    xp = array_namespace(q, k, v, g, do)
    c = q.shape[-2]
    dp = xp.sum(do * v, axis=-1, keepdims=True)                      # j = t: no decay
    dq, dk, dv = dp * k, dp * q, xp.sum(q * k, axis=-1, keepdims=True) * do
    h = c // 2
    while h >= 1:
        qs, ks, vs, gs, dos = (xp.reshape(x, (*x.shape[:-2], c // (2 * h), 2, h,
                                              x.shape[-1])) for x in (q, k, v, g, do))
        to_t = xp.exp(xp.cumulative_sum(gs[..., 1, :, :], axis=-2))          # p -> t
        to_p = xp.exp(sum_after(gs[..., 0, :, :]))                          # j -> p
        qr, kl = qs[..., 1, :, :] * to_t, ks[..., 0, :, :] * to_p
        dpt = dos[..., 1, :, :] @ _t(vs[..., 0, :, :])                      # (.., t, j)
        right = to_t * (dpt @ kl)                                            # dq_t
        left_k = to_p * (_t(dpt) @ qr)                                       # dk_j
        left_v = _t(qr @ _t(kl)) @ dos[..., 1, :, :]                         # dv_j
        zq, zk, zv = (xp.zeros_like(x) for x in (right, left_k, left_v))
        dq = dq + xp.reshape(xp.stack([zq, right], axis=-3), dq.shape)
        dk = dk + xp.reshape(xp.stack([left_k, zk], axis=-3), dk.shape)
        dv = dv + xp.reshape(xp.stack([left_v, zv], axis=-3), dv.shape)
        h //= 2
    return dq, dk, dv


def _within_token_gates_vjp(q, k, v, g, do):
    """``(dq, dk, dv)`` of the within-chunk term ``((Q K^T) * D) V`` with one gate per
    token, ``D = decay_matrix(g)`` (``c x c`` per chunk); the pairs ``j > t`` are
    selected out before any product."""
    xp = array_namespace(q, k, v, g, do)
    c = q.shape[-2]
    d = decay_matrix(g)[..., 0]
    lower = xp.tril(xp.ones((c, c), dtype=xp.bool, device=device(q)))
    a = xp.where(lower, (q @ _t(k)) * d, 0.0)
    ds = xp.where(lower, (do @ _t(v)) * d, 0.0)
    return ds @ k, _t(ds) @ q, _t(a) @ do


def gla_chunked_vjp(q, k, v, g, s0, do, chunk_size: int, ds_n=None):
    """``{"q", "k", "v", "g", "initial_state"}`` of :func:`gla_chunked`, by the chunked
    equations above (the same chunk size as the forward: ``c = min(chunk_size, n)``,
    rounded up to a power of 2 for per-dimension gates).  Memory ``O(n (dk + dv) + dk
    dv)`` plus ``c x c`` per chunk."""
    xp = array_namespace(q, k, v, g, s0, do)
    n, per_dim = q.shape[-2], g.shape[-1] != 1
    c = min(chunk_size, max(n, 1))
    c = 2 ** (c - 1).bit_length() if per_dim else c
    s0, ds_n = _states(q, k, v, g, s0, do, ds_n)
    qc, kc, vc, gc, doc = (in_chunks(x, c) for x in (q, k, v, g, do))
    within = within_chunks_vjp if per_dim else _within_token_gates_vjp
    dq, dk, dv = within(qc, kc, vc, gc, doc)
    into = xp.exp(xp.cumulative_sum(gc, axis=-2))                   # state -> token t
    out = xp.exp(sum_after(gc))                                     # token j -> chunk end
    kout = kc * out

    def forward(s, do_i, into_i, kout_i, v_i):                  # S_0 of each chunk -> dQ
        dq_i = (do_i @ _t(s)) * into_i
        return _t(into_i[..., -1:, :]) * s + _t(kout_i) @ v_i, dq_i

    s_n, dq_state = scan(forward, s0, (doc, into, kout, vc), axis=-3)

    def backward(dh, q_i, do_i, into_i, out_i, kout_i, v_i):    # dH of each chunk -> dK, dV
        grads = ((v_i @ _t(dh)) * out_i, kout_i @ dh)
        return _t(into_i[..., -1:, :]) * dh + _t(q_i * into_i) @ do_i, grads

    ds0, (dk_state, dv_state) = scan(backward, ds_n, (qc, doc, into, out, kout, vc),
                                     axis=-3, reverse=True)
    dq, dk, dv = dq + dq_state, dk + dk_state, dv + dv_state
    # dg_t = sum_(l >= t) (q_l dq_l - k_l dk_l): inside the chunk, then the later chunks
    w = qc * dq - kc * dk
    w = w if per_dim else xp.sum(w, axis=-1, keepdims=True)
    inside = xp.flip(xp.cumulative_sum(xp.flip(w, axis=-2), axis=-2), axis=-2)
    later = sum_after(inside[..., 0, :])[..., None, :]
    end = xp.sum(s_n * ds_n, axis=-1)[..., None, None, :]
    dg = inside + later + (end if per_dim else xp.sum(end, axis=-1, keepdims=True))

    def whole(x):
        return xp.reshape(x, (*x.shape[:-3], x.shape[-3] * c, x.shape[-1]))[..., :n, :]

    return {"q": whole(dq), "k": whole(dk), "v": whole(dv),
            "g": _gate_grad(xp, whole(dg), g), "initial_state": ds0}
