r"""Reference forms: Nyströmformer, the two-softmax landmark attention, and the
Moore–Penrose pseudo-inverse they need (SVD, Razavi's iteration).

.. math::

    \operatorname{softmax}(Q K^\top) \approx
    \underbrace{\operatorname{softmax}(Q \tilde K^\top)}_{F\ (n\times m)}\;
    \operatorname{pinv}\big(\underbrace{\operatorname{softmax}(\tilde Q \tilde K^\top)}_{A\
    (m\times m)}\big)\;
    \underbrace{\operatorname{softmax}(\tilde Q K^\top)}_{B\ (m\times s)}

Xiong et al. 2021, "Nyströmformer" (AAAI); the pseudo-inverse iteration of Razavi et al.
2014.  Array API only, no host reads, computed right to left in ``O((n + s) m)`` memory.
"""
from __future__ import annotations

from array_api_compat import array_namespace, device

from .masks import masked_softmax, zero_masked_keys
from .scan import fori

__all__ = ["masked_segment_means", "pinv_svd", "pinv_razavi", "nystrom_attention",
           "landmark_attention", "depthwise_conv", "segment_sums", "landmarks", "and_masks",
           "as_columns", "as_rows", "razavi_scale", "razavi_start", "razavi_step"]


def segment_sums(x, m: int):
    """Sums of ``x (..., n, c)`` over ``m`` contiguous segments: the first ``n mod m``
    hold ``ceil(n/m)`` tokens, the others ``floor(n/m)`` (never zero padding)."""
    xp = array_namespace(x)
    lead, (n, c) = tuple(x.shape[:-2]), tuple(x.shape[-2:])
    base, extra = divmod(n, m)
    cut = extra * (base + 1)
    long_ = xp.reshape(x[..., :cut, :], (*lead, extra, base + 1, c))
    short = xp.reshape(x[..., cut:, :], (*lead, m - extra, base, c))
    return xp.concat([xp.sum(long_, axis=-2), xp.sum(short, axis=-2)], axis=-2)


def masked_segment_means(x, m: int, keep=None):
    """Landmarks: means of ``x (..., n, c)`` over ``m`` contiguous (uneven) segments,
    counting only the tokens that ``keep (..., n)`` marks.

    Returns ``(means (..., m, c), counts)``: ``counts (..., m)`` is the number of kept
    tokens per segment (``None`` without ``keep``); a segment with none has mean 0.  A
    dropped token is replaced by 0 (not multiplied by it), so even NaN never enters.
    """
    xp = array_namespace(x)
    if keep is None:
        ones = xp.ones((x.shape[-2], 1), dtype=x.dtype, device=device(x))
        return segment_sums(x, m) / segment_sums(ones, m), None
    counts = segment_sums(xp.astype(keep[..., None], x.dtype), m)      # (..., m, 1)
    sums = segment_sums(xp.where(keep[..., None], x, 0.0), m)
    return sums / xp.where(counts > 0, counts, 1.0), counts[..., 0]


def pinv_svd(a, rtol: float):
    """``pinv(a)`` by the SVD (the array API ``linalg.pinv``), singular values at most
    ``rtol * sigma_max`` treated as zero."""
    return array_namespace(a).linalg.pinv(a, rtol=rtol)


def razavi_scale(a, init: str = "per_matrix"):
    """``(1 / (||A||_1 ||A||_inf), ||A||_1, ||A||_inf)``: the scale of Razavi's start
    ``Z_0 = A^T / (||A||_1 ||A||_inf)`` (0 for a zero matrix), the norms per matrix or
    their maxima over the batch (``init="global"``)."""
    xp = array_namespace(a)
    absa = xp.abs(a)
    col = xp.max(xp.sum(absa, axis=-2), axis=-1, keepdims=True)[..., None]   # ||A||_1
    row = xp.max(xp.sum(absa, axis=-1), axis=-1, keepdims=True)[..., None]   # ||A||_inf
    if init == "global":
        col, row = xp.max(col), xp.max(row)
    denom = col * row
    return xp.where(denom > 0, 1.0 / xp.where(denom > 0, denom, 1.0), 0.0), col, row


def pinv_razavi(a, iters: int, init: str = "per_matrix"):
    r"""Razavi et al. (2014): :math:`Z \leftarrow \tfrac14 Z(13I - AZ(15I - AZ(7I - AZ)))`,
    :math:`Z_0 = A^\top / (\lVert A\rVert_1 \lVert A\rVert_\infty)`, the norms per matrix
    (``init="per_matrix"``) or their maxima over the whole batch (``"global"``, as the
    official Nyströmformer code).  A zero matrix gives ``Z = 0``."""
    return fori(lambda z: razavi_step(a, z), razavi_start(a, init), iters)


def razavi_start(a, init: str = "per_matrix"):
    r"""Razavi's start :math:`Z_0 = A^\top / (\lVert A\rVert_1 \lVert A\rVert_\infty)`
    (:func:`razavi_scale`; ``init="global"``: the norms' maxima over the whole batch)."""
    xp = array_namespace(a)
    return xp.matrix_transpose(a) * razavi_scale(a, init)[0]


