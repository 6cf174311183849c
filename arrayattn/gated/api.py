"""The gated and delta-rule attention functions -- RetNet retention, GLA, Mamba-2 SSD,
DeltaNet and gated DeltaNet: each a signature, its numpydoc and one pipeline call
(:mod:`arrayattn.core.pipeline`; the checks in :mod:`arrayattn.gated.checks`, the forms'
dispatch in :mod:`arrayattn.gated.run`), and their registry records.

``scale=None`` means *no scale* in this family (fla's gated kernels take the scale
explicitly), where the rest of the library reads it as ``1/sqrt(d)``.
"""
from __future__ import annotations

from dataclasses import replace

from .draws import (DELTA_DRAWS, GATED_DELTA_DRAWS, GLA_DRAWS, SSD_DRAWS, default_gammas,
                    retention_gammas)
from .run import gated_empty, gated_engine, gated_reference, gated_work
from .checks import (check_delta, check_gated_delta, check_gla, check_retention, check_ssd,
                     drawn_check)
from ..core.pipeline import Spec, run
# moved (kept importable from here): the decoding step and the family's checks
from .step import gated_attention_step
from .checks import checked_gated

__all__ = ["retention", "gla_attention", "ssd_attention", "delta_attention",
           "gated_delta_attention", "retention_gammas",
           # the registry's uniform calls (arrayattn.registry.catalogue)
           "default_gammas", "gla_uniform", "ssd_uniform", "delta_uniform",
           "gated_delta_uniform",
           # the pipeline's specs: the public functions' and the registry calls'
           "NONE_MEANS", "RETENTION_SPEC", "GLA_SPEC", "SSD_SPEC", "DELTA_SPEC",
           "GATED_DELTA_SPEC",
           "GLA_CALL_SPEC", "SSD_CALL_SPEC", "DELTA_CALL_SPEC", "GATED_DELTA_CALL_SPEC",
           # moved; re-exported
           "gated_attention_step", "checked_gated"]


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
        (``benchmarks/results/gated.md``).
    scale : float, optional
        Multiplies ``q``; ``None`` means **no scale** -- unlike the rest of arrayattn,
        where it means ``1/sqrt(d)``: fla's gated kernels take the scale explicitly (their
        default is ``dk**-0.5``: pass it to compare).
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
    return run(RETENTION_SPEC, q, k, v, gamma=gamma,
               causal=causal, key_mask=key_mask, method=method,
               chunk_size=chunk_size, scale=scale, initial_state=initial_state,
               return_state=return_state)


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
    return run(GLA_SPEC, q, k, v, g=g,
               causal=causal, key_mask=key_mask, method=method,
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
    return run(SSD_SPEC, q, k, v, a=a,
               causal=causal, key_mask=key_mask, method=method,
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
    return run(DELTA_SPEC, q, k, v, beta=beta, normalize_qk=normalize_qk,
               causal=causal, key_mask=key_mask, method=method,
               chunk_size=chunk_size, scale=scale, initial_state=initial_state,
               return_state=return_state)


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
    return run(GATED_DELTA_SPEC, q, k, v, beta=beta, g=g, normalize_qk=normalize_qk,
               causal=causal, key_mask=key_mask, method=method,
               chunk_size=chunk_size, scale=scale, initial_state=initial_state,
               return_state=return_state)


#: What ``None`` means for the family's options.
NONE_MEANS = {"key_mask": "every token is real",
              "scale": "no scale: q as given (fla's convention for gated kernels; the rest "
                       "of arrayattn reads None as 1/sqrt(d))",
              "initial_state": "zeros"}


def _spec(name, check, **none_means):
    return Spec(name=name, check=check, reference=gated_reference, engine=gated_engine,
                work=gated_work, empty=gated_empty, none_means={**NONE_MEANS, **none_means})


#: The pipelines of the public functions (:func:`arrayattn.core.pipeline.run`).
RETENTION_SPEC = _spec("retention", check_retention,
                       gamma="RetNet's 1 - 2^(-5-h) per head (retention_gammas)")
GLA_SPEC = _spec("gla_attention", check_gla)
SSD_SPEC = _spec("ssd_attention", check_ssd)
DELTA_SPEC = _spec("delta_attention", check_delta)
GATED_DELTA_SPEC = _spec("gated_delta_attention", check_gated_delta)


# ---------------------------------------------------------------------------------
# Registry: the uniform call has no gates; these calls draw them on the host from seed
# (arrayattn.gated.draws) after checking q, k, v, which they check once -- unless the
# caller passes them (the records' ``draws``: jax.jit arguments, not constants).
# ---------------------------------------------------------------------------------


GLA_CALL_SPEC = replace(GLA_SPEC, name="gla",
                        check=drawn_check(gla_attention, check_gla, GLA_DRAWS))
SSD_CALL_SPEC = replace(SSD_SPEC, name="ssd",
                        check=drawn_check(ssd_attention, check_ssd, SSD_DRAWS))
DELTA_CALL_SPEC = replace(DELTA_SPEC, name="deltanet",
                          check=drawn_check(delta_attention, check_delta, DELTA_DRAWS))
GATED_DELTA_CALL_SPEC = replace(GATED_DELTA_SPEC, name="gated_deltanet", check=drawn_check(
    gated_delta_attention, check_gated_delta, GATED_DELTA_DRAWS))


def gla_uniform(q, k, v, /, *, seed=0, **options):
    return run(GLA_CALL_SPEC, q, k, v, seed=seed, **options)


def ssd_uniform(q, k, v, /, *, seed=0, **options):
    return run(SSD_CALL_SPEC, q, k, v, seed=seed, **options)


def delta_uniform(q, k, v, /, *, seed=0, **options):
    return run(DELTA_CALL_SPEC, q, k, v, seed=seed, **options)


def gated_delta_uniform(q, k, v, /, *, seed=0, **options):
    return run(GATED_DELTA_CALL_SPEC, q, k, v, seed=seed, **options)
