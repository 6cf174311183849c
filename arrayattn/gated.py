"""The gated and delta-rule attention functions -- RetNet retention, GLA, Mamba-2 SSD,
DeltaNet and gated DeltaNet -- with their registry records and the gates their uniform
calls draw."""
from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace
from array_api_compat import device as xp_device

from ._linear_run import run_gated
from ._validate import check_flag, check_positive_int, check_qkv, check_seed
from ._validate_linear import check_gamma, check_gate
from ._xp import xp_from_host
# moved (kept importable from here): the decoding step and the family's checks
from .decoding import gated_attention_step
from ._validate_linear import checked_gated

__all__ = ["retention", "gla_attention", "ssd_attention", "delta_attention",
           "gated_delta_attention", "retention_gammas",
           # the registry's uniform calls (arrayattn.catalogue)
           "default_gammas", "gla_uniform", "ssd_uniform", "delta_uniform",
           "gated_delta_uniform",
           # the forward's gates, for the backward adapters (arrayattn.backward)
           "retention_log_gates", "drawn_gla_gates", "drawn_ssd_decays",
           "drawn_delta_betas", "drawn_gated_delta_gates",
           # moved; re-exported
           "gated_attention_step", "checked_gated"]


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
    causal : bool
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
        With ``return_state=True``.

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
    return run_gated(q, k, v, retention_log_gates(q, k, v, gamma), None, causal=causal,
                     key_mask=key_mask, method=method, chunk_size=chunk_size, scale=scale,
                     initial_state=initial_state, return_state=return_state)


def retention_log_gates(q, k, v, gamma):
    """``log gamma`` checked and laid out as one gate per token ``(..., H, n, 1)``."""
    p = check_qkv(q, k, v)
    xp = p.xp
    if gamma is None:     # (an empty batch of no heads takes one decay, for its shape)
        gamma = retention_gammas(max(q.shape[-3], 1) if q.ndim >= 3 else 1)
    # one gate per head: (..., H) -> (..., H, 1, 1), the same at every token
    g = xp.log(check_gamma(p, gamma, q))
    g = g[..., None, None] if g.ndim else g
    if g.ndim >= 3 and q.ndim >= 3 and g.shape[-3] not in (1, q.shape[-3]):
        raise ValueError(f"gamma has {g.shape[-3]} heads but q has {q.shape[-3]} "
                         f"(axis -3 of shape {tuple(q.shape)})")
    return xp.zeros((p.n, 1), dtype=p.work_dtype, device=p.device) + g


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
    causal, key_mask, method, chunk_size, scale, initial_state, return_state
        As in :func:`retention`, as are the returned ``out`` and ``state``.

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
    g = check_gate(check_qkv(q, k, v), "g", g, q, per_dim=True)
    return run_gated(q, k, v, g, None, causal=causal, key_mask=key_mask, method=method,
                     chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                     return_state=return_state)


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
    causal, key_mask, method, chunk_size, scale, initial_state, return_state
        As in :func:`retention`, as are the returned ``out`` and ``state``.

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
    a = check_gate(check_qkv(q, k, v), "a", a, q, per_dim=False)
    return run_gated(q, k, v, a, None, causal=causal, key_mask=key_mask, method=method,
                     chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                     return_state=return_state)


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
    beta : array ``(..., n)``
        Writing strengths ``beta_t`` (in DeltaNet ``sigmoid(x W_beta)``, in ``(0, 1)``).
        The update is a contraction when ``0 <= beta_t ||k_t||^2 <= 2`` (unit keys and
        ``beta`` in ``[0, 2]``); outside it the state can grow without bound.
    normalize_qk : bool
        L2-normalise ``q`` and ``k`` first (fla's ``use_qk_l2norm_in_kernel``; DeltaNet
        layers do so).
    causal, key_mask, method, chunk_size, scale, initial_state, return_state
        As in :func:`retention`, as are the returned ``out`` and ``state``.

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
    beta = check_gate(p, "beta", beta, q, per_dim=False)[..., 0]
    g = p.xp.zeros((p.n, 1), dtype=p.work_dtype, device=p.device)
    return run_gated(q, k, v, g, beta, causal=causal, key_mask=key_mask, method=method,
                     chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                     return_state=return_state,
                     normalize_qk=check_flag("normalize_qk", normalize_qk))


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
    beta : array ``(..., n)``
        Writing strengths, as in :func:`delta_attention`.
    g : array ``(..., n)``
        Log decays ``<= 0`` (``-inf``: a restart); ``g = 0`` is DeltaNet.
    normalize_qk : bool
        As in :func:`delta_attention`.
    causal, key_mask, method, chunk_size, scale, initial_state, return_state
        As in :func:`retention`, as are the returned ``out`` and ``state``.

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
    beta = check_gate(p, "beta", beta, q, per_dim=False)[..., 0]
    g = check_gate(p, "g", g, q, per_dim=False)
    return run_gated(q, k, v, g, beta, causal=causal, key_mask=key_mask, method=method,
                     chunk_size=chunk_size, scale=scale, initial_state=initial_state,
                     return_state=return_state,
                     normalize_qk=check_flag("normalize_qk", normalize_qk))


