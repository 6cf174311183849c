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

import math
from dataclasses import dataclass
from typing import Any

import array_api_compat

from . import reference
from ._numpy import kernel as numpy_kernel
from ._engine import entry, numpy_engine
from ._validate import (Problem, broadcast_batch, check_array, check_choice,
                        check_flag, check_key_mask, check_no_causal, check_positive_int,
                        check_qkv, check_same_array_kind)
from ._xp import compute_dtype
from .feature_maps import FEATURE_MAPS, FeatureMap, get_feature_map
from .registry import Variant, register

__all__ = [
    "LinearAttentionState", "feature_attention", "feature_attention_step",
    "linear_attention", "linear_attention_state", "linear_attention_step",
    "efficient_attention", "check_eps", "check_kernel_options", "check_state",
    "checked_maps",
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


def check_state(p: Problem, state, ref, m: int) -> tuple:
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
    return broadcast_batch([("inputs", p.batch), ("state", tuple(state.S.shape[:-2]))])


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
    causal = check_flag("causal", causal)
    return_state = check_flag("return_state", return_state)
    chunk_size, method, eps = check_kernel_options(p, phi_q, key_mask, chunk_size, method,
                                                   eps)
    xp, wd, m = p.xp, p.work_dtype, p.d
    batch = p.batch if state is None else check_state(p, state, phi_q, m)
    sz0 = None
    if state is not None:
        sz0 = xp.concat([state.S, state.z[..., None]], axis=-1)
    pq, pk, wv = (xp.astype(x, wd, copy=False) for x in (phi_q, phi_k, v))
    out, sz = _kernel_dispatch(
        p, pq, pk, wv, batch=batch, causal=causal, key_mask=key_mask, method=method,
        chunk_size=chunk_size, eps=eps, sz0=sz0)
    if not return_state:
        return out
    num_tokens = p.s + (0 if state is None else state.num_tokens)
    return out, LinearAttentionState(sz[..., :-1], sz[..., -1], num_tokens,
                                     None if state is None else state.feature_map)


def _kernel_dispatch(p: Problem, q, k, v, *, batch, causal, key_mask, method,
                              chunk_size, eps, sz0=None, maps=None, engine_maps=None,
                              m=None, normalize=True):
    """Kernel attention on validated inputs in the working dtype, NumPy engine or
    reference form (chosen once): ``(out in p.dtype, Sz (*batch, m, dv + 1))``.

    ``maps = (phi_q, phi_k)`` are applied to ``q`` and ``k`` (features when ``None``);
    ``engine_maps`` the same maps for the NumPy engine (default ``maps``); ``m`` is the
    feature width when known (sizes the engine's blocks).  Masked keys and
    values are zeroed once here (padding may hold NaN or inf).  ``s = 0``: zeros.
    ``normalize=False`` (the numerator alone) runs the reference form: the engine has no
    such path.
    """
    xp = p.xp
    query_map, key_map = (None, None) if maps is None else maps
    engine_q, engine_k = (query_map, key_map) if engine_maps is None else engine_maps
    m = q.shape[-1] if m is None else m
    with entry(xp):
        k, v = reference.zero_masked_keys(key_mask, k, v)
        # causal: a non-finite key or value reaches only the rows that see it
        bad = reference.nonfinite_rows(k, v) if causal else None
        k, v = (k, v) if bad is None else reference.drop_nonfinite(bad, k, v)
        if normalize and numpy_engine(xp, math.prod(batch) * (p.n + p.s) * max(m, p.dv + 1)
                                      * 4):
            out, sz = numpy_kernel.kernel_attention(
                v, query_features=numpy_kernel.rows_of(q, engine_q),
                key_features=numpy_kernel.rows_of(k, engine_k), n=p.n, s=p.s, batch=batch,
                causal=causal, key_mask=key_mask, method=method, chunk=chunk_size,
                sz0=sz0, eps=eps, m=m)
        else:
            pq = q if query_map is None else query_map(q)
            pk = k if key_map is None else key_map(k)
            out, sz = reference.kernel_attention(
                pq, pk, v, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, eps=eps, state=sz0, normalize=normalize)
    if bad is not None:
        out = reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))
        sz = xp.where(xp.any(bad, axis=-1)[..., None, None], xp.nan, sz)
    sz = xp.broadcast_to(sz, (*batch, *sz.shape[-2:]))
    return xp.astype(out, p.dtype, copy=False), sz


