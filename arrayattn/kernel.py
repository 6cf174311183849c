r"""Kernel (linear) attention and efficient attention.

Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") replaces
:math:`\exp(q\cdot k)` by a kernel :math:`\varphi_q(q)\cdot\varphi_k(k)` and reorders the
products, so no ``n x s`` matrix is formed:

.. math::

    O_i = \frac{\varphi_q(q_i)^\top \sum_j \varphi_k(k_j) v_j^\top}
               {\varphi_q(q_i)^\top \sum_j \varphi_k(k_j)}

Causal attention restricts the sums to the keys query ``i`` may see (end-aligned:
``j <= i + s - n``) and is computed in one of three forms, equal to rounding:
``"recurrent"`` (the RNN recurrence, sequential over tokens), ``"cumsum"`` (a cumulative
sum of the per-token outer products: ``O(n m dv)`` memory) and ``"chunked"`` (the
default: quadratic inside chunks, a cumulative sum of per-chunk states between chunks).

:func:`feature_attention` does all of this on already-computed features (it is shared
with the random-feature variants); :func:`linear_attention` applies a feature map and
calls it.  Efficient attention (Shen et al. 2021) is :func:`efficient_attention`.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import Any

import array_api_compat

from ._validate import (Problem, _broadcast_batch, check_choice, check_key_mask,
                        check_no_causal, check_positive_int, check_qkv,
                        check_same_array_kind)
from ._parallel import (cumulative_sum_, map_rows, matmul_into, parallel_map, split_rows,
                        update_, zero_where_)
from ._xp import compute_dtype, xp_device
from .exact import masked_softmax, merge_blocks
from .feature_maps import FeatureMap, get_feature_map
from .registry import Variant, register

__all__ = [
    "LinearAttentionState", "feature_attention", "feature_attention_step",
    "linear_attention", "linear_attention_state", "linear_attention_step",
    "efficient_attention",
]

CAUSAL_METHODS = ("recurrent", "cumsum", "chunked")


@dataclass(frozen=True)
class LinearAttentionState:
    r"""The recurrent state of causal linear attention after some tokens.

    .. math:: S = \sum_j \varphi_k(k_j) v_j^\top \;(\ldots, m, d_v),\qquad
              z = \sum_j \varphi_k(k_j) \;(\ldots, m)

    over the ``num_tokens`` keys seen so far.  ``S`` and ``z`` are kept in the working
    dtype (float32 for float16/bfloat16 inputs).  The state is immutable: every update
    returns a new state (safe under JAX transformations).

    Attributes
    ----------
    S : array, shape ``(..., m, dv)``
    z : array, shape ``(..., m)``
    num_tokens : int
        Keys summed into the state.
    feature_map : FeatureMap or None
        The map the features were made with (``None`` for states of
        :func:`feature_attention`, whose caller owns the features).
    """

    S: Any
    z: Any
    num_tokens: int = 0
    feature_map: FeatureMap | None = None

    @property
    def m(self) -> int:
        return int(self.S.shape[-2])

    @property
    def dv(self) -> int:
        return int(self.S.shape[-1])

    @property
    def batch(self) -> tuple:
        return tuple(self.S.shape[:-2])


# ---------------------------------------------------------------------------------------
# Core: causal forms on features.  Values are augmented with a column of ones, so that
# numerator and denominator come out of the same products: phi_q (phi_k^T [v, 1]).
# The augmented state is Sz = [S, z] of shape (..., m, dv + 1).
# ---------------------------------------------------------------------------------------

def _recurrent(xp, pq, pk, v1, sz0, device):
    """The RNN recurrence ``Sz_t = Sz_{t-1} + phi(k_t) [v_t, 1]^T``, one token at a time.

    Token ``t`` is taken with an index *array* (``take``), not a static slice, so that a
    library compiling each operation per static argument (JAX in eager mode) compiles
    the step once, not once per token.
    """
    sz = sz0
    outs = []
    for t in range(pq.shape[-2]):
        idx = xp.asarray([t], device=device)
        kt, vt, qt = (xp.take(x, idx, axis=-2) for x in (pk, v1, pq))
        sz = sz + xp.matrix_transpose(kt) @ vt          # outer product phi(k_t) [v_t, 1]^T
        outs.append(qt @ sz)
    return (outs[0] if len(outs) == 1 else xp.concat(outs, axis=-2)), sz


def _cumsum(xp, pq, pk, v1, sz0):
    """Cumulative sum of every token's outer product: materialises ``(..., n, m, dv+1)``."""
    outer = pk[..., :, :, None] * v1[..., :, None, :]
    sz = xp.cumulative_sum(xp.concat([sz0[..., None, :, :], outer], axis=-3), axis=-3)
    sz = sz[..., 1:, :, :]
    num = (pq[..., :, None, :] @ sz)[..., 0, :]
    return num, sz[..., -1, :, :]


