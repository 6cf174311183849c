"""The decoding API: the recurrent state of causal kernel attention and its one-token steps
(a prompt's state comes from ``return_state=True``; the gated family's step is
:mod:`arrayattn.gated.api.step`)."""
from __future__ import annotations

import array_api_compat

from ..core.engine import entry
from .run import run_features
from .state import LinearAttentionState
from ..core.checks import check_tokens, check_positive_int, check_qkv
from .checks import checked_maps
from ..core.xp import compute_dtype
from .feature_maps import FEATURE_MAPS, FeatureMap, get_feature_map

__all__ = ["LinearAttentionState", "linear_attention_state", "linear_attention_step",
           "feature_attention_step"]


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
    >>> from arrayattn import linear_attention_state
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
    check_tokens(("phi_q_t", "phi_k_t", "v_t"), phi_q_t, phi_k_t, v_t)
    out, new = run_features(phi_q_t[..., None, :], phi_k_t[..., None, :], v_t[..., None, :],
                            causal=True, key_mask=None, eps=eps, method="recurrent",
                            chunk_size=64, return_state=True, state=state)
    return out[..., 0, :], new


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
    check_tokens(("q_t", "k_t", "v_t"), q_t, k_t, v_t)
    p = check_qkv(q_t[..., None, :], k_t[..., None, :], v_t[..., None, :],
                  names=("q_t", "k_t", "v_t"))
    xp = p.xp
    wq, wk, wv = (xp.astype(x, p.work_dtype, copy=False) for x in (q_t, k_t, v_t))
    if not (fm.name in FEATURE_MAPS and fm is FEATURE_MAPS[fm.name]):
        fm = FeatureMap(fm.name, *checked_maps(fm, q_t))
    with entry(xp):
        out, new = feature_attention_step(fm.query(wq), fm.key(wk), wv, state, eps=eps)
    return xp.astype(out, p.dtype, copy=False), new