def checked_maps(fm: FeatureMap, ref) -> tuple:
    """The query and key maps of ``fm`` with their outputs checked: arrays of ``ref``'s
    library, the rows and dtype kept, one width for both (a map returning something
    else fails here, by name, not deep inside a product)."""
    widths: dict = {}

    def checked(f, which):
        def phi(x):
            out = f(x)
            name = f"feature_map's {which} map output"
            check_array(name, out, min_ndim=1)
            check_same_array_kind(None, which + "s", ref, name, out)
            if out.ndim != x.ndim or tuple(out.shape[:-1]) != tuple(x.shape[:-1]):
                raise ValueError(
                    f"feature_map's {which} map turned {which}s of shape {tuple(x.shape)} "
                    f"into {tuple(out.shape)}; a map must act on the last axis only")
            if out.dtype != x.dtype:
                raise TypeError(f"feature_map's {which} map returned dtype {out.dtype} "
                                f"for {which}s of dtype {x.dtype}")
            widths[which] = out.shape[-1]
            if widths.get("query", out.shape[-1]) != widths.get("key", out.shape[-1]):
                raise ValueError(
                    f"phi_k has d={widths['key']} but phi_q has d={widths['query']}: the "
                    "feature map must give queries and keys the same number of features")
            return out
        return phi
    return checked(fm.query, "query"), checked(fm.key, "key")


def check_kernel_options(p: Problem, ref, key_mask, chunk_size, method, eps):
    """The options :func:`feature_attention` and :func:`linear_attention` share, checked:
    ``(chunk_size, method, eps)`` with ``method=None`` -> ``"chunked"`` and ``eps`` a float."""
    check_key_mask(p, key_mask, ref)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    method = "chunked" if method is None else check_choice("method", method,
                                                           CAUSAL_METHODS)
    return chunk_size, method, check_eps(eps, p.xp, p.work_dtype)


def check_eps(eps, xp, wd) -> float:
    """``eps`` as a float; ``None`` is the smallest positive normal number of ``wd``."""
    if eps is None:
        return float(xp.finfo(wd).smallest_normal)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0 or None; got {eps!r}")
    return float(eps)


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
        check_array(name, x, min_ndim=1)
    out, new = feature_attention(phi_q_t[..., None, :], phi_k_t[..., None, :],
                                 v_t[..., None, :], causal=True, eps=eps,
                                 method="recurrent", return_state=True, state=state)
    return out[..., 0, :], new


def linear_attention(q, k, v, /, *, feature_map="elu+1", causal=False, key_mask=None,
                     eps=None, method=None, chunk_size=64, return_state=False,
                     normalize=True):
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
    normalize : bool
        ``False``: the numerator alone, ``O_i = sum_j (phi_q(q_i) . phi_k(k_j)) v_j`` (fla's
        ``normalize=False``, its linear attention's default; with the identity map and
        ``causal=True`` it is retention with ``gamma = 1``).  Runs the reference form.

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
    causal = check_flag("causal", causal)
    return_state = check_flag("return_state", return_state)
    chunk_size, method, eps = check_kernel_options(p, q, key_mask, chunk_size, method, eps)
    fm = get_feature_map(feature_map)
    xp, wd = p.xp, p.work_dtype
    wq, wk, wv = (xp.astype(x, wd, copy=False) for x in (q, k, v))
    if fm.name in FEATURE_MAPS and fm is FEATURE_MAPS[fm.name]:
        maps = (fm.query, fm.key)
    else:
        maps = checked_maps(fm, q)
    # the engine's elu+1 makes one temporary less
    engine_maps = (numpy_kernel.elu_plus_one_,) * 2 if fm is FEATURE_MAPS["elu+1"] else maps
    m = fm.dim(p.d) if fm.dim is not None else None
    out, sz = _kernel_dispatch(
        p, wq, wk, wv, batch=p.batch, causal=causal, key_mask=key_mask, method=method,
        chunk_size=chunk_size, eps=eps, maps=maps, engine_maps=engine_maps, m=m,
        normalize=check_flag("normalize", normalize))
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
    if (isinstance(xp, str) or array_api_compat.is_array_api_obj(xp)
            or not callable(getattr(xp, "asarray", None))
            or not callable(getattr(xp, "zeros", None))):
        raise TypeError(f"xp must be an array namespace (the module, e.g. numpy, torch, "
                        f"jax.numpy, cupy, array_api_strict); got {xp!r:.80}")
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
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        check_array(name, x, min_ndim=1)
    p = check_qkv(q_t[..., None, :], k_t[..., None, :], v_t[..., None, :],
                  names=("q_t", "k_t", "v_t"))
    xp = p.xp
    wq, wk, wv = (xp.astype(x, p.work_dtype, copy=False) for x in (q_t, k_t, v_t))
    if not (fm.name in FEATURE_MAPS and fm is FEATURE_MAPS[fm.name]):
        fm = FeatureMap(fm.name, *checked_maps(fm, q_t))
    with entry(xp):
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
    check_no_causal(check_flag("causal", causal), "efficient_attention",
                    "its softmax over the keys normalises each feature over the whole "
                    "sequence, so every output depends on every (also future) key")
    p = check_qkv(q, k, v)
    check_key_mask(p, key_mask, q)
    if p.s == 0:
        return p.zeros()
    xp = p.xp
    wq, wk, wv = (xp.astype(x, p.work_dtype, copy=False) for x in (q, k, v))
    with entry(xp):   # the reference form on every backend (it is three products)
        out = reference.efficient_attention(wq, wk, wv, key_mask=key_mask)
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
