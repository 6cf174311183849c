"""The kernel-attention functions: linear attention (Katharopoulos et al. 2020) on a feature
map or on given features, and efficient attention (Shen et al. 2021), with their registry
records."""
from __future__ import annotations

from .run import EFFICIENT_SPEC, FEATURES_SPEC, LINEAR_SPEC
from .state import LinearAttentionState
from .checks import check_kernel_options, checked_maps
from ..core.pipeline import run
# moved (kept importable from here): the decoding API and the family's checks
from .decoding import feature_attention_step, linear_attention_state, linear_attention_step
from .checks import CAUSAL_METHODS, check_eps, check_state

__all__ = [
    "feature_attention", "linear_attention", "efficient_attention",
    # moved; re-exported
    "LinearAttentionState", "feature_attention_step", "linear_attention_state",
    "linear_attention_step", "check_eps", "check_kernel_options", "check_state",
    "checked_maps", "LINEAR_SPEC", "FEATURES_SPEC", "EFFICIENT_SPEC",
]


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
    return run(FEATURES_SPEC, phi_q, phi_k, v, causal=causal, key_mask=key_mask, eps=eps,
               method=method, chunk_size=chunk_size, return_state=return_state, state=state)


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
        :func:`~arrayattn.kernel.feature_maps.taylor_feature_map` for an input scale), a
        :class:`~arrayattn.kernel.feature_maps.FeatureMap`, one callable for queries and keys,
        or a pair ``(phi_q, phi_k)``.  Applied in the working dtype.
    causal, key_mask, eps, method, chunk_size, return_state
        As in :func:`feature_attention`: end-aligned causality in three equal forms
        (``"chunked"`` default, ``"cumsum"``, ``"recurrent"``); masked keys leave
        numerator and denominator; ``eps`` only guards a zero denominator.
        A query whose kernel values are all zero (``relu``: no positive coordinate, or
        none shared with a visible key) has no normalised attention (``0 / 0``): its row
        returns **zeros**, as a row with no visible key does -- not the mean of ``v``,
        and never NaN.
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
    return run(LINEAR_SPEC, q, k, v, feature_map=feature_map, causal=causal,
               key_mask=key_mask, eps=eps, method=method, chunk_size=chunk_size,
               return_state=return_state, normalize=normalize)


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
    return run(EFFICIENT_SPEC, q, k, v, causal=causal, key_mask=key_mask)


# ---------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------
