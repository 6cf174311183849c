r"""Backward of Reformer's LSH attention (Kitaev, Kaiser & Levskaya 2020), dense and chunked.

**The rounds as one softmax.**  With :math:`x = qk` (masked rows zeroed), queries
:math:`q_i = \mathrm{scale}\, x_i`, unit keys :math:`k_j = x_j / \lVert x_j \rVert` and
logits :math:`s_{ij} = q_i \cdot k_j - \log N_{ij}`, round :math:`r` attends over its
allowed pairs :math:`\mathcal{P}^{(r)}_i` and gives :math:`(o^{(r)}_i, z^{(r)}_i)`; the
merge :math:`o_i = \sum_r e^{z^{(r)}_i - z_i} o^{(r)}_i`, :math:`z_i = \log \sum_r
e^{z^{(r)}_i}` is one softmax over the pairs :math:`(r, j)`:
:math:`o_i = \sum_{r, j \in \mathcal{P}^{(r)}_i} P^{(r)}_{ij} v_j` with
:math:`P^{(r)}_{ij} = e^{s_{ij} - z_i}`.  So FlashAttention-2's equations hold with the
*merged* log-sum-exp :math:`z_i` in every round's tiles (the merge's own backward -- the
weights :math:`\operatorname{softmax}_r(z^{(r)}_i)` and their :math:`d z^{(r)}` terms --
is folded into :math:`D_i`):

.. math::

    D_i = dO_i \cdot o_i, \qquad
    dS^{(r)}_{ij} = P^{(r)}_{ij}\,(dO_i \cdot v_j - D_i),

    dq_i = \sum_{r, j} dS^{(r)}_{ij}\, k_j, \qquad
    dk_j = \sum_{r, i} dS^{(r)}_{ij}\, q_i, \qquad
    dv_j = \sum_{r, i} P^{(r)}_{ij}\, dO_i \;+\; [\text{no key for } j]\, dO_j,

the last term for a token with no key in any round (it returns its own value).
:math:`\log N_{ij}` is a constant: the buckets are constants of the forward
(``argmax`` is piecewise constant, so the rotations -- drawn or the caller's -- get no
cotangent).  **Shared QK**: queries and keys are both functions of :math:`x`, and the
unit key's chain rule is

.. math::

    dx_i = \mathrm{scale}\; dq_i + \frac{dk_i - k_i\,(k_i \cdot dk_i)}{\lVert x_i \rVert}

(a zero row of :math:`x`, where the norm is not differentiable, takes :math:`dx_i = dk_i`,
the branch the forward computes).  Masked tokens' rows get exactly zero.

:func:`lsh_attention_vjp` is the dense form (``O(H n^2)``).
:func:`lsh_attention_chunked_vjp` follows the chunked forward: per round, the sorted
chunks and their look-back windows (:class:`~arrayattn.reference.lsh.SortedRound`),
each block of chunks a masked exact-attention tile
(:func:`~arrayattn.reference.exact_vjp.tile_backward`); a key's gradient from the
look-back half of chunk ``c + 1`` is added to its own chunk ``c``, and the sort undone.
Memory ``O(n (d + dv))`` per round plus the tiles.
"""
from __future__ import annotations

from array_api_compat import array_namespace
from array_api_compat import device as xp_device

from .exact_vjp import tile_backward
from .logits import Logits
from .lsh import SortedRound, lsh_inputs, lsh_pattern, lsh_rounds
from .rows import unit_rows, unit_rows_vjp
from .scan import scan
from .masks import softmax_lse, zero_masked_keys

__all__ = ["lsh_attention_vjp", "lsh_attention_chunked_vjp"]


def lsh_attention_vjp(qk, v, do, rotations, *, num_buckets: int, chunk_size: int,
                      scale: float, causal: bool = False, key_mask=None, dedup: bool = True):
    """``{"qk", "v"}`` of the dense form :func:`~arrayattn.reference.lsh.lsh_attention`
    (memory ``O(H n^2)``), by the equations above."""
    xp = array_namespace(qk, v, do)
    x, vz = zero_masked_keys(key_mask, qk, v)
    allowed, rounds = lsh_pattern(x, rotations, num_buckets=num_buckets,
                                  chunk_size=chunk_size, causal=causal, key_mask=key_mask)
    k = unit_rows(x)[0]
    q = x * scale
    scores = q @ xp.matrix_transpose(k)
    if dedup:
        scores = scores - xp.log(xp.maximum(rounds, 1.0))
    _, z_r = softmax_lse(scores[..., None, :, :], allowed)                 # (..., H, n)
    _, z = softmax_lse(xp.matrix_transpose(z_r))                           # (..., n)
    has_key = xp.isfinite(z)
    visible = allowed & has_key[..., None, :, None]
    shifted = scores[..., None, :, :] - xp.where(has_key, z, 0.0)[..., None, :, None]
    p = xp.sum(xp.exp(xp.where(visible, shifted, -xp.inf)), axis=-3)      # sum_r P^(r)
    delta = xp.sum(do * (p @ vz), axis=-1, keepdims=True)
    ds = p * (do @ xp.matrix_transpose(vz) - delta)
    dv = xp.matrix_transpose(p) @ do + xp.where(has_key[..., None], 0.0, do)
    dx = scale * (ds @ k) + unit_rows_vjp(x, xp.matrix_transpose(ds) @ q)
    return {"qk": dx, "v": dv} if key_mask is None else dict(
        zip(("qk", "v"), zero_masked_keys(key_mask, dx, dv)))