def _chunked(xp, pq, pk, v1, sz0, chunk: int, device):
    """Quadratic within chunks of ``chunk`` tokens; the state before each chunk is an
    exclusive cumulative sum over chunks of ``phi(K_c)^T [V_c, 1]``
    (:func:`_chunked_blocks` on whole features; ``n == s`` here)."""
    return _chunked_blocks(
        xp, lambda i0, i1: (pq[..., i0:i1, :], pk[..., i0:i1, :]), rows_of(v1), sz0,
        pq.shape[-2], chunk=chunk, batch=tuple(pq.shape[:-2]), finish=lambda num: num,
        width=v1.shape[-1],
        row_bytes=math.prod(pq.shape[:-2]) * (pq.shape[-1] + v1.shape[-1]) * 4, dev=device)


def _causal(xp, pq, pk, v1, sz0, *, method, chunk, device):
    """Causal numerators ``(..., n, dv+1)`` and the final state, end-aligned."""
    n, s = pq.shape[-2], pk.shape[-2]
    shift = s - n
    lead = None
    if shift > 0:
        # Keys before the first query's position are seen by every query: fold them
        # into the initial state.
        sz0 = sz0 + xp.matrix_transpose(pk[..., :shift, :]) @ v1[..., :shift, :]
        pk, v1 = pk[..., shift:, :], v1[..., shift:, :]
    elif shift < 0:
        # The first -shift queries come before every key: they see the state only.
        lead = pq[..., :-shift, :] @ sz0
        pq = pq[..., -shift:, :]
    if pq.shape[-2] == 0:
        num, sz = None, sz0
    elif method == "recurrent":
        num, sz = _recurrent(xp, pq, pk, v1, sz0, device)
    elif method == "cumsum":
        num, sz = _cumsum(xp, pq, pk, v1, sz0)
    else:
        num, sz = _chunked(xp, pq, pk, v1, sz0, chunk, device)
    if lead is not None:
        num = lead if num is None else xp.concat([lead, num], axis=-2)
    return num, sz


def _check_state(p: Problem, state, ref, m: int) -> tuple:
    """Validate a state against features of dimension ``m``; returns the batch shape."""
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a LinearAttentionState; got {type(state).__name__}")
    check_same_array_kind(p.xp, "phi_q", ref, "state.S", state.S)
    if tuple(state.S.shape[-2:]) != (m, p.dv) or tuple(state.z.shape) != (
            *state.S.shape[:-1],):
        raise ValueError(
            f"state has S {tuple(state.S.shape)} and z {tuple(state.z.shape)}, but the "
            f"inputs need S (..., m, dv) = (..., {m}, {p.dv}) and z (..., {m})"
        )
    if state.S.dtype != p.work_dtype or state.z.dtype != p.work_dtype:
        raise TypeError(
            f"state is in {state.S.dtype} but inputs of dtype {p.dtype} are computed in "
            f"{p.work_dtype}; make the state with that dtype"
        )
    return _broadcast_batch([("inputs", p.batch), ("state", tuple(state.S.shape[:-2]))])


