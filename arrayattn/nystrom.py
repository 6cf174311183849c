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

import dataclasses
import math

from . import reference
from ._numpy import nystrom as engine
from ._engine import entry, numpy_engine
from ._validate import (check_array, check_choice, check_flag, check_key_mask,
                        check_no_causal, check_positive_int, check_qkv,
                        check_same_array_kind, check_scale)
from ._xp import compute_dtype, xp_device, xp_namespace
from .linalg import PINV_INITS, PINV_METHODS, check_svd_available

__all__ = ["segment_lengths", "segment_means", "nystrom_attention", "landmark_attention",
           "checked_nystrom", "checked_landmark"]

_NOT_CAUSAL = ("its landmarks are means over segments of the whole sequence, so every "
               "output would depend on future tokens")


def segment_lengths(n: int, m: int) -> list[int]:
    """Lengths of the ``m`` contiguous segments of ``n`` tokens: the first ``n mod m``
    segments have ``ceil(n/m)`` tokens, the others ``floor(n/m)``.

    Examples
    --------
    >>> from arrayattn.nystrom import segment_lengths
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
    x = check_array("x", x)
    xp = xp_namespace(x, key_mask, names=("x", "key_mask"))
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., n, c); got shape "
                         f"{tuple(x.shape)}")
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"x must have a real floating dtype; got {x.dtype}")
    n = x.shape[-2]
    m = check_positive_int("m", m)
    if m > n:
        raise ValueError(f"m={m} segments cannot be formed from n={n} tokens "
                         f"(x of shape {tuple(x.shape)}); need m <= n")
    if key_mask is not None:
        check_same_array_kind(xp, "x", x, "key_mask", key_mask)
        if key_mask.dtype != xp.bool:
            raise TypeError(f"key_mask must be a boolean array (True = keep); got dtype "
                            f"{key_mask.dtype}")
        if key_mask.ndim < 1 or key_mask.shape[-1] != n:
            raise ValueError(f"key_mask must have shape (..., n) with n={n} tokens; got "
                             f"shape {tuple(key_mask.shape)}")
    return_counts = check_flag("return_counts", return_counts)
    work = compute_dtype(xp, x.dtype)
    wx = xp.astype(x, work, copy=False)
    with entry(xp):
        if numpy_engine(xp, 4 * math.prod(x.shape)):
            means, counts = engine.segment_means(wx, m, key_mask)
        else:
            means, counts = reference.masked_segment_means(wx, m, key_mask)
    means = xp.astype(means, x.dtype, copy=False)
    if not return_counts:
        return means
    if counts is None:
        counts = xp.asarray(segment_lengths(n, m), dtype=work, device=xp_device(x))
    return means, xp.astype(counts, x.dtype, copy=False)


def _check_query_mask(p, query_mask, q):
    """``query_mask (..., n)`` boolean, broadcastable to the batch."""
    if query_mask is None:
        return None
    if query_mask.ndim < 1 or query_mask.shape[-1] != p.n:
        raise ValueError(f"query_mask must have shape (..., n) with n={p.n} queries; got "
                         f"shape {tuple(query_mask.shape)}")
    # The same dtype, device and batch checks as a key mask, on the query axis.
    return check_key_mask(dataclasses.replace(p, s=p.n), query_mask, q, name="query_mask")


def _prepare(p, q, k, v, *, num_landmarks, scale, key_mask, query_mask, causal, variant):
    """Validation shared by both variants; the working arrays and resolved options."""
    check_no_causal(check_flag("causal", causal), variant, _NOT_CAUSAL)
    check_key_mask(p, key_mask, q)
    _check_query_mask(p, query_mask, q)
    m = check_positive_int("num_landmarks", num_landmarks)
    if m > min(p.n, p.s) and min(p.n, p.s) > 0:   # no tokens: zeros, whatever m
        raise ValueError(
            f"{variant}: num_landmarks={m} exceeds the number of queries n={p.n} or keys "
            f"s={p.s}; each landmark is the mean of at least one token (use m <= "
            f"{min(p.n, p.s)})")
    xp = p.xp
    work = [xp.astype(x, p.work_dtype, copy=False) for x in (q, k, v)]
    options = dict(num_landmarks=m, scale=check_scale(scale, p.d), key_mask=key_mask,
                   query_mask=query_mask)
    # The largest temporaries: the (n, m) and (m, s) score blocks.
    work_bytes = 4 * math.prod(p.batch) * max(p.n, p.s) * m
    return work, options, work_bytes


def _check_conv_kernel(p, v, conv_kernel):
    """The official model's depthwise convolution skip: an odd ``(..., K)`` real array."""
    if conv_kernel is None:
        return None
    xp = p.xp
    if p.n != p.s:
        raise ValueError(f"conv_kernel needs self-attention (n == s) to add a convolution "
                         f"of v to the output; got n={p.n}, s={p.s}")
    conv_kernel = check_array("conv_kernel", conv_kernel)
    check_same_array_kind(xp, "v", v, "conv_kernel", conv_kernel)
    if not xp.isdtype(conv_kernel.dtype, "real floating"):
        raise TypeError(f"conv_kernel must have a real floating dtype; got {conv_kernel.dtype}")
    if conv_kernel.ndim < 1 or conv_kernel.shape[-1] % 2 == 0:
        raise ValueError(f"conv_kernel must have shape (..., K) with an odd K (the output "
                         f"is centred); got shape {tuple(conv_kernel.shape)}")
    return xp.astype(conv_kernel, p.work_dtype, copy=False)


