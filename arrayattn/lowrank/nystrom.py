r"""Nyströmformer and the two-softmax landmark attention it is derived from.

.. math::

    \operatorname{softmax}(Q K^\top) \approx
    \underbrace{\operatorname{softmax}(Q \tilde K^\top)}_{F\ (n\times m)}\;
    \operatorname{pinv}\!\big(\underbrace{\operatorname{softmax}(\tilde Q \tilde K^\top)}_{A\
    (m\times m)}\big)\;
    \underbrace{\operatorname{softmax}(\tilde Q K^\top)}_{B\ (m\times s)}

with landmarks :math:`\tilde Q, \tilde K` the means of ``m`` contiguous segments of the
queries and keys (Xiong et al. 2021, "Nyströmformer: A Nyström-Based Algorithm for
Approximating Self-Attention", AAAI).  Every logit carries the same ``scale`` (the
official code divides q and k by :math:`d^{1/4}` each, which is the same thing).
"""
from __future__ import annotations

import math

from .. import reference
from .._numpy import nystrom as engine
from ..core.engine import entry
from .checks import (LandmarkCall, NystromCall, checked_landmark, checked_nystrom,
                     checked_segment_means)
from ..core.xp import compute_dtype, xp_device
from ..core.pipeline import Spec, Working, engine_pays, finite_on_host, run

__all__ = ["segment_lengths", "segment_means", "nystrom_attention", "landmark_attention",
           "checked_nystrom", "checked_landmark", "NYSTROM_SPEC", "LANDMARK_SPEC"]


def segment_lengths(n: int, m: int) -> list[int]:
    """Lengths of the ``m`` contiguous segments of ``n`` tokens: the first ``n mod m``
    segments have ``ceil(n/m)`` tokens, the others ``floor(n/m)``.

    Examples
    --------
    >>> from arrayattn.lowrank.nystrom import segment_lengths
    >>> segment_lengths(10, 4)
    [3, 3, 2, 2]
    """
    base, extra = divmod(n, m)
    return [base + 1] * extra + [base] * (m - extra)


def segment_means(x, m, /, *, key_mask=None, return_counts=False):
    r"""Landmarks: the means of ``m`` contiguous segments of the tokens of ``x``.

    When ``m`` does not divide ``n`` the segments are uneven -- the first ``n mod m``
    have :math:`\lceil n/m\rceil` tokens, the others :math:`\lfloor n/m\rfloor` -- instead
    of zero padding, whose zeros would be counted in the means and shrink them.

    Parameters
    ----------
    x : array, shape ``(..., n, c)``
        Tokens (queries or keys).
    m : int
        Number of segments, ``1 <= m <= n``.
    key_mask : boolean array, shape ``(..., n)``, optional
        ``True`` marks a real token; masked tokens are left out of the means (their
        values, even inf or NaN, never enter).  A segment without any real token has
        mean 0 and count 0.
    return_counts : bool
        Also return the number of real tokens of each segment (floating, shape
        ``(..., m)``; without ``key_mask``, shape ``(m,)``: the segment lengths).

    Returns
    -------
    means : array, shape ``(..., m, c)``
        Same namespace, device and dtype as ``x``.
    counts : array
        Only with ``return_counts=True``.

    Raises
    ------
    ValueError
        ``m > n`` or ``m < 1``, or a ``key_mask`` of the wrong shape.
    TypeError
        Non-floating ``x``, non-boolean ``key_mask``, mixed libraries.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import segment_means
    >>> x = np.arange(5.0)[:, None]              # n = 5 tokens, m = 2 -> lengths 3, 2
    >>> segment_means(x, 2)[:, 0]
    array([1. , 3.5])
    >>> means, counts = segment_means(x, 2, key_mask=np.array([1, 0, 1, 0, 0], bool),
    ...                               return_counts=True)
    >>> means[:, 0], counts
    (array([1., 0.]), array([2., 0.]))
    """
    xp, m, return_counts = checked_segment_means(x, m, key_mask, return_counts)
    work = compute_dtype(xp, x.dtype)
    wx = xp.astype(x, work, copy=False)
    with entry(xp):     # one array, no q, k, v: the pipeline's rule, on its size
        if engine_pays(xp, 4 * math.prod(x.shape)):
            means, counts = engine.segment_means(wx, m, key_mask)
        else:
            means, counts = reference.masked_segment_means(wx, m, key_mask)
    means = xp.astype(means, x.dtype, copy=False)
    if not return_counts:
        return means
    if counts is None:
        counts = xp.asarray(segment_lengths(x.shape[-2], m), dtype=work, device=xp_device(x))
    return means, xp.astype(counts, x.dtype, copy=False)