def feature_attention(phi_q, phi_k, v, /, *, causal=False, key_mask=None, eps=None,
                      method=None, chunk_size=64, return_state=False, state=None):
    r"""Kernel attention on already-computed features.

    .. math::

        O_i = \frac{\varphi_{q,i}^\top \sum_{j \in J_i} \varphi_{k,j}\, v_j^\top}
                   {\varphi_{q,i}^\top \sum_{j \in J_i} \varphi_{k,j}}

    where :math:`J_i` is every unmasked key (``causal=False``) or the unmasked keys
    ``j <= i + s - n`` (``causal=True``, end-aligned).  The ``n x s`` matrix is never
    formed: the products are ordered :math:`\varphi_q(\varphi_k^\top v)`.

    Parameters
    ----------
    phi_q : array, shape ``(..., n, m)``
        Query features :math:`\varphi_q(q)`.
    phi_k : array, shape ``(..., s, m)``
        Key features :math:`\varphi_k(k)`.
    v : array, shape ``(..., s, dv)``
        Values.  Leading dimensions of the three broadcast; the three share one dtype
        (features made in float32 from half-precision inputs: pass ``v`` in float32
        too and cast the output back, as :func:`linear_attention` does).
    causal : bool
        End-aligned causal attention: query ``i`` sees key ``j <= i + (s - n)``.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` = real key.  A masked key's features and value are replaced by
        zeros, so it enters neither the numerator nor the denominator (padding may
        hold inf or NaN).
    eps : float, optional
        Guards the division only.  A row whose denominator has ``|den| <= eps`` (no
        visible key, or every kernel value zero) returns zeros; every other row is
        exactly ``num / den``.  ``eps`` is never added to the features or to the
        denominator, so it biases nothing.  Default ``None``: the smallest positive
        normal number of the working dtype (``1.2e-38`` in float32, ``2.2e-308`` in
        float64), i.e. only a zero denominator is caught.  Katharopoulos et al. add
        ``1e-6`` to the denominator instead, which shrinks rows with small kernel sums.
    method : {"chunked", "cumsum", "recurrent"}, optional
        The causal form (``None`` = ``"chunked"``); all give the same result to
        rounding.  ``"recurrent"``: :math:`S_i = S_{i-1} + \varphi_{k,i} v_i^\top`,
        :math:`z_i = z_{i-1} + \varphi_{k,i}`, sequential over tokens (the reference).
        ``"cumsum"``: a cumulative sum of all ``n`` outer products, ``O(n m dv)``
        memory.  ``"chunked"``: within chunks of ``chunk_size`` tokens the masked
        quadratic form ``tril(\varphi_Q \varphi_K^\top) V``; between chunks the state
        is an exclusive cumulative sum of the per-chunk ``\varphi_{K_c}^\top V_c``.
        Ignored when ``causal=False`` (non-causal attention has one form).
    chunk_size : int
        Tokens per chunk of the chunked form (``n`` need not be a multiple).
    return_state : bool
        Also return the :class:`LinearAttentionState` after all ``s`` keys (for
        decoding: continue with :func:`feature_attention_step`).
    state : LinearAttentionState, optional
        Keys summed earlier (a prompt): they precede every key of this call and are
        visible to every query.

    Returns
    -------
    out : array, shape ``(..., n, dv)``
        In ``v``'s namespace, device and dtype; float16/bfloat16 are computed in
        float32.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Notes
    -----
    Cost: ``O((n + s) m dv)`` time and ``O((n + s)(m + dv) + m dv)`` memory
    non-causal.  Causal chunked with chunk ``c``: ``O((n + s)(m + dv) c)`` time; memory
    ``O(n (m + dv + c) + (n / c) m dv)`` (features, one ``c x c`` block per chunk and
    one ``m x dv`` state per chunk; no ``n x m x dv`` tensor).  Causal cumsum:
    ``O(n m dv)`` memory.  Recurrent: ``O(m dv)`` state, ``n`` sequential steps.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import feature_attention
    >>> rng = np.random.default_rng(0)
    >>> fq, fk = rng.random((2, 6, 3)), rng.random((2, 6, 3))
    >>> v = rng.standard_normal((2, 6, 4))
    >>> out = feature_attention(fq, fk, v)
    >>> a = fq @ fk.swapaxes(-1, -2)
    >>> bool(np.allclose(out, (a / a.sum(-1, keepdims=True)) @ v))
    True
    >>> c = feature_attention(fq, fk, v, causal=True, chunk_size=4)
    >>> r = feature_attention(fq, fk, v, causal=True, method="recurrent")
    >>> bool(np.allclose(c, r)) and bool(np.allclose(c[:, 0], v[:, 0]))
    True
    """
    p = check_qkv(phi_q, phi_k, v, names=("phi_q", "phi_k", "v"))
    chunk_size, method, eps = _check_options(p, phi_q, key_mask, chunk_size, method, eps)
    xp, wd, m = p.xp, p.work_dtype, p.d
    batch = p.batch if state is None else _check_state(p, state, phi_q, m)
    sz0 = None
    if state is not None:
        sz0 = xp.broadcast_to(xp.concat([state.S, state.z[..., None]], axis=-1),
                              (*batch, m, p.dv + 1))
    pq, pk, wv = (xp.astype(x, wd, copy=False) for x in (phi_q, phi_k, v))
    out, sz = _kernel_attention(
        xp, wv, query_features=rows_of(pq), key_features=rows_of(pk), n=p.n, s=p.s,
        batch=batch, causal=causal, key_mask=key_mask, method=method, chunk=chunk_size,
        sz0=sz0, eps=eps)
    out = xp.astype(out, p.dtype, copy=False)
    if not return_state:
        return out
    num_tokens = p.s + (0 if state is None else state.num_tokens)
    return out, LinearAttentionState(sz[..., :-1], sz[..., -1], num_tokens,
                                     None if state is None else state.feature_map)


def _check_width(mq: int, mk: int):
    if mq != mk:
        raise ValueError(
            f"phi_k has d={mk} but phi_q has d={mq}: the feature map must give queries and "
            "keys the same number of features")