def checked_nystrom(q, k, v, /, *, num_landmarks, pinv, pinv_iters, pinv_init, pinv_rtol,
                    scale, key_mask, query_mask, conv_kernel, causal):
    """The validation of :func:`nystrom_attention` (shared with its backward):
    ``(problem, working (q, k, v), reference options, working conv kernel or None,
    work bytes)``."""
    p = check_qkv(q, k, v)
    work, options, work_bytes = _prepare(
        p, q, k, v, num_landmarks=num_landmarks, scale=scale, key_mask=key_mask,
        query_mask=query_mask, causal=causal, variant="nystrom_attention")
    check_choice("pinv", pinv, PINV_METHODS)
    check_choice("pinv_init", pinv_init, PINV_INITS)
    iters = check_positive_int("pinv_iters", pinv_iters, minimum=0)
    if pinv_rtol is not None and pinv != "svd":
        raise ValueError("pinv_rtol applies to pinv='svd' only")
    if pinv == "svd":
        check_svd_available(p.xp)
    kernel = _check_conv_kernel(p, v, conv_kernel)
    options.update(pinv=pinv, pinv_iters=iters, pinv_init=pinv_init, pinv_rtol=pinv_rtol)
    return p, work, options, kernel, work_bytes


def checked_landmark(q, k, v, /, *, num_landmarks, scale, key_mask, query_mask, causal):
    """The validation of :func:`landmark_attention` (shared with its backward):
    ``(problem, working (q, k, v), reference options, work bytes)``."""
    p = check_qkv(q, k, v)
    work, options, work_bytes = _prepare(
        p, q, k, v, num_landmarks=num_landmarks, scale=scale, key_mask=key_mask,
        query_mask=query_mask, causal=causal, variant="landmark_attention")
    return p, work, options, work_bytes


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
    p, (wq, wk, wv), options, kernel, work_bytes = checked_nystrom(
        q, k, v, num_landmarks=num_landmarks, pinv=pinv, pinv_iters=pinv_iters,
        pinv_init=pinv_init, pinv_rtol=pinv_rtol, scale=scale, key_mask=key_mask,
        query_mask=query_mask, conv_kernel=conv_kernel, causal=causal)
    xp = p.xp
    if p.empty:
        return p.zeros()
    with entry(xp):
        # every row depends on every token through the landmarks: a non-finite one makes
        # all rows NaN (and must not reach the SVD, which would raise)
        bad_q, bad_kv = reference.nonfinite_rows(wq), reference.nonfinite_rows(wk, wv)
        wq, (wk, wv) = (reference.drop_nonfinite(bad_q, wq),
                        reference.drop_nonfinite(bad_kv, wk, wv))
        if numpy_engine(xp, work_bytes):
            out = engine.nystrom_attention(wq, wk, wv, **options)
        else:
            out = reference.nystrom_attention(wq, wk, wv, **options)
        if kernel is not None:
            out = out + reference.depthwise_conv(wv, kernel, key_mask)
        # (a masked token is dropped, never counted: padding may hold anything)
        bad_q = bad_q if query_mask is None else bad_q & query_mask
        bad_kv = bad_kv if key_mask is None else bad_kv & key_mask
        bad = xp.any(bad_q, axis=-1) | xp.any(bad_kv, axis=-1)
        out = reference.poison_rows(out, xp.broadcast_to(bad[..., None], out.shape[:-1]))
    return xp.astype(out, p.dtype, copy=False)


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
    p, (wq, wk, wv), options, work_bytes = checked_landmark(
        q, k, v, num_landmarks=num_landmarks, scale=scale, key_mask=key_mask,
        query_mask=query_mask, causal=causal)
    if p.empty:
        return p.zeros()
    with entry(p.xp):
        if numpy_engine(p.xp, work_bytes):
            out = engine.landmark_attention(wq, wk, wv, **options)
        else:
            out = reference.landmark_attention(wq, wk, wv, **options)
    return p.xp.astype(out, p.dtype, copy=False)