def nystrom_attention(q, k, v, /, *, num_landmarks=64, pinv="iterative", pinv_iters=6,
                      pinv_init="per_matrix", pinv_rtol=None, scale=None, key_mask=None,
                      query_mask=None, conv_kernel=None, causal=False):
    r"""Nyströmformer attention (Xiong et al. 2021).

    .. math::

        O = \operatorname{softmax}(Q\tilde K^\top c)\;
            \operatorname{pinv}\!\big(\operatorname{softmax}(\tilde Q\tilde K^\top c)\big)\;
            \operatorname{softmax}(\tilde Q K^\top c)\, V \;[+\ \operatorname{conv}(V)]

    with ``c = scale`` on every logit and landmarks :math:`\tilde Q, \tilde K` the means
    of ``m`` contiguous segments of ``q`` and ``k`` (:func:`segment_means`: uneven
    segments when ``m`` does not divide the length, never zero padding).  Computed
    right to left: ``O(n m d + s m d + m^3)`` time, ``O((n + s) m)`` memory; the
    ``n x s`` matrix is never formed.

    ``num_landmarks == n == s`` is not special-cased: every token is its own landmark,
    :math:`\tilde Q = Q`, :math:`\tilde K = K`, and with ``pinv="svd"`` the formula is
    :math:`S S^+ S V = S V`, exact softmax attention (tested to ~1e-10 in float64).

    Parameters
    ----------
    q : array, shape ``(..., n, d)``
    k : array, shape ``(..., s, d)``
    v : array, shape ``(..., s, dv)``
        Leading dimensions broadcast (batch, heads).
    num_landmarks : int
        ``m``, at most ``min(n, s)``.  Default 64 (the paper's value for long inputs).
    pinv : {"iterative", "svd"}
        Pseudo-inverse of the ``m x m`` landmark matrix: Razavi's iteration (the
        paper's) or the exact SVD one; see :func:`arrayattn.pinv`.
    pinv_iters : int
        Iterations of the ``"iterative"`` pseudo-inverse (paper: 6).
    pinv_init : {"per_matrix", "global"}
        ``Z0`` scaling of the iterative pseudo-inverse: per matrix (default) or one
        maximum over the whole batch and all heads (the official code's; converges no
        faster and usually slower).
    pinv_rtol : float, optional
        Singular-value cutoff of ``"svd"`` (default ``m * eps``).
    scale : float, optional
        Logit scale, ``None`` means ``1/sqrt(d)``; applied to all three softmaxes.
    key_mask : boolean array, shape ``(..., s)``, optional
        ``True`` marks a real key.  Masked keys are left out of the key landmarks and of
        the softmax over keys, so they have no influence at all; a key segment with no
        real key is dropped from the landmarks.
    query_mask : boolean array, shape ``(..., n)``, optional
        ``True`` marks a real query.  Masked queries are left out of the query
        landmarks (so padding does not bias them); their own outputs are still
        computed.  For padded self-attention pass the padding mask as both masks.
    conv_kernel : array, shape ``(..., K)``, optional
        Adds the official model's depthwise convolution skip,
        :math:`\sum_t w_t V_{i + t - \lfloor K/2\rfloor}` (zero padding, odd ``K``, one
        kernel per head broadcast against the batch dims; masked values are zeroed
        first).  Self-attention only (``n == s``).
    causal : bool
        Must be False: the landmarks mix future tokens into every output.

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``q`` (half precisions computed in float32).

    Raises
    ------
    ValueError
        ``causal=True``; ``num_landmarks > min(n, s)``; bad shapes or options.
    TypeError
        Bad dtypes, mixed libraries.

    Notes
    -----
    Rows of the implied matrix sum to 1 when the landmark matrix is invertible (its
    rows do, so its inverse maps 1 to 1) -- to rounding with ``"svd"``, to the
    pseudo-inverse residual :math:`\lVert I - AZ\rVert` with ``"iterative"``.  The
    iterative pseudo-inverse is differentiable on every backend.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import nystrom_attention, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 10, 4)) for _ in range(3))
    >>> out = nystrom_attention(q, k, v, num_landmarks=3)
    >>> out.shape
    (2, 10, 4)
    >>> exact = nystrom_attention(q, k, v, num_landmarks=10, pinv="svd")  # m = n
    >>> bool(np.allclose(exact, softmax_attention(q, k, v), rtol=0, atol=1e-10))
    True
    """
    return run(NYSTROM_SPEC, q, k, v, num_landmarks=num_landmarks, pinv=pinv,
               pinv_iters=pinv_iters, pinv_init=pinv_init, pinv_rtol=pinv_rtol, scale=scale,
               key_mask=key_mask, query_mask=query_mask, conv_kernel=conv_kernel,
               causal=causal)


