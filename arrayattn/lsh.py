"""Reformer attention: shared-QK angular LSH, sorted buckets, chunked attention.

Kitaev, Kaiser & Levskaya 2020, "Reformer: The Efficient Transformer" (ICLR 2020),
section 2 ("Locality-sensitive hashing attention").

Every hash round sorts the tokens by bucket (then by position), cuts the sorted order
into chunks of ``chunk_size`` and lets each query attend to the keys of its own chunk
and of the previous chunk that share its bucket; the rounds are merged with their
log-sum-exp weights.  Cost per round: a sort (``O(n log n)``) and ``O(n · chunk · d)``
for the attention; memory ``O(n d)`` plus a bounded tile of scores; never ``n x n``.
"""
from __future__ import annotations

import math

import numpy as np

from . import reference
from ._engine import dense_reference, entry
from ._validate import (Problem, check_array, check_flag, check_key_mask, check_positive_int,
                        check_qkv, check_same_array_kind, check_scale, check_seed)
from ._xp import xp_from_host

__all__ = ["lsh_attention", "lsh_rotations", "lsh_buckets", "checked_lsh", "lsh_scores",
           "uniform_call"]


# ---------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------

def _default_num_buckets(n: int, chunk_size: int) -> int:
    """``2 ceil(n / chunk_size)``: average bucket of about half a chunk (paper: m = 2l/n_b)."""
    return 2 * max(1, math.ceil(n / chunk_size))


def _check_num_buckets(num_buckets) -> int:
    nb = check_positive_int("num_buckets", num_buckets)
    if nb != 1 and nb % 2:
        raise ValueError(
            "num_buckets must be 1 or even (angular LSH takes the argmax over "
            f"[xR, -xR] with R of num_buckets/2 columns); got {nb}"
        )
    return nb