def _fold(xp, w, C: int):
    """The adjoint of the look-back window: ``(nc, B, 2C, f) -> (nc, B, C, f)``, a slot's
    own half plus its copy in the next chunk's look-back half."""
    zero = xp.zeros((1, *w.shape[1:-2], C, w.shape[-1]), dtype=w.dtype, device=xp_device(w))
    return w[..., C:, :] + xp.concat([w[1:, ..., :C, :], zero], axis=0)


def _split(xp, w, dims):
    """The column groups of ``w (..., sum(dims))``, widths ``dims``."""
    ends = [sum(dims[:i + 1]) for i in range(len(dims))]
    return tuple(w[..., e - c:e] for c, e in zip(dims, ends))


def lsh_attention_chunked_vjp(qk, v, do, rotations, *, num_buckets: int, chunk_size: int,
                              scale: float, causal: bool = False, key_mask=None,
                              dedup: bool = True):
    """``{"qk", "v"}`` of :func:`~arrayattn.reference.lsh.lsh_attention_chunked`, round
    by round on its sorted chunks (shapes at the broadcast batch)."""
    xp = array_namespace(qk, v, do)
    batch, x, vz, buckets = lsh_inputs(qk, v, rotations, num_buckets=num_buckets,
                                       key_mask=key_mask)
    B, H, n = buckets.shape
    C, dev = chunk_size, xp_device(x)
    do3 = xp.reshape(xp.broadcast_to(do, (*batch, *do.shape[-2:])), (B, n, do.shape[-1]))
    out, z = lsh_rounds(x, vz, buckets, num_buckets=num_buckets, chunk_size=C, scale=scale,
                        causal=causal, dedup=dedup)
    delta = xp.sum(do3 * out, axis=-1)                                     # D = rowsum(dO O)
    q, k = x * scale, unit_rows(x)[0]
    every = buckets if dedup and H > 1 else None                           # for N_ij

    # Every per-token row, gathered into the windows together: q | k | v | dO | z | D.
    dims = (x.shape[-1], x.shape[-1], vz.shape[-1], do3.shape[-1], 1, 1)
    rows = xp.concat([q, k, vz, do3, z[..., None], delta[..., None]], axis=-1)

    def one_round(grads, bucket):
        rd = SortedRound(xp, bucket, every, C=C, nb=num_buckets, causal=causal, device=dev)

        def block(w, labels):
            q_b, k_b, v_b, do_b, z_b, d_b = _split(xp, w, dims)
            q_b, do_b, z_b, d_b = (y[..., C:, :] for y in (q_b, do_b, z_b, d_b))  # own chunk
            allowed, rounds = rd.mask(labels)
            lg = Logits(scale=1.0, mask=allowed, bias=None if rounds is None else
                        -xp.log(xp.maximum(xp.astype(rounds, x.dtype), 1.0)))
            pz, _, dsr, kj, qi = tile_backward(lg, q_b, k_b, v_b, do_b, d_b[..., 0],
                                               z_b[..., 0], None, 0, C, 0, 2 * C)
            return dsr @ kj, xp.matrix_transpose(dsr) @ qi, xp.matrix_transpose(pz) @ do_b

        dq_c, dk_w, dv_w = rd.over_blocks(block, (rd.windows(rows), rd.labels))
        dq, dk, dv = grads
        return (dq + rd.unsort(dq_c), dk + rd.unsort(_fold(xp, dk_w, C)),
                dv + rd.unsort(_fold(xp, dv_w, C))), None

    (dq, dk, dv), _ = scan(one_round, (xp.zeros_like(x), xp.zeros_like(x), xp.zeros_like(vz)),
                           (buckets,), axis=1)
    dv = dv + xp.where(xp.isfinite(z)[..., None], 0.0, do3)  # no key: o_i = v_i
    dx = scale * dq + unit_rows_vjp(x, dk)
    dx = xp.reshape(dx, (*batch, n, dx.shape[-1]))
    dv = xp.reshape(dv, (*batch, n, dv.shape[-1]))
    return {"qk": dx, "v": dv} if key_mask is None else dict(
        zip(("qk", "v"), zero_masked_keys(key_mask, dx, dv)))