def landmark_attention(q, k, v, /, *, num_landmarks=64, scale=None, key_mask=None,
                       query_mask=None, causal=False):
    r"""The two-softmax landmark attention from which Nyströmformer is derived.

    .. math::

        O = \operatorname{softmax}(Q\tilde K^\top c)\,
            \operatorname{softmax}(\tilde Q K^\top c)\, V

    (Xiong et al. 2021, before the middle factor is inserted); ``c = scale``,
    landmarks as in :func:`nystrom_attention`.  Both factors are row-stochastic, so the
    rows of the implied ``n x s`` matrix sum to 1 (attending to a constant returns it).

    Parameters
    ----------
    q, k, v : arrays, shapes ``(..., n, d)``, ``(..., s, d)``, ``(..., s, dv)``
    num_landmarks : int
        ``m <= min(n, s)``.
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.
    key_mask, query_mask : boolean arrays, shapes ``(..., s)``, ``(..., n)``, optional
        As in :func:`nystrom_attention`.  A landmark index ``j`` whose key segment or
        query segment has no real token is dropped from both factors (they are paired
        by index), so rows still sum to 1.
    causal : bool
        Must be False.

    Returns
    -------
    array, shape ``(..., n, dv)``

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import landmark_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 9, 4)), rng.standard_normal((2, 12, 4))
    >>> out = landmark_attention(q, k, np.ones((2, 12, 1)), num_landmarks=4)
    >>> bool(np.allclose(out, 1.0))
    True
    """
    return run(LANDMARK_SPEC, q, k, v, num_landmarks=num_landmarks, scale=scale,
               key_mask=key_mask, query_mask=query_mask, causal=causal)


def _finite(form, call: NystromCall, w: Working):
    """``form`` (the reference or the engine) with Nyströmformer's rule for non-finite
    tokens: every row depends on every token through the landmarks, so a non-finite
    query, key or value makes all rows NaN; it is taken out first (it must not reach the
    SVD, which would raise).  A masked token is dropped, never counted (padding may hold
    anything).  On NumPy a cheap host pass (:func:`~arrayattn.core.pipeline.finite_on_host`)
    that finds every query, key and value finite runs ``form`` as it is."""
    if finite_on_host(call.p.xp, w.q, w.k, w.v):  # NumPy, nothing non-finite (issue #39)
        return _with_conv(form(w.q, w.k, w.v, **call.options), call, w.v)
    return _careful(form, call, w)


def _with_conv(out, call: NystromCall, v):
    if call.conv_kernel is not None:
        out = out + reference.depthwise_conv(v, call.conv_kernel, call.key_mask)
    return out


def _careful(form, call: NystromCall, w: Working):
    """:func:`_finite`'s path for a call that may hold a non-finite token."""
    xp = call.p.xp
    real_q = w.q if call.query_mask is None else xp.where(call.query_mask[..., None], w.q, 0.0)
    bad = (reference.nonfinite_over(real_q, (-2, -1)) | reference.nonfinite_over(w.k, (-2, -1))
           | reference.nonfinite_over(w.v, (-2, -1)))
    # Then every row is NaN whatever the others hold: a bad call's inputs are zeroed
    # (where, not a product); a good one's are finite but for masked queries, which may
    # hold anything.
    q = w.q if call.query_mask is None else xp.where(xp.isfinite(w.q), w.q, 0.0)
    q, k, v = (xp.where(bad[..., None, None], 0.0, x) for x in (q, w.k, w.v))
    out = _with_conv(form(q, k, v, **call.options), call, v)
    return reference.poison_rows(out, xp.broadcast_to(bad[..., None], out.shape[:-1]))


def _nystrom_reference(call: NystromCall, w: Working):
    return _finite(reference.nystrom_attention, call, w)


def _nystrom_engine(call: NystromCall, w: Working):
    """The NumPy engine under :func:`_finite`'s rule, the check of ``q`` and ``k`` folded
    into the engine (``finite_check``): the landmarks are finite only where every real
    query and key is (a segment mean adds them all), so the host reads only ``v`` (and
    ``q`` where a ``query_mask`` leaves queries out of the landmarks) -- one full read
    instead of :func:`_finite`'s three, which cost 6-11 % of a call at n = 16384
    (issue #39).  (A column sum of each block of ``v`` in the key pass cost more than
    the host's one BLAS pass: the blocks do not stay in cache.)"""
    masked_q = None if call.query_mask is None else w.q
    if finite_on_host(call.p.xp, w.v, masked_q):
        out = engine.nystrom_attention(w.q, w.k, w.v, finite_check=True, **call.options)
        if out is not None:
            return _with_conv(out, call, w.v)
    return _careful(engine.nystrom_attention, call, w)


def _landmark_reference(call: LandmarkCall, w: Working):
    return reference.landmark_attention(w.q, w.k, w.v, **call.options)


def _landmark_engine(call: LandmarkCall, w: Working):
    return engine.landmark_attention(w.q, w.k, w.v, **call.options)


def _work(call: LandmarkCall, w: Working) -> int:
    return call.work_bytes


_NONE_MEANS = {"scale": "1/sqrt(d)", "key_mask": "every key is real",
               "query_mask": "every query is real"}

#: The pipeline of :func:`nystrom_attention`.
NYSTROM_SPEC = Spec(name="nystrom_attention", check=checked_nystrom,
                    reference=_nystrom_reference, engine=_nystrom_engine, work=_work,
                    none_means={**_NONE_MEANS, "pinv_rtol": "m * eps of the working dtype",
                                "conv_kernel": "no convolution skip"})

#: The pipeline of :func:`landmark_attention`.
LANDMARK_SPEC = Spec(name="landmark_attention", check=checked_landmark,
                     reference=_landmark_reference, engine=_landmark_engine, work=_work,
                     none_means=_NONE_MEANS)