def razavi_step(a, z):
    """One step of :func:`pinv_razavi`: ``Z (13I - X (15I - X (7I - X))) / 4``, ``X = AZ``,
    multiplied out (the same four products; no identity matrix, one elementwise step:
    each ``I`` would be a kernel of its own under ``jax.jit``)."""
    x = a @ z
    zx = z @ x
    zxx = zx @ x
    return 0.25 * (13.0 * z - 15.0 * zx + 7.0 * zxx - zxx @ x)


def landmarks(q, k, v, m, key_mask, query_mask):
    """Masked keys and values zeroed, the landmarks, and which of them are non-empty."""
    k, v = zero_masked_keys(key_mask, k, v)
    qt, qcount = masked_segment_means(q, m, query_mask)
    kt, kcount = masked_segment_means(k, m, key_mask)
    qvalid = None if qcount is None else qcount > 0
    kvalid = None if kcount is None else kcount > 0
    return k, v, qt, kt, qvalid, kvalid


def and_masks(a, b):
    return a if b is None else (b if a is None else a & b)


def as_columns(valid):   # (..., m) -> (..., 1, m): allowed columns
    return None if valid is None else valid[..., None, :]


def as_rows(valid):   # (..., m) -> (..., m, 1): allowed rows
    return None if valid is None else valid[..., :, None]


def nystrom_attention(q, k, v, *, num_landmarks: int, scale: float, pinv: str = "iterative",
                      pinv_iters: int = 6, pinv_init: str = "per_matrix",
                      pinv_rtol: float | None = None, key_mask=None, query_mask=None):
    r"""Nyströmformer (Xiong et al. 2021): :math:`F\,(\operatorname{pinv}(A)\,(B\,V))`.

    ``F = softmax(c Q K̃ᵀ)`` ``(n, m)``, ``A = softmax(c Q̃ K̃ᵀ)`` ``(m, m)``,
    ``B = softmax(c Q̃ Kᵀ)`` ``(m, s)``, ``c = scale``, landmarks the (masked) segment
    means.  Masked keys are in no softmax and no landmark; an empty landmark (a segment
    with no real token) is a zero row/column of every factor.  ``pinv``: ``"svd"``
    (cutoff ``pinv_rtol``, default ``m eps``) or ``"iterative"`` (:func:`pinv_razavi`).
    """
    xp = array_namespace(q, k, v)
    k, v, qt, kt, qvalid, kvalid = landmarks(q, k, v, num_landmarks, key_mask, query_mask)
    # The scale goes on the (m, d) landmarks: every logit pairs one with a token or landmark.
    kts = xp.matrix_transpose(kt * scale)
    kernel_f = masked_softmax(q @ kts, as_columns(kvalid))
    kernel_a = masked_softmax(qt @ kts, and_masks(as_rows(qvalid), as_columns(kvalid)))
    kernel_b = masked_softmax((qt * scale) @ xp.matrix_transpose(k),
                              and_masks(as_rows(qvalid), as_columns(key_mask)))
    if pinv == "svd":
        eps = float(xp.finfo(kernel_a.dtype).eps)
        z = pinv_svd(kernel_a, num_landmarks * eps if pinv_rtol is None else pinv_rtol)
    else:
        z = pinv_razavi(kernel_a, pinv_iters, pinv_init)
    return kernel_f @ (z @ (kernel_b @ v))


def landmark_attention(q, k, v, *, num_landmarks: int, scale: float, key_mask=None,
                       query_mask=None):
    r"""The two-softmax form before Nyström's middle factor (Xiong et al. 2021):
    ``softmax(c Q K̃ᵀ) softmax(c Q̃ Kᵀ) V``.  A landmark index whose query or key segment
    is empty is dropped from both factors (they pair by index), so rows sum to 1."""
    xp = array_namespace(q, k, v)
    k, v, qt, kt, qvalid, kvalid = landmarks(q, k, v, num_landmarks, key_mask, query_mask)
    valid = and_masks(qvalid, kvalid)
    kernel_f = masked_softmax(q @ xp.matrix_transpose(kt * scale), as_columns(valid))
    kernel_b = masked_softmax((qt * scale) @ xp.matrix_transpose(k),
                              and_masks(as_rows(qvalid), as_columns(key_mask)))
    return kernel_f @ (kernel_b @ v)


def depthwise_conv(v, kernel, key_mask=None):
    r"""The official Nyströmformer model's skip: :math:`\sum_t w_t v_{i + t - \lfloor K/2
    \rfloor}` along the tokens, zero padding, odd ``K``, one kernel ``(..., K)`` per head;
    masked values are zeroed first (a loop over the ``K`` taps, not over tokens)."""
    xp = array_namespace(v, kernel)
    v = zero_masked_keys(key_mask, v)
    width, n = kernel.shape[-1], v.shape[-2]
    pad = xp.zeros((*v.shape[:-2], width // 2, v.shape[-1]), dtype=v.dtype, device=device(v))
    padded = xp.concat([pad, v, pad], axis=-2)
    out = 0.0
    for t in range(width):
        out = out + kernel[..., t, None, None] * padded[..., t:t + n, :]
    return out
