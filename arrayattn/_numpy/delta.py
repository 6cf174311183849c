"""The NumPy engine of the chunked delta rule (DeltaNet, gated DeltaNet): the reference
form :func:`arrayattn.reference.delta_chunked` (the WY/UT form of Yang et al. 2024) with
the same maths, laid out for NumPy on a CPU.

The reference form is written for ``jax.jit`` (a :func:`~arrayattn.reference.scan` over
the chunks; ``(I + A)^-1`` by a scan over its rows that adds a whole ``(c, c)`` matrix per
row).  Here:

* ``T = (I + A)^-1`` by forward substitution written in place, one row block at a time
  (``T_i = e_i - A_(i, <i) T_(<i)``): 1.3 ms against 10 ms for the reference's scan at
  ``(1, 8, 4096/16)`` chunks of 16;
* without gates (DeltaNet: every ``g = 0``, read on the host) the decays are the constant
  lower triangle of ones: no decay matrix, no scaled copies of ``q`` and ``k``;
* the loop over chunks makes one product per chunk for both ``w_i S`` and
  ``(q_i * into_i) S`` (stacked rows, laid out before the loop), updates ``u`` in place
  and writes each chunk's output into the result; the gate scalings of the chunk's keys
  are made on the chunk, not as whole ``(n, d)`` copies (a fresh 8 MB temporary costs
  ~2.5 ms of page faults here).

Measured (2 cores, (1, 8, 4096, 64) float32, chunks of 16, the registry's calls;
``benchmarks/regress.py`` against e6332e9, 3 interleaved rounds, load ~5, best-of): DeltaNet
35.6 ms causal / 36.8 ms plain against 45.9 / 46.1 ms (paired 0.79-0.80), gated DeltaNet
44.0 / 44.0 ms against 50.1 / 50.1 ms (paired 0.86-0.87); the chunked core alone, before
the engine, ran 1.056x e6332e9's (issue #39).
"""
from __future__ import annotations

import numpy as np

from ..reference.chunks import in_chunks, unchunk

__all__ = ["unit_lower_inverse", "delta_chunked"]


def unit_lower_inverse(a: np.ndarray) -> np.ndarray:
    """``(I + A)^-1`` of a strictly lower triangular ``A (..., c, c)`` (the reference's
    :func:`~arrayattn.reference.unit_lower_inverse`), by forward substitution in place."""
    c = a.shape[-1]
    t = np.zeros(a.shape, dtype=a.dtype)
    diag = np.arange(c)
    t[..., diag, diag] = 1.0
    for i in range(1, c):     # rows < i of T are known, and zero right of the diagonal
        np.matmul(a[..., i:i + 1, :i], t[..., :i, :i], out=t[..., i:i + 1, :i])
        np.negative(t[..., i:i + 1, :i], out=t[..., i:i + 1, :i])
    return t


def _decays(g, strict):
    """:func:`~arrayattn.reference.decay_matrix` of scalar log gates ``g (..., nc, c)``:
    ``D[..., t, j] = exp(sum_(j < l <= t) g_l)`` for ``j <= t``, else 0, ``(..., nc, c,
    c)``, in one buffer (the same masked cumulative sum down each column; above the
    diagonal it sums zeros, so its ``exp(0) = 1`` may be zeroed by a product)."""
    c = g.shape[-1]
    d = np.where(strict > 0, g[..., :, None], 0.0)   # where: a NaN or -inf gate x 0 is NaN
    np.cumsum(d, axis=-2, out=d)
    np.exp(d, out=d)
    d *= strict + np.eye(c, dtype=d.dtype)
    return d


def _times(x, y):
    """``x * y``, in place where the product keeps ``x``'s shape."""
    if np.broadcast_shapes(x.shape, y.shape) == x.shape:
        x *= y
        return x
    return x * y


def _product(a, b, out):
    """``a @ b`` written into ``out`` (whose batch may be wider: broadcast, e.g. grouped
    heads)."""
    if np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) == out.shape[:-2]:
        return np.matmul(a, b, out=out)
    out[...] = a @ b
    return out


def delta_chunked(q, k, v, beta, g, s0, chunk_size: int):
    """:func:`arrayattn.reference.delta_chunked` on NumPy: ``(O, S_n)`` of the delta rule
    with scalar log gates ``g (..., n, 1)``, ``beta (..., n)`` and the state ``s0``."""
    n, dk, dv = q.shape[-2], k.shape[-1], v.shape[-1]
    c = min(chunk_size, max(n, 1))
    qc, kc, vc, bc, gc = (in_chunks(x, c) for x in (q, k, v, beta[..., None], g))
    batch = np.broadcast_shapes(qc.shape[:-3], kc.shape[:-3], vc.shape[:-3], bc.shape[:-3],
                                gc.shape[:-3], s0.shape[:-2])
    nc = max(qc.shape[-3], kc.shape[-3])
    strict = np.tril(np.ones((c, c), dtype=q.dtype), k=-1)
    plain = not np.any(g)     # no gate (NaN counts as one): the decays are all 1
    gam = None if plain else _decays(gc[..., 0], strict)              # (..., nc, c, c)
    a = kc @ kc.mT
    if gam is not None:
        a = _times(a, gam)
    a *= strict
    a = _times(a, bc)
    t = _times(unit_lower_inverse(a), bc.mT)
    qk = qc @ kc.mT
    if gam is None:
        qk *= strict + np.eye(c, dtype=q.dtype)
        into = end = None
    else:
        qk = _times(qk, gam)
        into = np.exp(gc[..., :1, :]) * gam[..., :, :1]                 # (..., nc, c, 1)
        end = gam[..., -1:, :].mT                                       # (..., nc, c, 1)
        last = np.ascontiguousarray(into[..., -1, 0])                   # (..., nc)
    # rows :c of each chunk's stack: w = T (k * into); rows c: the scaled queries
    wq = np.empty((*batch, nc, 2 * c, dk), dtype=q.dtype)
    _product(t if into is None else t * into.mT, kc, wq[..., :c, :])
    np.multiply(qc, 1.0 if into is None else into, out=wq[..., c:, :])
    u = _product(t, vc, np.empty((*batch, nc, c, dv), dtype=q.dtype))
    out = np.empty((*batch, nc, c, dv), dtype=q.dtype)
    s = np.array(np.broadcast_to(s0, (*batch, dk, dv)), dtype=q.dtype)
    flat = s.reshape(*batch, dk * dv)          # a view: the decay scales long rows
    for i in range(nc):
        p = wq[..., i, :, :] @ s                                        # (..., 2c, dv)
        ui = u[..., i, :, :]
        ui -= p[..., :c, :]                                             # U = u - w S
        o = np.matmul(qk[..., i, :, :], ui, out=out[..., i, :, :])
        o += p[..., c:, :]
        ki = kc[..., i, :, :]
        if end is None:
            s += ki.mT @ ui
        else:
            flat *= last[..., i, None]
            s += (ki * end[..., i, :, :]).mT @ ui
    # The state does not depend on q: its batch is that of k, v, beta, g and s0 (the
    # stacked w and q made it q's too, with equal values along q's extra dims).
    own = np.broadcast_shapes(kc.shape[:-3], vc.shape[:-3], bc.shape[:-3], gc.shape[:-3],
                              s0.shape[:-2])
    padded = (1,) * (len(batch) - len(own)) + own
    s = s[tuple(slice(0, 1) if a < b else slice(None) for a, b in zip(padded, batch))]
    return unchunk(out, n), s.reshape(*own, dk, dv)
