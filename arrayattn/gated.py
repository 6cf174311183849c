r"""Gated and delta-rule linear attention: RetNet retention, GLA, Mamba-2 SSD, DeltaNet and
gated DeltaNet.

The linear attention of Katharopoulos et al. without its denominator, with a decaying
state (the gated family) or an error-correcting update (the delta rule):

.. math::

    S_t = \operatorname{diag}(\alpha_t) S_{t-1} + k_t^\top v_t \quad\text{or}\quad
    S_t = \alpha_t (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t,
    \qquad o_t = q_t S_t .

These are causal sequence models (``n == s``; query ``t`` sees keys ``j <= t``) whose
output is not a normalised attention: the registry files them as family ``"gated"``, their
own architectures.  Every function takes gates in log space (``g = log alpha <= 0``; a
gate of 0 is ``-inf``, an exact restart) and runs the reference forms of
:mod:`arrayattn.reference.gated` -- the recurrence (``method="recurrent"``) or the chunked
form (``"chunked"``, the default) -- on every backend.  References: Sun et al. 2023
(RetNet), Yang et al. 2024 (GLA), Dao & Gu 2024 (Mamba-2), Schlag et al. 2021 and Yang et
al. 2024 (DeltaNet), Yang et al. 2025 (Gated DeltaNet).
"""
from __future__ import annotations

import numbers

import numpy as np
from array_api_compat import device as xp_device

from . import reference
from ._engine import entry
from ._validate import (Problem, check_array, check_choice, check_flag, check_key_mask,
                        check_positive_int, check_qkv, check_same_array_kind, check_seed)
from ._xp import xp_from_host
from .registry import Variant, register

__all__ = ["retention", "gla_attention", "ssd_attention", "delta_attention",
           "gated_delta_attention", "gated_attention_step", "retention_gammas",
           "checked_gated"]

METHODS = ("chunked", "recurrent")


def retention_gammas(heads: int) -> np.ndarray:
    """RetNet's per-head decays ``gamma_h = 1 - 2^(-5 - h)``, ``h = 0 ... heads-1`` (Sun
    et al. 2023, section 2.2), as a host float64 array.

    Examples
    --------
    >>> from arrayattn import retention_gammas
    >>> retention_gammas(3).tolist()
    [0.96875, 0.984375, 0.9921875]
    """
    return 1.0 - 2.0 ** (-5.0 - np.arange(check_positive_int("heads", heads)))


def _check_gate(p: Problem, name: str, x, q, *, per_dim: bool):
    """A real floating gate array ``(..., n)`` (``per_dim=False``) or ``(..., n, dk)``,
    broadcastable to the batch; returned in the working dtype as ``(..., n, 1)`` or
    ``(..., n, dk)``."""
    check_array(name, x)
    check_same_array_kind(p.xp, "q", q, name, x)
    if not p.xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype; got {x.dtype}")
    tail = (p.n, p.d) if per_dim else (p.n,)
    want = "(..., n, dk) = (..., %d, %d)" % tail if per_dim else f"(..., n) = (..., {p.n})"
    lead = tuple(x.shape[:x.ndim - len(tail)])
    if x.ndim < len(tail) or tuple(x.shape[x.ndim - len(tail):]) != tail or len(
            lead) > len(p.batch) or any(a not in (1, b) for a, b in zip(
                reversed(lead), reversed(p.batch))):
        raise ValueError(f"{name} must have shape {want} broadcastable to the batch "
                         f"{p.batch}; got shape {tuple(x.shape)}")
    x = p.xp.astype(x, p.work_dtype, copy=False)
    return x if per_dim else x[..., None]


def _check_state(p: Problem, state, q):
    if state is None:
        return p.xp.zeros((*p.batch, p.d, p.dv), dtype=p.work_dtype, device=p.device)
    check_array("initial_state", state)
    check_same_array_kind(p.xp, "q", q, "initial_state", state)
    if state.ndim < 2 or tuple(state.shape[-2:]) != (p.d, p.dv):
        raise ValueError(f"initial_state must have shape (..., dk, dv) = (..., {p.d}, "
                         f"{p.dv}); got shape {tuple(state.shape)}")
    zeros = p.xp.zeros((*p.batch, p.d, p.dv), dtype=p.work_dtype, device=p.device)
    try:
        return zeros + p.xp.astype(state, p.work_dtype, copy=False)
    except Exception as exc:   # a batch that does not broadcast
        raise ValueError(f"initial_state of shape {tuple(state.shape)} does not broadcast "
                         f"to the batch {p.batch}") from exc


