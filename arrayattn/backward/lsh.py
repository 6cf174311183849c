"""The backward of :func:`arrayattn.lsh_attention` (``lsh``): :func:`lsh_attention_vjp`
for the public function's own signature (``qk, v`` -> ``{"qk", "v"}``), and the
registry's uniform call (``q`` is the shared ``qk``, ``k`` is ignored: ``{"q", "v"}``,
no ``"k"``).  The equations are in :mod:`arrayattn.reference.lsh_vjp`."""
from __future__ import annotations

from .. import reference
from ..core.engine import entry
from ..core.checks import check_array, check_same_array_kind
from ..sparse.lsh import checked_lsh, lsh_scores
from ..core.pipeline import Spec, Working, implementation
from ..reference.exact_vjp import sum_to_shape

__all__ = ["lsh_attention_vjp", "lsh_uniform_vjp", "VJP_SPEC"]


def lsh_attention_vjp(qk, v, do, /, *, num_hashes=4, num_buckets=None, chunk_size=64, seed=0,
                      rotations=None, causal=False, key_mask=None, scale=None, dedup=True):
    r"""The cotangents of ``qk`` and ``v`` from the cotangent ``do`` of
    ``lsh_attention(qk, v, ...)``.

    Shared QK: ``qk`` is the queries and, normalised, the keys, so its cotangent sums
    both paths (``dx = scale dq + (dk - k (k . dk)) / ||x||``).  The buckets are constants
    of the forward (``argmax`` is piecewise constant): the rotations, drawn from ``seed``
    or the caller's, get no cotangent, and a point where a token changes bucket has no
    derivative.  Padded tokens (``key_mask`` False) get zeros.

    Parameters
    ----------
    qk : array, shape ``(..., n, d)``
    v : array, shape ``(..., n, dv)``
    do : array, shape ``(..., n, dv)``
        The output's cotangent (its broadcast shape, ``qk``'s namespace and device).
    num_hashes, num_buckets, chunk_size, seed, rotations, causal, key_mask, scale, dedup
        As in :func:`arrayattn.lsh_attention`.

    Returns
    -------
    dict
        ``{"qk": dqk, "v": dv}``, each with its argument's shape and dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn.backward import lsh_attention_vjp
    >>> rng = np.random.default_rng(0)
    >>> qk, v, do = (rng.standard_normal((2, 40, 8)) for _ in range(3))
    >>> g = lsh_attention_vjp(qk, v, do, num_hashes=2, chunk_size=8)
    >>> sorted(g), g["qk"].shape
    (['qk', 'v'], (2, 40, 8))
    """
    call = checked_lsh(qk, v, num_hashes=num_hashes, num_buckets=num_buckets,
                       chunk_size=chunk_size, seed=seed, rotations=rotations, causal=causal,
                       key_mask=key_mask, scale=scale, dedup=dedup)
    p = call.p
    xp = p.xp
    check_array("do", do)
    check_same_array_kind(xp, "qk", qk, "do", do)
    if not xp.isdtype(do.dtype, "real floating"):
        raise TypeError(f"do must have a real floating dtype; got {do.dtype}")
    if tuple(do.shape) != (*p.batch, p.n, p.dv):
        raise ValueError(f"do must have the output's shape {(*p.batch, p.n, p.dv)}; got "
                         f"shape {tuple(do.shape)}")
    args = {"qk": qk, "v": v}
    if p.n == 0:
        return {name: xp.zeros(x.shape, dtype=x.dtype, device=p.device)
                for name, x in args.items()}
    wd = p.work_dtype
    wqk = xp.astype(qk, wd, copy=False)        # padded tokens too: they hash
    w = Working(wqk, wqk, xp.astype(v, wd, copy=False))
    with entry(xp):
        grads = implementation(VJP_SPEC, call, w)(call, w, xp.astype(do, wd, copy=False))
    return {name: xp.astype(sum_to_shape(grads[name], x.shape), x.dtype, copy=False)
            for name, x in args.items()}


def lsh_uniform_vjp(q, k, v, do, /, **options):
    """The registry's uniform call (``q`` as ``qk``; ``k`` ignored, so it gets no
    cotangent): ``{"q", "v"}``."""
    grads = lsh_attention_vjp(q, v, do, **options)
    return {"q": grads["qk"], "v": grads["v"]}


def _dense_vjp(call, w: Working, do) -> dict:
    return reference.lsh_attention_vjp(w.q, w.v, do, call.rot, **call.options)


def _chunked_vjp(call, w: Working, do) -> dict:
    return reference.lsh_attention_chunked_vjp(w.q, w.v, do, call.rot, **call.options)


#: The backward of :func:`~arrayattn.lsh_attention`, as the pipeline chooses it
#: (:func:`arrayattn.core.pipeline.implementation`): the dense backward where the forward runs
#: its dense definition, else the chunked one; each form takes the cotangent ``do``.
VJP_SPEC = Spec(name="lsh_attention_vjp", check=checked_lsh, reference=_chunked_vjp,
                dense=_dense_vjp, scores=lsh_scores)
