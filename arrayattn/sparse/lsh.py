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
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import reference
from .._numpy import lsh as numpy_lsh
from ..core.engine import entry
from ..core.checks import (Problem, check_flag, check_key_mask, check_positive_int, check_qkv,
                           check_scale, check_seed)
from .checks import check_num_buckets, check_rotations, check_shared_k, default_num_buckets
from ..core.xp import xp_from_host
from ..core.pipeline import Spec, Working, run

__all__ = ["lsh_attention", "lsh_rotations", "lsh_buckets", "LshCall", "checked_lsh",
           "lsh_scores", "SPEC", "UNIFORM_SPEC", "uniform_call"]


# ---------------------------------------------------------------------------------
# Hashing
# ---------------------------------------------------------------------------------

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
    nb = check_num_buckets(num_buckets)
    rng = np.random.default_rng(check_seed(seed))
    return rng.standard_normal((num_hashes, d, nb // 2))


@dataclass(frozen=True)
class LshCall:
    """A validated :func:`lsh_attention` call: the problem ``p`` (``qk`` as queries and
    keys), the key mask, the rotations ``rot (..., H, d, nb/2)`` in the working dtype and
    the reference forms' options."""

    p: Problem
    key_mask: Any
    rot: Any
    num_buckets: int
    chunk_size: int
    scale: float
    causal: bool
    dedup: bool

    @property
    def options(self) -> dict:
        """The keywords of :func:`arrayattn.reference.lsh_attention` and its forms."""
        return dict(num_buckets=self.num_buckets, chunk_size=self.chunk_size,
                    scale=self.scale, causal=self.causal, key_mask=self.key_mask,
                    dedup=self.dedup)


def checked_lsh(qk, v, *, num_hashes=4, num_buckets=None, chunk_size=64, seed=0,
                rotations=None, causal=False, key_mask=None, scale=None, dedup=True,
                names=("qk", "qk", "v")) -> LshCall:
    """Validate a :func:`lsh_attention` call once (shared with :func:`lsh_buckets` and the
    backward): the rotations drawn from ``seed`` or the caller's, checked and cast."""
    p = check_qkv(qk, qk, v, names=names)
    check_key_mask(p, key_mask, qk)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    num_hashes = check_positive_int("num_hashes", num_hashes)
    if rotations is None:
        nb = check_num_buckets(default_num_buckets(p.n, chunk_size) if num_buckets is None
                               else num_buckets)
        host = lsh_rotations(p.d, num_hashes=num_hashes, num_buckets=nb, seed=seed)
        rot = xp_from_host(p.xp, host, dtype=p.work_dtype, device=p.device)
    else:
        rot, nb = check_rotations(p, qk, rotations, num_hashes, num_buckets)
    return LshCall(p, key_mask, rot, nb, chunk_size, check_scale(scale, p.d),
                   check_flag("causal", causal), check_flag("dedup", dedup))


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
    call = checked_lsh(qk, qk, num_hashes=num_hashes, num_buckets=num_buckets,
                       chunk_size=chunk_size, seed=seed, rotations=rotations,
                       key_mask=key_mask)
    xp, nb = call.p.xp, call.num_buckets
    with entry(xp):
        buckets = reference.lsh_hash(xp.astype(qk, call.p.work_dtype, copy=False), call.rot, nb)
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
    plus score tiles of about ``2^22`` entries.  The ``H`` rounds and the blocks of chunks
    are scans (:mod:`arrayattn.reference.scan`: one loop body under ``jax.jit``).

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
    return run(SPEC, qk, qk, v, num_hashes=num_hashes, num_buckets=num_buckets,
               chunk_size=chunk_size, seed=seed, rotations=rotations, causal=causal,
               key_mask=key_mask, scale=scale, dedup=dedup)


def lsh_scores(call: LshCall) -> int:
    """The dense form's score count ``batch * H * n^2`` (it runs below the reference
    engine's limit)."""
    return math.prod(call.p.batch) * call.rot.shape[-3] * call.p.n * call.p.n


def _dense(call: LshCall, w: Working):
    # w.q: the caller's qk (cast), which hashes the padded tokens too; w.k is not used
    return reference.lsh_attention(w.q, w.v, call.rot, **call.options)


def _chunked(call: LshCall, w: Working):
    return reference.lsh_attention_chunked(w.q, w.v, call.rot, **call.options)


def _engine(call: LshCall, w: Working):
    return numpy_lsh.lsh_attention_chunked(w.q, w.v, call.rot, **call.options)


def _work(call: LshCall, w: Working) -> int:
    """Bytes of the engine's largest temporaries: the hash's projections or a round's
    scores, every batch row."""
    p = call.p
    return math.prod(p.batch) * p.n * max(call.rot.shape[-3] * call.rot.shape[-1],
                                          2 * call.chunk_size) * 4


def _check(qk, _qk, v, **options) -> LshCall:
    return checked_lsh(qk, v, **options)


def _uniform_check(q, _qk, v, *, ignored_k, **options) -> LshCall:
    call = checked_lsh(q, v, names=("q", "q", "v"), **options)   # name q, as the caller did
    check_shared_k(q, ignored_k)
    return call


_NONE_MEANS = {"num_buckets": "2 ceil(n / chunk_size), or the count rotations imply",
               "rotations": "drawn from seed", "key_mask": "every token is real",
               "scale": "1/sqrt(d)"}
#: The pipeline of :func:`lsh_attention` (``q = k = qk``).
SPEC = Spec(name="lsh_attention", check=_check, reference=_chunked, dense=_dense,
            engine=_engine, work=_work,
            scores=lsh_scores, none_means=_NONE_MEANS)
#: The registry's uniform call: ``q`` is the shared ``qk``; ``k`` is only checked.
UNIFORM_SPEC = Spec(name="lsh", check=_uniform_check, reference=_chunked, dense=_dense,
                    engine=_engine, work=_work,
                    scores=lsh_scores, none_means=_NONE_MEANS)


def uniform_call(q, k, v, /, **options):
    """Registry adapter: ``q`` is the shared ``qk``; ``k`` is ignored, but it must have
    ``q``'s shape (a ``k`` of another shape is a call meant for another variant)."""
    return run(UNIFORM_SPEC, q, q, v, ignored_k=k, **options)