# ---------------------------------------------------------------------------------
# Registry: the uniform call has no gates; these adapters draw them on the host.
# ---------------------------------------------------------------------------------

def _draw(q, shape, seed, fn):
    """``fn(rng)`` of ``shape`` drawn with ``numpy.random.default_rng(seed)`` in float64,
    moved to ``q``'s library and device in ``q``'s dtype."""
    xp = array_namespace(q)
    host = fn(np.random.default_rng(check_seed(seed)), shape)
    return xp_from_host(xp, host, dtype=q.dtype, device=xp_device(q))


def _log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def default_gammas(q, options: dict) -> dict:
    """RetNet's per-head decays for ``q``'s heads, resolved before grouped-query heads
    split them (query head ``h`` keeps ``gamma_h``)."""
    if options.get("gamma") is not None or getattr(q, "ndim", 0) < 3 or q.shape[-3] == 0:
        return options
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


def drawn_gla_gates(q, seed):
    """``gla``'s gates: ``log sigmoid(N(3, 1))`` per token and key dimension."""
    return _draw(q, q.shape, seed, lambda r, s: _log_sigmoid(r.standard_normal(s) + 3.0))


def drawn_ssd_decays(q, seed):
    """``ssd``'s log decays: ``-exp(N(-2.5, 0.5))`` per token."""
    return _draw(q, q.shape[:-1], seed, lambda r, s: -np.exp(r.normal(-2.5, 0.5, s)))


def drawn_delta_betas(q, seed):
    """``deltanet``'s writing strengths: ``sigmoid(N(0, 1))`` per token."""
    return _draw(q, q.shape[:-1], seed, lambda r, s: _sigmoid(r.standard_normal(s)))


def drawn_gated_delta_gates(q, seed):
    """``gated_deltanet``'s ``(beta, g)``: ``sigmoid(N(0, 1))`` and
    ``log sigmoid(N(3, 1))`` per token, in that draw order."""
    bg = _draw(q, q.shape[:-1], seed, lambda r, s: np.stack([
        _sigmoid(r.standard_normal(s)), _log_sigmoid(r.standard_normal(s) + 3.0)]))
    return bg[0, ...], bg[1, ...]


@_checked
def gla_uniform(q, k, v, /, *, seed=0, **options):
    return gla_attention(q, k, v, drawn_gla_gates(q, seed), **options)


@_checked
def ssd_uniform(q, k, v, /, *, seed=0, **options):
    return ssd_attention(q, k, v, drawn_ssd_decays(q, seed), **options)


@_checked
def delta_uniform(q, k, v, /, *, seed=0, **options):
    return delta_attention(q, k, v, drawn_delta_betas(q, seed), **options)


@_checked
def gated_delta_uniform(q, k, v, /, *, seed=0, **options):
    return gated_delta_attention(q, k, v, *drawn_gated_delta_gates(q, seed), **options)