def lsh_rotations(d, *, num_hashes=4, num_buckets, seed=0):
    """The random rotations of angular LSH, drawn on the host.

    Shape ``(num_hashes, d, num_buckets // 2)``; the entries are iid standard normal
    (float64), drawn with
    ``numpy.random.default_rng(seed).standard_normal((num_hashes, d, num_buckets // 2))``.
    This is exactly the matrix :func:`lsh_attention` draws for a given ``seed``; give it
    (or your own model's matrix of that shape) to ``rotations=`` to replay a hash.

    Returns
    -------
    numpy.ndarray, float64, shape ``(num_hashes, d, num_buckets // 2)``
        For ``num_buckets = 1`` the last axis has length 0 (every token is in bucket 0).

    Examples
    --------
    >>> from arrayattn import lsh_rotations
    >>> lsh_rotations(8, num_hashes=2, num_buckets=6, seed=1).shape
    (2, 8, 3)
    """
    d = check_positive_int("d", d)
    num_hashes = check_positive_int("num_hashes", num_hashes)
    nb = _check_num_buckets(num_buckets)
    rng = np.random.default_rng(check_seed(seed))
    return rng.standard_normal((num_hashes, d, nb // 2))


def _resolve_rotations(p: Problem, qk, rotations, num_hashes, num_buckets, seed):
    """The rotations as a ``(..., H, d, nb/2)`` array on ``qk``'s device, and ``(H, nb)``."""
    xp = p.xp
    num_hashes = check_positive_int("num_hashes", num_hashes)
    if rotations is None:
        nb = _check_num_buckets(num_buckets)
        host = lsh_rotations(p.d, num_hashes=num_hashes, num_buckets=nb, seed=seed)
        return xp_from_host(xp, host, dtype=p.work_dtype, device=p.device), num_hashes, nb
    check_same_array_kind(xp, "qk", qk, "rotations", rotations)
    if not xp.isdtype(rotations.dtype, "real floating"):
        raise TypeError(f"rotations must have a real floating dtype; got {rotations.dtype}")
    shape = tuple(rotations.shape)
    if len(shape) < 3 or shape[-2] != p.d:
        raise ValueError(
            f"rotations must have shape (..., num_hashes, d, num_buckets // 2) with d={p.d}; "
            f"got shape {shape} for qk of shape {tuple(qk.shape)}"
        )
    if shape[-3] != num_hashes:
        raise ValueError(
            f"rotations of shape {shape} hold {shape[-3]} hash rounds but "
            f"num_hashes={num_hashes}; pass num_hashes={shape[-3]}"
        )
    nb = max(1, 2 * shape[-1])
    if num_buckets is not None and _check_num_buckets(num_buckets) != nb:
        raise ValueError(
            f"rotations of shape {shape} give {nb} buckets but num_buckets={num_buckets}"
        )
    try:
        batch = tuple(np.broadcast_shapes(shape[:-3], p.batch))
    except ValueError:
        batch = None
    if batch != p.batch:
        raise ValueError(
            f"rotations' leading dimensions {shape[:-3]} do not broadcast to the "
            f"batch {p.batch} of qk {tuple(qk.shape)}"
        )
    return xp.astype(rotations, p.work_dtype, copy=False), num_hashes, nb


def _prepare(qk, v, key_mask, *, num_hashes, num_buckets, chunk_size, seed, rotations):
    p = check_qkv(qk, qk, v, names=("qk", "qk", "v"))
    check_key_mask(p, key_mask, qk)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    if num_buckets is None and rotations is None:
        num_buckets = _default_num_buckets(p.n, chunk_size)
    rot, H, nb = _resolve_rotations(p, qk, rotations, num_hashes, num_buckets, seed)
    return p, chunk_size, rot, H, nb


def lsh_buckets(qk, *, num_hashes=4, num_buckets=None, chunk_size=64, seed=0,
                rotations=None, key_mask=None):
    """The LSH buckets that :func:`lsh_attention` uses, ``(..., num_hashes, n)`` integers.

    ``h_r(x) = argmax([x R_r, -x R_r])`` with ``R_r`` the ``(d, num_buckets/2)``
    rotation of round ``r``; tokens with ``key_mask`` False are put in the extra bucket
    ``num_buckets`` (sorted after every real bucket).  Same arguments and defaults as
    :func:`lsh_attention` (``chunk_size`` only sets the default ``num_buckets``).

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import lsh_buckets
    >>> qk = np.random.default_rng(0).standard_normal((10, 8))
    >>> b = lsh_buckets(qk, num_hashes=3, num_buckets=4, seed=0)
    >>> b.shape, bool(((0 <= b) & (b < 4)).all())
    ((3, 10), True)
    """
    p, _, rot, _, nb = _prepare(qk, qk, key_mask, num_hashes=num_hashes,
                                num_buckets=num_buckets, chunk_size=chunk_size, seed=seed,
                                rotations=rotations)
    xp = p.xp
    with entry(xp):
        buckets = reference.lsh_hash(xp.astype(qk, p.work_dtype, copy=False), rot, nb)
    if key_mask is not None:
        buckets = xp.where(xp.expand_dims(key_mask, axis=-2), buckets, nb)
    return buckets


def lsh_attention(qk, v, /, *, num_hashes=4, num_buckets=None, chunk_size=64, seed=0,
                  rotations=None, causal=False, key_mask=None, scale=None, dedup=True):
    r"""Reformer LSH attention with shared queries and keys (Kitaev et al. 2020).

    Queries are ``qk``; keys are the ℓ2-normalised ``qk`` (``k_j = qk_j / ||qk_j||``).
    For each hash round ``r`` with random rotation ``R_r`` (``d x num_buckets/2``):

    .. math::

        h_r(x) = \arg\max\,[\,x R_r \,;\, -x R_r\,], \qquad
        P_i^{(r)} = \{ j \ne i : h_r(qk_j) = h_r(qk_i),\ \lfloor t_j / C \rfloor \in
        \{\lfloor t_i / C \rfloor - 1, \lfloor t_i / C \rfloor\} \}

    where ``t`` is the rank of a token after a stable sort by bucket (ties by position)
    and ``C = chunk_size``.  Each round is a masked softmax

    .. math::

        o_i^{(r)} = \sum_{j \in P_i^{(r)}} \frac{\exp(s_{ij} - \log N_{ij})}{Z_i^{(r)}} v_j,
        \qquad s_{ij} = \mathrm{scale}\; qk_i \cdot k_j,\qquad
        N_{ij} = |\{r' : h_{r'}(qk_i) = h_{r'}(qk_j)\}|,

    ``z_i^{(r)} = \log Z_i^{(r)}``, and the rounds are merged with their log-sum-exp
    weights: ``o_i = sum_r exp(z_i^{(r)} - z_i) o_i^{(r)}``, ``z_i = logsumexp_r z_i^{(r)}``.
    This is one softmax over the union of the rounds' key sets.

    Parameters
    ----------
    qk : array, shape ``(..., n, d)``
        Shared queries/keys (the output of the model's single QK projection).
    v : array, shape ``(..., n, dv)``
        Values.  Leading dimensions of ``qk`` and ``v`` broadcast.
    num_hashes : int
        Number of hash rounds ``H`` (default 4; the paper uses 1-8).
    num_buckets : int, optional
        Buckets per round, 1 or even.  ``None`` means ``2 ceil(n / chunk_size)`` (the
        paper's ``m = 2 l / n_buckets``: a bucket holds about half a chunk on average),
        or the count implied by ``rotations``.
    chunk_size : int
        Chunk length ``C`` in the sorted order (default 64).  Every query sees at most
        ``2C`` keys per round.  The sequence need not be a multiple of it.
    seed : int
        Seed of the host draw ``numpy.random.default_rng(seed).standard_normal((H, d,
        num_buckets // 2))`` (see :func:`lsh_rotations`); same seed, same buckets on
        every backend.  A non-negative integer: ``None`` (fresh entropy, a different
        result on every call) is refused; pass ``rotations=`` for your own draw.
    rotations : array, shape ``(..., H, d, num_buckets // 2)``, optional
        The caller's rotations (e.g. a model's fixed hash), replacing the seeded draw.
        Leading dimensions broadcast against the batch (per-head rotations).
    causal : bool
        Query ``i`` only sees keys ``j < i`` (``n = s``, so end-aligned = usual), in a
        sliding window of ``C`` sorted slots (see the notes).
    key_mask : boolean array, shape ``(..., n)``, optional
        ``False`` marks padding.  A padded token is hashed into an extra bucket sorted
        after all real buckets, so it never takes a chunk slot of a real token: the
        result on the real tokens equals the result with the padding removed.  The
        output rows of padded tokens are zero.
    scale : float, optional
        Logit scale, ``None`` means ``1/sqrt(d)``.
    dedup : bool
        ``True`` (default, the paper's choice): subtract ``log N_ij`` so that a pair met
        in several rounds counts once.  ``False``: no correction, a key seen in ``k``
        rounds counts ``k`` times (reformer-pytorch's ``allow_duplicate_attention``).

    Returns
    -------
    array, shape ``(..., n, dv)``
        Same namespace, device and dtype as ``qk``.

    Notes
    -----
    Choices (each as in the paper unless said otherwise):

    * Keys are unit vectors; queries are not normalised; the scale applies to
      ``qk_i · k_j``.
    * Only keys of the query's own bucket are attended (the paper's mask
      ``m(j, P_i)``); the chunk and previous-chunk window bounds the cost.  The first
      chunk has no previous chunk (no wrap-around to the last chunk).
    * A token does not attend to itself unless it has no other key in any round; then it
      returns its own value (its key must be real).  This is the paper's
      ``-1e5`` self-logit without the magic constant: a self-only round has
      ``exp(-1e5) = 0`` weight against any round with a key.
    * The duplicate count ``N_ij`` counts the rounds in which ``i`` and ``j`` share a
      bucket, not those in which they share a chunk window (paper's definition); when
      a chunk boundary separates them in some round the pair is counted less.
    * Causal: query ``i`` sees the same-bucket keys ``j < i`` among the ``C`` sorted
      slots before it (``t_i - C <= t_j < t_i``), a sliding window instead of the
      chunk + previous chunk.  Within a bucket the sort keeps position order, so this is
      the ``min(C, #)`` most recent same-bucket keys: a set fixed by past tokens alone.
      With plain chunk windows (as in the paper and popular ports) the *bucket* of a
      future token shifts the chunk boundaries and can change a past output; here no
      future key, value or bucket changes a past output (tested: bit for bit when the
      buckets stay, to rounding when a future bucket moves the past slots).
    * ``num_buckets=1`` with ``chunk_size >= n`` is dense softmax attention over unit
      keys with the self-exclusion rule (tested).

    Cost per round: two ``argsort`` of length ``n``, gathers of ``n (d + dv)``,
    ``4 n C (d + dv)`` FLOPs for the scores and the product; memory ``O(n (d + dv))``
    plus score tiles of about ``2^22`` entries.  Python loops run over the ``H`` rounds
    and over blocks of chunks only.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import lsh_attention
    >>> rng = np.random.default_rng(0)
    >>> qk, v = rng.standard_normal((2, 100, 16)), rng.standard_normal((2, 100, 8))
    >>> out = lsh_attention(qk, v, num_hashes=2, chunk_size=32, seed=0)
    >>> out.shape
    (2, 100, 8)
    >>> ones = lsh_attention(qk, np.ones((100, 1)), chunk_size=32)  # rows sum to 1
    >>> bool(np.allclose(ones, 1.0))
    True
    """
    p, rot, options = checked_lsh(qk, v, num_hashes=num_hashes, num_buckets=num_buckets,
                                  chunk_size=chunk_size, seed=seed, rotations=rotations,
                                  causal=causal, key_mask=key_mask, scale=scale, dedup=dedup)
    if p.empty:
        return p.zeros()
    xp = p.xp
    form = (reference.lsh_attention if dense_reference(lsh_scores(p, rot))
            else reference.lsh_attention_chunked)
    with entry(xp):
        out = form(xp.astype(qk, p.work_dtype, copy=False),
                   xp.astype(v, p.work_dtype, copy=False), rot, **options)
    return xp.astype(out, p.dtype, copy=False)


def checked_lsh(qk, v, *, num_hashes, num_buckets, chunk_size, seed, rotations, causal,
                key_mask, scale, dedup):
    """:func:`lsh_attention`'s checks (shared with its backward): ``(p, rotations,
    options)``, the rotations in the working dtype and the reference forms' options."""
    p, C, rot, _, nb = _prepare(qk, v, key_mask, num_hashes=num_hashes,
                                num_buckets=num_buckets, chunk_size=chunk_size, seed=seed,
                                rotations=rotations)
    return p, rot, dict(num_buckets=nb, chunk_size=C, scale=check_scale(scale, p.d),
                        causal=check_flag("causal", causal), key_mask=key_mask,
                        dedup=check_flag("dedup", dedup))


def lsh_scores(p: Problem, rot) -> int:
    """The dense form's score count ``batch * H * n^2`` (it runs below the reference
    engine's limit)."""
    return math.prod(p.batch) * rot.shape[-3] * p.n * p.n


def uniform_call(q, k, v, /, **options):
    """Registry adapter: ``q`` is the shared ``qk``; ``k`` is ignored, but it must have
    ``q``'s shape (a ``k`` of another shape is a call meant for another variant)."""
    check_qkv(q, q, v, names=("q", "q", "v"))    # name q, the argument the caller passed
    check_array("k", k)
    if k.ndim < 2 or tuple(k.shape[-2:]) != tuple(q.shape[-2:]):   # (heads may group)
        raise ValueError(f"lsh is shared-QK attention: the uniform call uses q as qk and "
                         f"ignores k, so k must have q's tokens and width (..., "
                         f"{q.shape[-2]}, {q.shape[-1]}); got {tuple(k.shape)} (call "
                         f"arrayattn.lsh_attention(qk, v) directly)")
    return lsh_attention(q, v, **options)