def checked_gated(q, k, v, *, causal, key_mask, method, chunk_size, scale, initial_state,
                  return_state, gates=()):
    """The forward's checks (its backward's too): ``(p, method, chunk_size, return_state,
    S_0, [gate ...])``, each of ``gates = ((name, array, per_dim), ...)`` checked first."""
    p = check_qkv(q, k, v)
    gates = [_check_gate(p, name, x, q, per_dim=per_dim) for name, x, per_dim in gates]
    if not check_flag("causal", causal):
        raise ValueError("gated and delta-rule attention is causal (a recurrence over the "
                         "tokens); causal=False is not defined")
    if p.n != p.s:
        raise ValueError(f"gated and delta-rule attention needs n == s (self-attention "
                         f"over one sequence); got q {tuple(q.shape)}, k {tuple(k.shape)}")
    check_key_mask(p, key_mask, q)
    method = check_choice("method", method, METHODS)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    return_state = check_flag("return_state", return_state)
    if scale is not None and (isinstance(scale, bool) or not isinstance(
            scale, numbers.Real) or not np.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None; got {scale!r}")
    return p, method, chunk_size, return_state, _check_state(p, initial_state, q), gates


def _unit_rows(xp, x):
    """``x / ||x||`` per row.  A zero row stays zero; a NaN or inf row stays non-finite
    (divided by 1: the caller's non-finite check then drops it), never ``inf / inf``; a
    finite row whose squared norm overflows is first divided by its largest entry."""
    n = xp.linalg.vector_norm(x, axis=-1, keepdims=True)
    over = xp.isinf(n) & xp.all(xp.isfinite(x), axis=-1, keepdims=True)
    x = x / xp.where(over, xp.max(xp.abs(x), axis=-1, keepdims=True), 1.0)
    n = xp.where(over, xp.linalg.vector_norm(x, axis=-1, keepdims=True), n)
    return x / xp.where(xp.isfinite(n) & (n > 0), n, 1.0)


def _run(q, k, v, g, beta, *, causal, key_mask, method, chunk_size, scale,
         initial_state, return_state, normalize_qk=False, per_dim=False):
    """Validate, mask, dispatch once to the recurrence or the chunked form, cast back."""
    p, method, chunk_size, return_state, s0, _ = checked_gated(
        q, k, v, causal=causal, key_mask=key_mask, method=method, chunk_size=chunk_size,
        scale=scale, initial_state=initial_state, return_state=return_state)
    xp, wd = p.xp, p.work_dtype
    wq, wk, wv = (xp.astype(x, wd, copy=False) for x in (q, k, v))
    if normalize_qk:      # fla's use_qk_l2norm: unit q and k
        wq, wk = _unit_rows(xp, wq), _unit_rows(xp, wk)
    if scale is not None:
        wq = wq * float(scale)
    # A gate outside (0, 1] (g > 0, or NaN) makes the outputs from there on NaN:
    # checking it would read the device.
    g = xp.where(g <= 0.0, g, xp.nan)
    if key_mask is not None:   # a padded token leaves the state as it is
        wk, wv = reference.zero_masked_keys(key_mask, wk, wv)
        g = xp.where(key_mask[..., None], g, 0.0)
        beta = None if beta is None else xp.where(key_mask, beta, 0.0)
    # a non-finite key, value or beta, or a NaN gate, reaches only the rows from its
    # token on (-inf gates are restarts, not faults)
    bad = reference.nonfinite_rows(wk, wv) | xp.any(xp.isnan(g), axis=-1)
    if beta is not None:
        bad = bad | ~xp.isfinite(beta)
        beta = xp.where(bad, 0.0, beta)
    wk, wv = reference.drop_nonfinite(bad, wk, wv)
    g = xp.where(bad[..., None], 0.0, g)
    if p.n == 0:
        out, s = p.zeros(), s0
    else:
        with entry(xp):
            if beta is None and method == "recurrent":
                out, s = reference.gla_recurrent(wq, wk, wv, g, s0)
            elif beta is None:
                out, s = reference.gla_chunked(wq, wk, wv, g, s0, chunk_size)
            elif method == "recurrent":
                out, s = reference.delta_recurrent(wq, wk, wv, beta, g, s0)
            else:
                out, s = reference.delta_chunked(wq, wk, wv, beta, g, s0, chunk_size)
        out = reference.poison_rows(out, reference.seen_by_prefix(bad, p.n))
        out = xp.astype(xp.broadcast_to(out, p.out_shape), p.dtype, copy=False)
        s = xp.where(xp.any(bad, axis=-1)[..., None, None], xp.nan, s)
    s = xp.broadcast_to(s, (*p.batch, p.d, p.dv))
    return (out, xp.astype(s, p.dtype, copy=False)) if return_state else out


_COMMON = """causal : bool
        Must be ``True`` (the default): these are recurrences over the tokens.
    key_mask : boolean array ``(..., n)``, optional
        ``False`` marks padding: a padded token leaves the state unchanged (its key and
        value are dropped, its gate is 1); its own output row is still ``q_t S_t``.
    method : {"chunked", "recurrent"}
        The chunked form (default; quadratic inside chunks of ``chunk_size`` tokens, the
        state between them, decays in log space) or the recurrence, one token at a time;
        equal to rounding.
    chunk_size : int
        Tokens per chunk; ``n`` need not be a multiple of it (GLA rounds it up to a
        power of 2).  The defaults (32 for retention and SSD, 16 for the delta rule and
        GLA) are the fastest measured on a CPU at ``d = 64``
        (``benchmarks/bench_gated.py``).
    scale : float, optional
        Multiplies ``q``; ``None`` means no scale (fla's kernels default to
        ``dk**-0.5``: pass it to compare).
    initial_state : array ``(..., dk, dv)``, optional
        ``S_0`` (default zeros), e.g. the state returned by an earlier call.
    return_state : bool
        Also return the final state ``S_n (..., dk, dv)`` (input dtype), to continue
        with another call or :func:`gated_attention_step`.

    Returns
    -------
    out : array ``(..., n, dv)``
        Same namespace, device and dtype as ``q`` (float16/bfloat16 computed in float32).
    state : array ``(..., dk, dv)``
        With ``return_state=True``."""


def _doc(fn):
    fn.__doc__ = fn.__doc__.replace("    COMMON", "    " + _COMMON)
    return fn


@_doc
def retention(q, k, v, /, *, gamma=None, causal=True, key_mask=None, method="chunked",
              chunk_size=32, scale=None, initial_state=None, return_state=False):
    r"""Retention (RetNet; Sun et al. 2023, "Retentive Network: A Successor to Transformer
    for Large Language Models"): a constant decay ``gamma`` per head.

    .. math::

        S_t = \gamma S_{t-1} + k_t^\top v_t,\quad o_t = q_t S_t
        \quad\Longleftrightarrow\quad O = (Q K^\top \odot D) V,\ \
        D_{tj} = \gamma^{t-j} [j \le t].

    (The paper's xPos rotation and group norm are the model's, applied outside.)

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, dk)``, ``(..., n, dk)``, ``(..., n, dv)``
    gamma : float, sequence or array ``(..., H)``, optional
        Decays in ``(0, 1]``, one per head (the last axis of an array runs over the heads,
        axis ``-3`` of ``q``); ``None`` means RetNet's ``1 - 2^(-5 - h)``
        (:func:`retention_gammas`) over ``q.shape[-3]`` heads (one head for 2-D inputs).
    COMMON

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import retention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 10, 8)) for _ in range(3))
    >>> out = retention(q, k, v)                       # RetNet's per-head decays
    >>> d = 0.9 ** np.subtract.outer(np.arange(10), np.arange(10)) * np.tri(10)
    >>> bool(np.allclose(retention(q, k, v, gamma=0.9), ((q @ k.swapaxes(-1, -2)) * d) @ v))
    True
    """
    p = check_qkv(q, k, v)
    xp = p.xp
    if gamma is None:
        gamma = retention_gammas(q.shape[-3] if q.ndim >= 3 else 1)
    if isinstance(gamma, (numbers.Real, list, tuple, np.ndarray)):   # host numbers
        host = np.asarray(gamma, dtype=np.float64)
        if not np.all((host > 0) & (host <= 1)):
            raise ValueError(f"gamma must be decays in (0, 1]; got {gamma!r}")
        gamma = xp_from_host(xp, host, dtype=p.work_dtype, device=p.device)
    else:
        check_array("gamma", gamma)
        check_same_array_kind(xp, "q", q, "gamma", gamma)
        gamma = xp.astype(gamma, p.work_dtype, copy=False)
    # one gate per head: (..., H) -> (..., H, 1, 1), the same at every token
    g = xp.log(gamma)
    g = g[..., None, None] if g.ndim else g
    if g.ndim >= 3 and q.ndim >= 3 and g.shape[-3] not in (1, q.shape[-3]):
        raise ValueError(f"gamma has {g.shape[-3]} heads but q has {q.shape[-3]} "
                         f"(axis -3 of shape {tuple(q.shape)})")
    g = xp.zeros((p.n, 1), dtype=p.work_dtype, device=p.device) + g
    return _run(q, k, v, g, None, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                return_state=return_state)


@_doc
def gla_attention(q, k, v, g, /, *, causal=True, key_mask=None, method="chunked",
                  chunk_size=16, scale=None, initial_state=None, return_state=False):
    r"""Gated linear attention (GLA; Yang et al. 2024, "Gated Linear Attention
    Transformers with Hardware-Efficient Training"): a data-dependent gate per token and
    key dimension.

    .. math::

        S_t = \operatorname{diag}(\alpha_t) S_{t-1} + k_t^\top v_t,\quad o_t = q_t S_t,
        \qquad \alpha_t = e^{g_t} \in [0, 1]^{d_k}.

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, dk)``, ``(..., n, dk)``, ``(..., n, dv)``
    g : array ``(..., n, dk)``
        Log gates ``log alpha_t <= 0`` (in GLA ``logsigmoid(x W) / tau``); ``-inf`` is a
        gate of 0. A positive or NaN entry makes the outputs from that token on NaN.
    COMMON

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import gla_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 12, 4)) for _ in range(3))
    >>> g = -rng.random((2, 12, 4))
    >>> chunked = gla_attention(q, k, v, g, chunk_size=5)
    >>> bool(np.allclose(chunked, gla_attention(q, k, v, g, method="recurrent")))
    True
    """
    p = check_qkv(q, k, v)
    g = _check_gate(p, "g", g, q, per_dim=True)
    return _run(q, k, v, g, None, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                return_state=return_state)


@_doc
def ssd_attention(q, k, v, a, /, *, causal=True, key_mask=None, method="chunked",
                  chunk_size=32, scale=None, initial_state=None, return_state=False):
    r"""Mamba-2's state-space duality (SSD; Dao & Gu 2024, "Transformers are SSMs"): a
    scalar data-dependent decay per head and token.

    .. math::

        S_t = e^{a_t} S_{t-1} + k_t^\top v_t,\quad o_t = q_t S_t
        \quad\Longleftrightarrow\quad O = (L \odot Q K^\top) V,\ \
        L_{tj} = e^{a_{j+1} + \dots + a_t} [j \le t],

    with the paper's ``C = q``, ``B = k``, ``X = v`` and ``a_t = Delta_t A`` (the caller
    folds ``Delta_t`` into ``v`` or ``k`` as the model does; ``D``, the skip, is the
    model's).

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, dk)``, ``(..., n, dk)``, ``(..., n, dv)``
    a : array ``(..., n)``
        Log decays ``<= 0`` (``-inf``: a restart).
    COMMON

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import ssd_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((3, 9, 4)) for _ in range(3))
    >>> a = -rng.random((3, 9))
    >>> c = np.cumsum(a, axis=-1)
    >>> L = np.exp(c[:, :, None] - c[:, None, :]) * np.tri(9)
    >>> bool(np.allclose(ssd_attention(q, k, v, a), (L * (q @ k.swapaxes(1, 2))) @ v))
    True
    """
    p = check_qkv(q, k, v)
    a = _check_gate(p, "a", a, q, per_dim=False)
    return _run(q, k, v, a, None, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                return_state=return_state)


def _delta_doc(fn):
    fn.__doc__ = fn.__doc__.replace("    DELTA", """    beta : array ``(..., n)``
        Writing strengths ``beta_t`` (in DeltaNet ``sigmoid(x W_beta)``, in ``(0, 1)``).
        The update is a contraction when ``0 <= beta_t ||k_t||^2 <= 2`` (unit keys and
        ``beta`` in ``[0, 2]``); outside it the state can grow without bound.
    normalize_qk : bool
        L2-normalise ``q`` and ``k`` first (fla's ``use_qk_l2norm_in_kernel``; DeltaNet
        layers do so).""")
    return _doc(fn)


@_delta_doc
def delta_attention(q, k, v, beta, /, *, normalize_qk=False, causal=True, key_mask=None,
                    method="chunked", chunk_size=16, scale=None, initial_state=None,
                    return_state=False):
    r"""DeltaNet: linear attention with the delta rule (Schlag, Irie & Schmidhuber 2021,
    "Linear Transformers Are Secretly Fast Weight Programmers"; chunked by the WY/UT form
    of Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length").

    .. math::

        S_t = S_{t-1} + k_t^\top \beta_t (v_t - k_t S_{t-1})
            = (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t,
        \qquad o_t = q_t S_t:

    the value the memory holds at key ``k_t`` moves a fraction ``beta_t`` towards ``v_t``
    (for a unit key and ``beta_t = 1`` it is overwritten).

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, dk)``, ``(..., n, dk)``, ``(..., n, dv)``
    DELTA
    COMMON

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import delta_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))
    >>> beta = rng.random((2, 10))
    >>> out = delta_attention(q, k, v, beta, normalize_qk=True, chunk_size=4)
    >>> rec = delta_attention(q, k, v, beta, normalize_qk=True, method="recurrent")
    >>> bool(np.allclose(out, rec))
    True
    """
    p = check_qkv(q, k, v)
    beta = _check_gate(p, "beta", beta, q, per_dim=False)[..., 0]
    g = p.xp.zeros((p.n, 1), dtype=p.work_dtype, device=p.device)
    return _run(q, k, v, g, beta, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                return_state=return_state, normalize_qk=check_flag("normalize_qk",
                                                                   normalize_qk))


@_delta_doc
def gated_delta_attention(q, k, v, beta, g, /, *, normalize_qk=False, causal=True,
                          key_mask=None, method="chunked", chunk_size=16, scale=None,
                          initial_state=None, return_state=False):
    r"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks: Improving
    Mamba2 with Delta Rule"): the delta rule with Mamba-2's scalar decay.

    .. math::

        S_t = \alpha_t (I - \beta_t k_t^\top k_t) S_{t-1} + \beta_t k_t^\top v_t,
        \qquad o_t = q_t S_t,\qquad \alpha_t = e^{g_t}.

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, dk)``, ``(..., n, dk)``, ``(..., n, dv)``
    DELTA
    g : array ``(..., n)``
        Log decays ``<= 0`` (``-inf``: a restart); ``g = 0`` is DeltaNet.
    COMMON

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import delta_attention, gated_delta_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))
    >>> beta = rng.random((2, 10))
    >>> same = gated_delta_attention(q, k, v, beta, np.zeros((2, 10)), normalize_qk=True)
    >>> bool(np.allclose(same, delta_attention(q, k, v, beta, normalize_qk=True)))
    True
    """
    p = check_qkv(q, k, v)
    beta = _check_gate(p, "beta", beta, q, per_dim=False)[..., 0]
    g = _check_gate(p, "g", g, q, per_dim=False)
    return _run(q, k, v, g, beta, causal=causal, key_mask=key_mask, method=method,
                chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                return_state=return_state, normalize_qk=check_flag("normalize_qk",
                                                                   normalize_qk))


def gated_attention_step(q_t, k_t, v_t, state, /, *, g_t=None, beta_t=None, scale=None,
                         normalize_qk=False):
    r"""One decoding step of any member of the family: ``(o_t, S_t)`` from ``S_(t-1)``.

    ``S_t = diag(exp g_t) S_(t-1) + k_t^T v_t`` (``beta_t`` None), or
    ``S_t = exp(g_t) (I - beta_t k_t^T k_t) S_(t-1) + beta_t k_t^T v_t``; ``o_t = q_t S_t``.

    Parameters
    ----------
    q_t, k_t, v_t : arrays, shapes ``(..., dk)``, ``(..., dk)``, ``(..., dv)``
    state : array ``(..., dk, dv)``
        ``S_(t-1)``, e.g. from ``return_state=True``.
    g_t : array, optional
        Log gate(s): ``(..., dk)`` per key dimension (GLA) or ``(...)`` one per token
        (retention: ``log gamma``; SSD; gated DeltaNet); ``None``: no decay.
    beta_t : array ``(...)``, optional
        The delta rule's writing strength; ``None``: the additive (gated) update.
    scale, normalize_qk
        As in the full-sequence functions.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import gla_attention, gated_attention_step
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
    >>> g = -rng.random((2, 6, 4))
    >>> full = gla_attention(q, k, v, g)
    >>> out, s = gla_attention(q[:, :4], k[:, :4], v[:, :4], g[:, :4], return_state=True)
    >>> for t in (4, 5):
    ...     o, s = gated_attention_step(q[:, t], k[:, t], v[:, t], s, g_t=g[:, t])
    >>> bool(np.allclose(o, full[:, 5]))
    True
    """
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        check_array(name, x, min_ndim=1)
    q, k, v = (x[..., None, :] for x in (q_t, k_t, v_t))
    p = check_qkv(q, k, v)
    xp = p.xp
    if g_t is None:
        g = xp.zeros((1, 1), dtype=p.work_dtype, device=p.device)
    else:
        check_array("g_t", g_t)
        per_dim = g_t.ndim >= 1 and g_t.shape[-1] == p.d and g_t.ndim == q_t.ndim
        g = _check_gate(p, "g_t", g_t[..., None, :] if per_dim else g_t[..., None], q,
                        per_dim=per_dim)
    beta = None
    if beta_t is not None:
        check_array("beta_t", beta_t)
        beta = _check_gate(p, "beta_t", beta_t[..., None], q, per_dim=False)[..., 0]
    out, s = _run(q, k, v, g, beta, causal=True, key_mask=None, method="recurrent",
                  chunk_size=1, scale=scale, initial_state=state, return_state=True,
                  normalize_qk=check_flag("normalize_qk", normalize_qk))
    return out[..., 0, :], s


# ---------------------------------------------------------------------------------
# Registry: the uniform call has no gates; these adapters draw them on the host.
# ---------------------------------------------------------------------------------

def _draw(q, shape, seed, fn):
    """``fn(rng)`` of ``shape`` drawn with ``numpy.random.default_rng(seed)`` in float64,
    moved to ``q``'s library and device in ``q``'s dtype."""
    from array_api_compat import array_namespace
    xp = array_namespace(q)
    host = fn(np.random.default_rng(check_seed(seed)), shape)
    return xp_from_host(xp, host, dtype=q.dtype, device=xp_device(q))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _default_gammas(q, options: dict) -> dict:
    """RetNet's per-head decays for ``q``'s heads, resolved before grouped-query heads
    split them (query head ``h`` keeps ``gamma_h``)."""
    if options.get("gamma") is not None or getattr(q, "ndim", 0) < 3:
        return options
    from array_api_compat import array_namespace
    xp = array_namespace(q)
    wd = q.dtype if xp.isdtype(q.dtype, "real floating") else xp.float64
    gammas = xp_from_host(xp, retention_gammas(q.shape[-3]), dtype=wd, device=xp_device(q))
    return {**options, "gamma": gammas}


def _checked(call):
    """A uniform-call adapter that validates ``q, k, v`` before drawing anything."""
    def adapter(q, k, v, /, **options):
        check_qkv(q, k, v)
        return call(q, k, v, **options)
    adapter.__name__ = call.__name__
    return adapter


@_checked
def _gla_call(q, k, v, /, *, seed=0, **options):
    g = _draw(q, q.shape, seed, lambda r, s: _log_sigmoid(r.standard_normal(s) + 3.0))
    return gla_attention(q, k, v, g, **options)


@_checked
def _ssd_call(q, k, v, /, *, seed=0, **options):
    a = _draw(q, q.shape[:-1], seed, lambda r, s: -np.exp(r.normal(-2.5, 0.5, s)))
    return ssd_attention(q, k, v, a, **options)


@_checked
def _delta_call(q, k, v, /, *, seed=0, **options):
    beta = _draw(q, q.shape[:-1], seed, lambda r, s: 1.0 / (1.0 + np.exp(-r.standard_normal(s))))
    return delta_attention(q, k, v, beta, **options)


@_checked
def _gated_delta_call(q, k, v, /, *, seed=0, **options):
    def draws(r, s):
        return np.stack([1.0 / (1.0 + np.exp(-r.standard_normal(s))),
                         _log_sigmoid(r.standard_normal(s) + 3.0)])
    bg = _draw(q, q.shape[:-1], seed, draws)
    return gated_delta_attention(q, k, v, bg[0, ...], bg[1, ...], **options)


_GATED = dict(family="gated", exact=False, causal=True, key_mask=True, normalized=False,
              cross=False)
_DRAWN = ("drawn on the host with numpy.random.default_rng(seed), in q's dtype and on "
          "its device")

register(Variant(
    name="retention", fn=retention, **_GATED, prepare=_default_gammas,
    complexity="O(n c d + n d dv) time (chunks of c), O(n c + d dv) memory",
    citation="Sun et al. 2023, Retentive Network: A Successor to Transformer for LLMs",
    notes="Unnormalised; RetNet's per-head decays 1 - 2^(-5-h) over axis -3.",
))
register(Variant(
    name="gla", fn=gla_attention, call=_gla_call, **_GATED, random=True,
    defaults={"seed": 0},
    complexity="O(n c d + n d dv) time, O(n c d) memory (per-dimension pair decays)",
    citation="Yang et al. 2024, Gated Linear Attention Transformers with "
             "Hardware-Efficient Training",
    notes="Uniform call: gates log(sigmoid(N(3, 1))) per token and key dimension, "
          + _DRAWN + ".",
))
register(Variant(
    name="ssd", fn=ssd_attention, call=_ssd_call, **_GATED, random=True,
    defaults={"seed": 0},
    complexity="O(n c d + n d dv) time, O(n c + d dv) memory",
    citation="Dao & Gu 2024, Transformers are SSMs (Mamba-2)",
    notes="Uniform call: log decays -exp(N(-2.5, 0.5)) per token, " + _DRAWN + ".",
))
register(Variant(
    name="deltanet", fn=delta_attention, call=_delta_call, **_GATED, random=True,
    defaults={"seed": 0, "normalize_qk": True},
    complexity="O(n c d + n d dv + n c^2) time, O(n c + d dv) memory",
    citation="Schlag et al. 2021; Yang et al. 2024, Parallelizing Linear Transformers "
             "with the Delta Rule over Sequence Length",
    notes="Uniform call: beta = sigmoid(N(0, 1)) per token, " + _DRAWN
          + "; q and k L2-normalised.",
))
register(Variant(
    name="gated_deltanet", fn=gated_delta_attention, call=_gated_delta_call, **_GATED,
    random=True, defaults={"seed": 0, "normalize_qk": True},
    complexity="O(n c d + n d dv + n c^2) time, O(n c + d dv) memory",
    citation="Yang, Kautz & Hatamizadeh 2025, Gated Delta Networks: Improving Mamba2 "
             "with Delta Rule",
    notes="Uniform call: beta = sigmoid(N(0, 1)) and log decays log(sigmoid(N(3, 1))) per "
          "token, " + _DRAWN + "; q and k L2-normalised.",
))
