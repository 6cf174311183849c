"""The one-token step of the gated and delta-rule family (decoding; a prompt's state comes
from ``return_state=True``)."""
from __future__ import annotations


from .run import run_gated
from ..core.checks import check_array, check_tokens, check_flag, check_qkv
from .checks import check_gate

__all__ = ["gated_attention_step"]


def gated_attention_step(q_t, k_t, v_t, state, /, *, g_t=None, beta_t=None, scale=None,
                         normalize_qk=False):
    r"""One decoding step of any member of the gated family: ``(o_t, S_t)`` from
    ``S_(t-1)``.

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
    check_tokens(("q_t", "k_t", "v_t"), q_t, k_t, v_t)
    q, k, v = (x[..., None, :] for x in (q_t, k_t, v_t))
    p = check_qkv(q, k, v)
    if g_t is None:
        g = p.xp.zeros((1, 1), dtype=p.work_dtype, device=p.device)
    else:
        check_array("g_t", g_t)
        per_dim = g_t.ndim >= 1 and g_t.shape[-1] == p.d and g_t.ndim == q_t.ndim
        g = check_gate(p, "g_t", g_t[..., None, :] if per_dim else g_t[..., None], q,
                       per_dim=per_dim)
    beta = None
    if beta_t is not None:
        check_array("beta_t", beta_t)
        beta = check_gate(p, "beta_t", beta_t[..., None], q, per_dim=False)[..., 0]
    out, s = run_gated(q, k, v, g, beta, causal=True, key_mask=None, method="recurrent",
                       chunk_size=1, scale=scale, initial_state=state, return_state=True,
                       normalize_qk=check_flag("normalize_qk", normalize_qk))
    return out[..., 0, :], s