def _check_features(pq, pk, rows_q: int, rows_k: int):
    """A feature map must keep the rows and give queries and keys one width and dtype."""
    _check_width(pq.shape[-1], pk.shape[-1])
    if pq.shape[-2] != rows_q or pk.shape[-2] != rows_k or pq.dtype != pk.dtype:
        raise ValueError(
            f"the feature map turned {rows_q} query rows into phi_q {tuple(pq.shape)} "
            f"({pq.dtype}) and {rows_k} key rows into phi_k {tuple(pk.shape)} ({pk.dtype});"
            " a map must act on the last axis only and give queries and keys one dtype")


def _kernel_attention(xp, v, *, query_features, key_features, n: int, s: int, batch,
                      causal, key_mask, method, chunk, sz0, eps, m: int | None = None,
                      shifted_keys: bool = False):
    """Kernel attention on features made block by block.

    ``query_features(i0, i1)`` and ``key_features(j0, j1)`` return the features of those
    query and key rows (a slice of given features, or a map applied to a slice of the
    inputs: maps act on the last axis only, so rows split freely).  Each row is asked
    for exactly once, so the callables may consume temporaries of their caller in place.
    On NumPy the key rows, then the query rows, are cut into one block per thread
    (:mod:`arrayattn._parallel`) and no block's features are ever concatenated.  ``v`` is
    in the working dtype.  Returns ``(out, Sz)`` with ``Sz = [S, z]`` the final state
    ``(..., m, dv + 1)``.

    With ``shifted_keys`` (non-causal only) ``key_features`` returns ``(features, shift)``:
    features divided by ``exp(shift)``, ``shift (..., 1, 1)`` one stabiliser per block.  The
    block states are then merged as the online softmax merges blocks,
    ``Sz = sum_b exp(shift_b - max_b shift_b) Sz_b``: the same as one global shift, in one
    pass over the keys.  ``m`` (the feature count, when known) sizes the blocks.
    """
    wd, dev = v.dtype, xp_device(v)
    itemsize = 8 if wd == xp.float64 else 4
    row_bytes = math.prod(batch) * max(m or 0, v.shape[-1] + 1) * itemsize
    keep = None if key_mask is None else key_mask[..., None]

    def masked_key_features(j0, j1):
        """``(features, shift)`` of key rows ``j0:j1`` (``shift`` None unless
        ``shifted_keys``), masked keys' features zeroed."""
        pk, shift = key_features(j0, j1) if shifted_keys else (key_features(j0, j1), None)
        if keep is not None:
            pk = xp.where(keep[..., j0:j1, :], pk, 0.0)
        return pk, shift

    def values1(j0, j1):
        # Augment v with ones: the last output column is the denominator.  Masked values
        # are zeroed too: padding may hold inf/NaN, and 0 * inf = NaN.
        vb = v[..., j0:j1, :]
        if keep is not None:
            vb = xp.where(keep[..., j0:j1, :], vb, 0.0)
        return xp.concat([vb, xp.ones((*vb.shape[:-1], 1), dtype=wd, device=dev)], axis=-1)

    def features(i0, i1):
        pq, pk = query_features(i0, i1), masked_key_features(i0, i1)[0]
        _check_features(pq, pk, i1 - i0, i1 - i0)
        return pq, pk

    if shifted_keys and causal:
        raise ValueError("per-block key shifts are not causal-safe")
    if not causal:
        def key_block(rows):
            pk, shift = masked_key_features(*rows)
            return xp.matrix_transpose(pk) @ values1(*rows), shift

        parts = parallel_map(xp, key_block, split_rows(xp, s, row_bytes=row_bytes))
        states = [kv for kv, _ in parts]
        kv = merge_blocks(xp, states, [shift for _, shift in parts]) if shifted_keys else \
            functools.reduce(operator.add, states)
        sz = kv if sz0 is None else sz0 + kv

        def query_block(rows, out):
            pq = query_features(*rows)
            _check_width(pq.shape[-1], sz.shape[-2])
            return _divide(xp, matmul_into(xp, pq, sz, "num"), eps)

        return map_rows(xp, query_block, split_rows(xp, n, row_bytes=row_bytes),
                        shape=(*batch, n, v.shape[-1]), dtype=wd), sz
    if method == "chunked" and n == s:
        return _chunked_blocks(xp, features, values1, sz0, n, chunk=chunk, batch=batch,
                               finish=lambda num: _divide(xp, num, eps), width=v.shape[-1],
                               row_bytes=row_bytes, dev=dev)
    pq, pk = query_features(0, n), masked_key_features(0, s)[0]
    _check_features(pq, pk, n, s)
    if sz0 is None:
        sz0 = xp.zeros((*batch, pq.shape[-1], v.shape[-1] + 1), dtype=wd, device=dev)
    shape = lambda x: (*batch, *x.shape[-2:])  # noqa: E731
    pq, pk, v1 = (xp.broadcast_to(x, shape(x)) for x in (pq, pk, values1(0, s)))
    num, sz = _causal(xp, pq, pk, v1, sz0, method=method, chunk=chunk, device=dev)
    return _divide(xp, num, eps), sz


