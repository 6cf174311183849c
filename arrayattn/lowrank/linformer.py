"""Linformer: softmax attention over keys and values compressed along the sequence axis.

.. math::

    \\operatorname{Linformer}(Q, K, V) = \\operatorname{softmax}\\!\\left(
        Q (E K)^\\top \\cdot \\text{scale}\\right) (F V),
    \\qquad E, F \\in \\mathbb{R}^{m \\times s}

Wang et al. 2020, "Linformer: Self-Attention with Linear Complexity" (arXiv:2006.04768),
equation (7); the random projections of their Theorem 1 have i.i.d. ``N(0, 1/m)``
entries; ``F = E`` is the paper's "key-value sharing" variant (section 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from ..core.checks import (Problem, check_array, check_flag, check_key_mask, check_no_causal,
                           check_positive_int, check_qkv, check_scale, check_seed)
from .checks import LINFORMER_NOT_CAUSAL, check_linformer_projection
from ..core.xp import xp_device, xp_from_host, xp_namespace
from ..core.pipeline import Spec, Working, run

__all__ = ["linformer_attention", "linformer_projection", "LinformerCall",
           "checked_linformer", "SPEC", "host_to_q", "uniform_call"]


def linformer_projection(proj_dim: int, s: int, *, seed=0) -> np.ndarray:
    """The host-drawn Linformer projection ``E (proj_dim, s)`` with i.i.d. ``N(0, 1/proj_dim)`` entries.

    Drawn with ``numpy.random.default_rng(seed)`` in float64, so the same seed gives the
    same matrix on every backend; :func:`linformer_attention` draws exactly this matrix
    when no ``e`` is given.  ``seed`` is a non-negative integer (``None``, fresh entropy,
    is refused: a reference result must be reproducible).

    Examples
    --------
    >>> from arrayattn import linformer_projection
    >>> e = linformer_projection(4, 10, seed=0)
    >>> e.shape
    (4, 10)
    """
    proj_dim = check_positive_int("proj_dim", proj_dim)
    s = check_positive_int("s", s, minimum=0)
    rng = np.random.default_rng(check_seed(seed))
    return rng.standard_normal((proj_dim, s)) / np.sqrt(proj_dim)


@dataclass(frozen=True)
class LinformerCall:
    """A validated :func:`linformer_attention` call: ``e`` and ``f`` in the working dtype
    (``f is e`` when ``f`` was not given; ``e`` drawn from ``seed`` when not given)."""

    p: Problem
    key_mask: Any
    scale: float
    e: Any
    f: Any


def checked_linformer(q, k, v, *, e, f, proj_dim, seed, scale, key_mask,
                      causal) -> LinformerCall:
    """The validation of :func:`linformer_attention`, shared with its backward; ``E``
    drawn here (:func:`linformer_projection`) when not given."""
    p = check_qkv(q, k, v)
    check_no_causal(check_flag("causal", causal), "linformer_attention",
                    LINFORMER_NOT_CAUSAL)
    check_key_mask(p, key_mask, q)
    scale = check_scale(scale, p.d)
    xp, wd = p.xp, p.work_dtype
    if e is None:
        if f is not None:
            raise ValueError("f was given without e; pass e as well (or neither)")
        proj_dim = check_positive_int("proj_dim", proj_dim)
        e = xp_from_host(xp, linformer_projection(proj_dim, p.s, seed=seed),
                         dtype=wd, device=p.device)
    else:
        check_linformer_projection(p, "e", e, q)
        e = xp.astype(e, wd, copy=False)
    if f is None:
        f = e
    else:
        check_linformer_projection(p, "f", f, q)
        if f.shape[-2] != e.shape[-2]:
            raise ValueError(
                f"e and f must project to the same m; got e {tuple(e.shape)}, "
                f"f {tuple(f.shape)}"
            )
        f = xp.astype(f, wd, copy=False)
    return LinformerCall(p, key_mask, scale, e, f)


def linformer_attention(q, k, v, /, *, e=None, f=None, proj_dim=256, seed=0, scale=None,
                        key_mask=None, causal=False):
    r"""Linformer attention (Wang et al. 2020): keys and values projected to ``m`` rows.

    .. math:: O = \operatorname{softmax}\!\left(Q\,(E K)^\top \cdot \mathrm{scale}\right)
              (F V)

    with ``E, F`` of shape ``(m, s)``. Cost ``O(n m d + m s d)`` time and ``O(n m)``
    memory instead of ``O(n s)``.

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
    e : array, shape ``(..., m, s)``, optional
        The key projection ``E`` (e.g. a trained model's weights, per head if it has
        leading dimensions). Same namespace and device as ``q``; cast to the working
        dtype. ``None``: draw ``E`` on the host with i.i.d. ``N(0, 1/m)`` entries
        (:func:`linformer_projection` with ``proj_dim`` and ``seed``).
    f : array, shape ``(..., m, s)``, optional
        The value projection ``F``. ``None`` means ``F = E`` (the paper's shared
        key-value projection).
    proj_dim : int
        ``m``, used only when ``e`` is drawn.
    seed : int
        Seed of the host random generator that draws ``E``: a non-negative integer, the
        same on every backend.  ``None`` is refused (a different result on every call);
        pass ``e=`` to use your own draw.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    key_mask : boolean array, shape ``(..., s)``, optional
        Padded keys (``False``) have their key *and* value rows set to zero before the
        projection, so they contribute nothing to ``E K`` and ``F V``. This is all that
        can be done: after compression a padded position is no longer a separate entry
        of the softmax, so exact masking is impossible. (A zeroed key still shapes the
        softmax through the projected rows it is averaged into; it just adds nothing.)
    causal : bool
        Must be ``False``: Linformer cannot be causal (``ValueError`` explains why).

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q``.

    Notes
    -----
    The implied attention matrix is ``A = P F`` with ``P = softmax(Q (EK)^T scale)``
    ``(n, m)``. The rows of ``P`` sum to 1, but those of ``A`` sum to ``P F 1``, which
    is 1 only if every row of ``F`` sums to 1: with the paper's Gaussian ``F`` a
    constant ``v`` is *not* returned unchanged. With ``E = F = I`` (``m = s``) the
    result is exact softmax attention.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import linformer_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
    >>> linformer_attention(q, k, v, proj_dim=3).shape
    (2, 6, 4)
    >>> eye = np.eye(6)  # E = F = I: exact attention
    >>> bool(np.allclose(linformer_attention(q, k, v, e=eye), softmax_attention(q, k, v)))
    True
    """
    return run(SPEC, q, k, v, e=e, f=f, proj_dim=proj_dim, seed=seed, scale=scale,
               key_mask=key_mask, causal=causal)


def _reference(call: LinformerCall, w: Working):
    return reference.linformer_attention(w.q, w.k, w.v, call.e, call.f, scale=call.scale,
                                         key_mask=call.key_mask)


def _empty(call: LinformerCall):
    """No key: zeros of the inputs' batch.  No query or no batch element: the empty
    output of the reference form, whose batch is also that of ``e`` and ``f``."""
    p = call.p
    if p.s == 0:
        return p.zeros()
    batch = np.broadcast_shapes(p.batch, tuple(call.e.shape[:-2]), tuple(call.f.shape[:-2]))
    return p.xp.zeros((*batch, p.n, p.dv), dtype=p.dtype, device=p.device)


#: The pipeline of :func:`linformer_attention`.
SPEC = Spec(name="linformer_attention", check=checked_linformer, reference=_reference,
            empty=_empty,
            none_means={"e": "drawn N(0, 1/proj_dim) from seed", "f": "F = E",
                        "scale": "1/sqrt(d)", "key_mask": "every key is real"})


def host_to_q(q, x):
    """A host (NumPy) ``x`` moved to ``q``'s namespace and device when ``q`` is not NumPy
    (the uniform call's rule for ``e``/``f``); anything else as is."""
    if isinstance(x, np.ndarray) and not isinstance(q, np.ndarray):
        xp = xp_namespace(check_array("q", q))
        return xp_from_host(xp, x, dtype=q.dtype, device=xp_device(q))
    return x


def uniform_call(q, k, v, /, *, e=None, f=None, **options):
    """Uniform-call adapter: host (NumPy) ``e``/``f`` arrays, e.g. read from an ``.npz``
    file, are moved to ``q``'s namespace and device; arrays of ``q``'s kind pass as is."""
    return linformer_attention(q, k, v, e=host_to_q(q, e), f=host_to_q(q, f), **options)