def rows_of(x, f=None):
    """``(i0, i1) -> f(x[..., i0:i1, :])`` (``f`` = identity when ``None``): the row-block
    feature callable of :func:`_kernel_attention` for a map ``f`` applied to ``x``."""
    if f is None:
        return lambda i0, i1: x[..., i0:i1, :]
    return lambda i0, i1: f(x[..., i0:i1, :])


def _chunked_blocks(xp, features, values1, sz0, n: int, *, chunk: int, batch, finish,
                    width: int, row_bytes: int, dev):
    """The chunked causal form (``n == s``) over blocks of whole chunks, in two passes.

    Pass 1, per block (in parallel on NumPy): features, per-chunk states
    ``phi(K_c)^T [V_c, 1]``, the masked within-chunk products and the block's total.
    Between the passes the block totals are summed into each block's starting state.
    Pass 2, per block: the exclusive cumulative sum of the chunk states (the state
    before each chunk: a chunk's own keys, some in the future of its queries, never
    enter it) and the numerators ``(..., rows, dv + 1)``, passed through ``finish``.
    ``features(i0, i1)`` gives ``(phi_q, phi_k)`` of rows ``i0:i1``, ``values1`` the
    values with their column of ones; ``sz0=None`` starts from a zero state; ``width``
    is the number of columns ``finish`` leaves.
    """
    c = min(chunk, n)
    future = ~xp.tril(xp.ones((c, c), dtype=xp.bool, device=dev))

    def pass1(rows):
        i0, i1 = rows
        pq, pk = features(i0, i1)
        v1 = values1(i0, i1)
        shape = lambda x: (*batch, *x.shape[-2:])  # noqa: E731
        pq, pk, v1 = (xp.broadcast_to(x, shape(x)) for x in (pq, pk, v1))
        nc = -(-(i1 - i0) // c)
        pad = nc * c - (i1 - i0)
        if pad:
            # Zero rows at the end: zero keys add nothing, the padded queries are dropped.
            def zpad(x):
                z = xp.zeros((*x.shape[:-2], pad, x.shape[-1]), dtype=x.dtype, device=dev)
                return xp.concat([x, z], axis=-2)
            pq, pk, v1 = zpad(pq), zpad(pk), zpad(v1)
        qc, kc, vc = (xp.reshape(x, (*batch, nc, c, x.shape[-1])) for x in (pq, pk, v1))
        kv = xp.matrix_transpose(kc) @ vc                      # (..., nc, m, dv+1)
        a = qc @ xp.matrix_transpose(kc)                        # (..., nc, c, c)
        a = zero_where_(xp, a, future)
        return qc, kv, a @ vc, xp.sum(kv, axis=-3)

    # A row of a block holds features, values and c within-chunk scores.
    blocks = split_rows(xp, n, row_bytes=row_bytes + 4 * math.prod(batch) * c, align=c)
    first = parallel_map(xp, pass1, blocks)
    if sz0 is None:
        sz0 = xp.zeros(first[0][3].shape, dtype=first[0][3].dtype, device=dev)
    starts = [sz0]
    for _, _, _, total in first:
        starts.append(starts[-1] + total)

    index = {rows: b for b, rows in enumerate(blocks)}

    def pass2(rows, out):
        b = index[rows]
        qc, kv, within, _ = first[b]
        before = xp.concat([starts[b][..., None, :, :], kv[..., :-1, :, :]], axis=-3)
        before = cumulative_sum_(xp, before, axis=-3)
        num = update_(xp, qc @ before, operator.add, within)
        i0, i1 = rows
        num = xp.reshape(num, (*num.shape[:-3], -1, num.shape[-1]))[..., :i1 - i0, :]
        return finish(num)

    return (map_rows(xp, pass2, blocks, shape=(*batch, n, width), dtype=sz0.dtype),
            starts[-1])


def _check_options(p: Problem, ref, key_mask, chunk_size, method, eps):
    """The options :func:`feature_attention` and :func:`linear_attention` share, checked:
    ``(chunk_size, method, eps)`` with ``method=None`` -> ``"chunked"`` and ``eps`` a float."""
    check_key_mask(p, key_mask, ref)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    method = "chunked" if method is None else check_choice("method", method,
                                                           CAUSAL_METHODS)
    return chunk_size, method, _check_eps(eps, p.xp, p.work_dtype)


def _check_eps(eps, xp, wd) -> float:
    """``eps`` as a float; ``None`` is the smallest positive normal number of ``wd``."""
    if eps is None:
        return float(xp.finfo(wd).smallest_normal)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0 or None; got {eps!r}")
    return float(eps)


def _divide(xp, num, eps: float):
    """``num[..., :-1] / num[..., -1:]``; rows with ``|den| <= eps`` -> 0."""
    den = num[..., -1:]
    # A guarded row divides by +inf: finite / inf = 0 exactly, one where on (..., n, 1).
    # num is the caller's temporary: divided in place where that is possible.
    safe = xp.where(xp.abs(den) > eps, den, xp.inf)
    return update_(xp, num, operator.truediv, safe)[..., :-1]


def feature_attention_step(phi_q_t, phi_k_t, v_t, state, /, *, eps=None):
    r"""One decoding step of causal kernel attention on features.

    Adds the key :math:`\varphi_{k,t}` and value :math:`v_t` to the state, then
    attends with :math:`\varphi_{q,t}`:
    :math:`S_t = S_{t-1} + \varphi_{k,t} v_t^\top`, :math:`z_t = z_{t-1} +
    \varphi_{k,t}`, :math:`o_t = \varphi_{q,t}^\top S_t / \varphi_{q,t}^\top z_t`.

    Parameters
    ----------
    phi_q_t, phi_k_t : array, shape ``(..., m)``
    v_t : array, shape ``(..., dv)``
    state : LinearAttentionState
        Not modified; a new state is returned.
    eps : float, optional
        As in :func:`feature_attention`.

    Returns
    -------
    out_t : array, shape ``(..., dv)``
    state : LinearAttentionState
        With ``num_tokens`` increased by one.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import feature_attention, feature_attention_step, linear_attention_state
    >>> rng = np.random.default_rng(0)
    >>> fq, fk, v = rng.random((6, 3)), rng.random((6, 3)), rng.standard_normal((6, 2))
    >>> st = linear_attention_state(np, (), 3, 2, feature_map="relu")  # m = d = 3 features
    >>> outs = []
    >>> for t in range(6):
    ...     o, st = feature_attention_step(fq[t], fk[t], v[t], st)
    ...     outs.append(o)
    >>> bool(np.allclose(np.stack(outs), feature_attention(fq, fk, v, causal=True)))
    True
    """
    for name, x in (("phi_q_t", phi_q_t), ("phi_k_t", phi_k_t), ("v_t", v_t)):
        if x.ndim < 1:
            raise ValueError(f"{name} must have at least 1 dimension (..., features); "
                             f"got shape {tuple(x.shape)}")
    out, new = feature_attention(phi_q_t[..., None, :], phi_k_t[..., None, :],
                                 v_t[..., None, :], causal=True, eps=eps,
                                 method="recurrent", return_state=True, state=state)
    return out[..., 0, :], new


def linear_attention(q, k, v, /, *, feature_map="elu+1", causal=False, key_mask=None,
                     eps=None, method=None, chunk_size=64, return_state=False):
    r"""Linear (kernel) attention of Katharopoulos et al. 2020.

    .. math::

        O_i = \frac{\varphi_q(q_i)^\top \sum_{j\in J_i} \varphi_k(k_j) v_j^\top}
                   {\varphi_q(q_i)^\top \sum_{j\in J_i} \varphi_k(k_j)}

    Angelos Katharopoulos, Apoorv Vyas, Nikolaos Pappas, François Fleuret, "Transformers
    are RNNs: Fast Autoregressive Transformers with Linear Attention", ICML 2020.  There
    is no softmax and no ``scale`` (scale the inputs, or use the ``taylor`` map's
    ``input_scale``).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    feature_map : str, FeatureMap, callable or pair of callables
        ``"elu+1"`` (default), ``"relu"``, ``"cosine"`` (kernel ``1 + cos(q, k)``),
        ``"taylor"`` (``1 + q.k + (q.k)^2/2``; see
        :func:`~arrayattn.feature_maps.taylor_feature_map` for an input scale), a
        :class:`~arrayattn.feature_maps.FeatureMap`, one callable for queries and keys,
        or a pair ``(phi_q, phi_k)``.  Applied in the working dtype.
    causal, key_mask, eps, method, chunk_size, return_state
        As in :func:`feature_attention`: end-aligned causality in three equal forms
        (``"chunked"`` default, ``"cumsum"``, ``"recurrent"``); masked keys leave
        numerator and denominator; ``eps`` only guards a zero denominator.

    Returns
    -------
    out : array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q``.
    state : LinearAttentionState
        With ``return_state=True``: the state after the ``s`` keys, carrying the
        feature map, to continue with :func:`linear_attention_step`.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import linear_attention, linear_attention_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 8, 4)) for _ in range(3))
    >>> full = linear_attention(q, k, v, causal=True)
    >>> out, state = linear_attention(q[:, :5], k[:, :5], v[:, :5], causal=True,
    ...                               return_state=True)
    >>> for t in range(5, 8):
    ...     o_t, state = linear_attention_step(q[:, t], k[:, t], v[:, t], state)
    >>> bool(np.allclose(o_t, full[:, 7])), state.num_tokens
    (True, 8)
    >>> const = linear_attention(q, k, np.full((2, 8, 1), 3.0), feature_map="cosine")
    >>> bool(np.allclose(const, 3.0))
    True
    """
    p = check_qkv(q, k, v)
    chunk_size, method, eps = _check_options(p, q, key_mask, chunk_size, method, eps)
    fm = get_feature_map(feature_map)
    xp, wd = p.xp, p.work_dtype
    # The maps are applied block by block inside (they act on the last axis only).
    wq, wk, wv = (xp.astype(x, wd, copy=False) for x in (q, k, v))
    out, sz = _kernel_attention(
        xp, wv, query_features=rows_of(wq, fm.query), key_features=rows_of(wk, fm.key),
        n=p.n, s=p.s, batch=p.batch, causal=causal, key_mask=key_mask, method=method,
        chunk=chunk_size, sz0=None, eps=eps)
    out = xp.astype(out, p.dtype, copy=False)
    if not return_state:
        return out
    return out, LinearAttentionState(sz[..., :-1], sz[..., -1], p.s, fm)


def linear_attention_state(xp, batch_shape, d, dv, /, *, feature_map="elu+1", dtype=None,
                           device=None) -> LinearAttentionState:
    """An empty decoding state (no token seen yet).

    Parameters
    ----------
    xp : namespace
        The array library, e.g. ``numpy``, ``torch``, ``jax.numpy``, ``cupy``,
        ``array_api_strict``.
    batch_shape : tuple of int
        Leading dimensions (batch, heads).
    d, dv : int
        Query/key and value dimensions.
    feature_map : str, FeatureMap, callable or pair
        As in :func:`linear_attention`; stored in the state.
    dtype : dtype, optional
        The dtype of the inputs that will be fed (default: the library's default
        floating dtype).  The state is kept in the working dtype (float32 for
        float16/bfloat16).
    device : device, optional

    Examples
    --------
    >>> import numpy as np
    >>> st = linear_attention_state(np, (2, 3), 4, 5, feature_map="cosine")
    >>> st.S.shape, st.z.shape, st.num_tokens, st.feature_map.name
    ((2, 3, 5, 5), (2, 3, 5), 0, 'cosine')
    """
    fm = get_feature_map(feature_map)
    d = check_positive_int("d", d)
    dv = check_positive_int("dv", dv)
    batch = tuple(check_positive_int("batch_shape", b, minimum=0) for b in batch_shape)
    probe = xp.asarray(0.0) if dtype is None else xp.asarray(0.0, dtype=dtype)
    cxp = array_api_compat.array_namespace(probe)
    dtype = probe.dtype
    if not cxp.isdtype(dtype, "real floating"):
        raise TypeError(f"dtype must be a real floating dtype; got {dtype}")
    wd = compute_dtype(cxp, dtype)
    m = fm.output_dim(d, xp=cxp, dtype=wd, device=device)
    S = cxp.zeros((*batch, m, dv), dtype=wd, device=device)
    z = cxp.zeros((*batch, m), dtype=wd, device=device)
    return LinearAttentionState(S, z, 0, fm)


def linear_attention_step(q_t, k_t, v_t, state, /, *, eps=None):
    r"""One autoregressive decoding step of causal linear attention.

    Feeds the token ``(q_t, k_t, v_t)`` to ``state`` and returns its output and the new
    state (the state's feature map is applied; the old state is not modified).
    Feeding a sequence token by token gives the outputs of
    ``linear_attention(q, k, v, causal=True)``.

    Parameters
    ----------
    q_t, k_t : array, shape ``(..., d)``
    v_t : array, shape ``(..., dv)``
    state : LinearAttentionState
        From :func:`linear_attention_state` or ``linear_attention(...,
        return_state=True)``.
    eps : float, optional
        As in :func:`feature_attention`.

    Returns
    -------
    out_t : array, shape ``(..., dv)``
        Same dtype as ``q_t``.
    state : LinearAttentionState

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import linear_attention, linear_attention_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> out, st = linear_attention(q[:3], k[:3], v[:3], causal=True, return_state=True)
    >>> o3, st = linear_attention_step(q[3], k[3], v[3], st)   # the prompt, then a step
    >>> bool(np.allclose(o3, linear_attention(q[:4], k[:4], v[:4], causal=True)[3]))
    True
    """
    if not isinstance(state, LinearAttentionState) or state.feature_map is None:
        raise TypeError("state must be a LinearAttentionState made by "
                        "linear_attention_state or linear_attention(return_state=True)")
    fm = state.feature_map
    p = check_qkv(q_t[..., None, :], k_t[..., None, :], v_t[..., None, :],
                  names=("q_t", "k_t", "v_t"))
    xp = p.xp
    wq, wk, wv = (xp.astype(x, p.work_dtype, copy=False) for x in (q_t, k_t, v_t))
    out, new = feature_attention_step(fm.query(wq), fm.key(wk), wv, state, eps=eps)
    return xp.astype(out, p.dtype, copy=False), new


def efficient_attention(q, k, v, /, *, causal=False, key_mask=None):
    r"""Efficient attention of Shen et al.: softmax over features, softmax over keys.

    .. math::

        O = \rho_q(Q)\,\bigl(\rho_k(K)^\top V\bigr),\qquad
        \rho_q(Q) = \operatorname{softmax}_{\text{row}}(Q),\quad
        \rho_k(K) = \operatorname{softmax}_{\text{column}}(K)

    Zhuoran Shen, Mingyuan Zhang, Haiyu Zhao, Shuai Yi, Hongsheng Li, "Efficient
    Attention: Attention with Linear Complexities", WACV 2021.  Each query row of
    :math:`\rho_q` sums to 1 over the ``d`` features and each feature column of
    :math:`\rho_k` sums to 1 over the ``s`` keys, so the rows of the implied matrix
    :math:`\rho_q(Q)\rho_k(K)^\top` sum to 1.  No scale is applied (as in the paper).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    causal : bool
        Must be ``False``: the softmax over keys normalises every feature over the
        whole sequence, so every output depends on every key.
    key_mask : boolean array, shape ``(..., s)``, optional
        Masked keys are left out of the softmax over keys (weight 0).  With every key
        masked the output is zero.

    Returns
    -------
    array, shape ``(..., n, dv)``

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import efficient_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 5, 3)), rng.standard_normal((2, 7, 3))
    >>> out = efficient_attention(q, k, np.ones((2, 7, 2)))
    >>> bool(np.allclose(out, 1.0))
    True
    """
    check_no_causal(causal, "efficient_attention",
                    "its softmax over the keys normalises each feature over the whole "
                    "sequence, so every output depends on every (also future) key")
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    xp = p.xp
    wq = xp.astype(q, p.work_dtype, copy=False)
    wk = xp.astype(k, p.work_dtype, copy=False)
    wv = xp.astype(v, p.work_dtype, copy=False)
    rq = masked_softmax(xp, wq, None, axis=-1)
    rk = masked_softmax(xp, wk, None if key_mask is None else key_mask[..., None], axis=-2)
    out = rq @ (xp.matrix_transpose(rk) @ wv)
    return xp.astype(out, p.dtype, copy=False)


# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------

_KATHAROPOULOS = ("Katharopoulos et al. 2020, Transformers are RNNs: Fast Autoregressive "
                  "Transformers with Linear Attention")
for _name, _extra in (("elu+1", ""), ("relu", ""), ("cosine", ""),
                      ("taylor", "; Zhang et al. 2024 (Hedgehog), Arora et al. 2024 (Based)")):
    register(Variant(
        name="linear_" + _name.replace("+1", ""),
        fn=linear_attention,
        family="kernel",
        exact=False,
        causal=True,
        key_mask=True,
        normalized=True,
        defaults={"feature_map": _name},
        complexity=("O((n + s) m dv) time, m = " + {"elu+1": "d", "relu": "d",
                                                     "cosine": "d + 1",
                                                     "taylor": "1 + d + d^2"}[_name]
                    + "; causal chunked O(n (m + dv) c)"),
        citation=_KATHAROPOULOS + _extra,
        notes=("causal=True uses the chunked form (chunk_size=64); a row whose kernel "
               "sum is zero returns zeros"),
    ))

register(Variant(
    name="efficient",
    fn=efficient_attention,
    family="kernel",
    exact=False,
    causal=False,
    key_mask=True,
    normalized=True,
    complexity="O((n + s) d dv) time and memory",
    citation="Shen et al. 2021, Efficient Attention: Attention with Linear Complexities",
))
