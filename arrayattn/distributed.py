r"""Scaling out on JAX: batch/head sharding, ring attention, sequence-parallel linear attention.

Every arrayattn variant traces under ``jax.jit``, so XLA's sharding is the engine past one
device (no home-made scheduler):

* :func:`sharded` -- any registered variant (or function) under ``jax.jit`` with its
  inputs and output laid out by a ``NamedSharding`` over the batch and head axes: each
  device computes its own heads, nothing crosses devices, and the result is the
  single-device result.
* :func:`ring_attention` -- exact softmax attention with the *sequence* split over a mesh
  axis (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers"): each
  device keeps its queries and passes its key/value block around the ring
  (``jax.lax.ppermute``), merging the partial softmaxes by their log-sum-exps -- the online
  softmax of FlashAttention across devices.  Memory per device ``O((n/p) d)`` plus one
  ``(n/p)^2`` score tile.
* :func:`sequence_parallel_linear_attention` -- causal linear attention with the sequence
  split: each device reduces its keys to one state ``phi(K)^T [V, 1]``, the states are
  gathered and each device starts from the sum of the states before it (an exclusive
  scan over devices), then runs the chunked form on its own tokens.

JAX is imported when these functions are called: ``import arrayattn`` never needs it.
The tests run them on 4 host devices (``XLA_FLAGS=--xla_force_host_platform_device_count=4``).
"""
from __future__ import annotations

import functools

__all__ = ["sharded", "ring_attention", "sequence_parallel_linear_attention"]


def _jax():
    try:
        import jax
    except ImportError as exc:   # pragma: no cover - depends on the environment
        raise ImportError("arrayattn.distributed needs JAX: pip install \"arrayattn[jax]\"") \
            from exc
    return jax


def _shard_map():
    jax = _jax()
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map   # pragma: no cover - older JAX
    return shard_map


def sharded(fn, mesh, *, batch_axis="batch", head_axis="heads", **options):
    """``jax.jit`` of ``fn(q, k, v, **options)`` with ``q, k, v`` and the output sharded
    over ``(batch, heads)`` by ``NamedSharding(mesh, P(batch_axis, head_axis))``.

    Parameters
    ----------
    fn : callable or str
        A registered variant's name (its uniform call, :class:`arrayattn.Variant`), or
        any ``fn(q, k, v, **options)`` of arrayattn.
    mesh : jax.sharding.Mesh
        A mesh with the axes named ``batch_axis`` and ``head_axis`` (either may be
        ``None``: that dimension is replicated).
    **options
        Passed to ``fn`` (static under ``jax.jit``).

    Returns
    -------
    callable
        ``f(q, k, v)`` for arrays of shape ``(batch, heads, n, d)`` (``v``: ``dv``); the
        output ``(batch, heads, n, dv)`` is sharded the same way.  Heads are independent
        in every variant, so the result is the single-device result (to rounding).

    Examples
    --------
    >>> import numpy as np, jax
    >>> from jax.sharding import Mesh
    >>> from arrayattn.distributed import sharded
    >>> mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("batch", "heads"))
    >>> q = k = v = np.ones((2, 4, 16, 8), np.float32)
    >>> sharded("softmax", mesh)(q, k, v).shape
    (2, 4, 16, 8)
    """
    jax = _jax()
    from jax.sharding import NamedSharding, PartitionSpec as P

    from .registry import get_variant
    call = get_variant(fn) if isinstance(fn, str) else fn
    spec = NamedSharding(mesh, P(batch_axis, head_axis, None, None))
    return jax.jit(lambda q, k, v: call(q, k, v, **options), in_shardings=(spec,) * 3,
                   out_shardings=spec)


def _sequence_spec(ndim: int, axis_name: str):
    from jax.sharding import PartitionSpec as P
    return P(*([None] * (ndim - 2)), axis_name, None)


def ring_attention(q, k, v, *, mesh, axis_name: str, causal: bool = False, scale=None):
    r"""Exact softmax attention with the sequence sharded over ``mesh`` axis ``axis_name``.

    .. math::

        O = \operatorname{softmax}(Q K^\top \cdot \mathrm{scale}) V,\qquad
        O_i = \frac{\sum_b e^{\ell_{ib}} O_{ib}}{\sum_b e^{\ell_{ib}}}

    where device ``r`` holds the query block ``Q_r`` and, at ring step ``t``, the key/value
    block of device ``r - t``; ``O_{ib}``, ``\ell_{ib}`` are the output and log-sum-exp of
    query ``i`` over key block ``b`` (:func:`arrayattn.reference.attend`), merged as they
    come by :func:`arrayattn.reference.merge_attention`.  Ring attention of Liu et al.
    2023; the blockwise online softmax of FlashAttention across devices.

    Parameters
    ----------
    q, k, v : jax arrays, shapes ``(..., n, d)``, ``(..., n, d)``, ``(..., n, dv)``
        Self-attention (``n == s``); ``n`` a multiple of the axis size ``p``.
    mesh : jax.sharding.Mesh
    axis_name : str
        The mesh axis the sequence is split over (``p`` devices, ``n / p`` tokens each).
    causal : bool
        Query ``i`` sees keys ``j <= i``; a block wholly in the future is all masked (its
        log-sum-exp ``-inf`` gives it weight 0 exactly).
    scale : float, optional
        ``None`` means ``1/sqrt(d)``.

    Returns
    -------
    jax array ``(..., n, dv)``, sharded over ``axis_name`` along the sequence.

    Examples
    --------
    >>> import numpy as np, jax
    >>> from jax.sharding import Mesh
    >>> from arrayattn import softmax_attention
    >>> from arrayattn.distributed import ring_attention
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    >>> q, k, v = (np.random.default_rng(0).standard_normal((2, 16, 8)).astype(np.float32)
    ...            for _ in range(3))
    >>> out = ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=True)
    >>> bool(np.allclose(out, softmax_attention(q, k, v, causal=True), atol=1e-5))
    True
    """
    from .core.checks import check_flag, check_qkv, check_scale
    p_ = check_qkv(q, k, v)
    if p_.n != p_.s:
        raise ValueError(f"ring_attention is self-attention (n == s); got n={p_.n}, s={p_.s}")
    p = mesh.shape[axis_name]
    if p_.n % p:
        raise ValueError(f"n={p_.n} must be a multiple of the {p} devices of axis "
                         f"{axis_name!r}")
    return _ring_program(mesh, axis_name, check_flag("causal", causal),
                         check_scale(scale, p_.d), q.ndim)(q, k, v)


@functools.lru_cache(maxsize=64)
def _ring_program(mesh, axis_name: str, causal: bool, scale: float, ndim: int):
    """The compiled ring for one mesh, axis and option set (cached: one compile per
    shape, not per call)."""
    jax = _jax()
    import jax.numpy as jnp

    from . import reference
    p = mesh.shape[axis_name]
    spec = _sequence_spec(ndim, axis_name)
    ring = [(j, (j + 1) % p) for j in range(p)]

    def local(q, k, v):
        me, nb = jax.lax.axis_index(axis_name), q.shape[-2]
        rows = jnp.arange(nb)[:, None] + me * nb
        out = lse = None
        for step in range(p):       # p is static: the ring is unrolled
            src = (me - step) % p   # whose key/value block this device holds now
            allowed = (jnp.arange(nb)[None, :] + src * nb <= rows) if causal else None
            o, l = reference.attend((q * scale) @ jnp.swapaxes(k, -1, -2), v, allowed)
            out, lse = (o, l) if out is None else reference.merge_attention(out, lse, o, l)
            if step < p - 1:
                k, v = jax.lax.ppermute((k, v), axis_name, perm=ring)
        return out.astype(q.dtype)

    # one compiled program (an eager shard_map runs op by op on every device)
    return jax.jit(_shard_map()(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))


def sequence_parallel_linear_attention(q, k, v, *, mesh, axis_name: str,
                                       feature_map="elu+1", chunk_size: int = 64):
    r"""Causal linear attention with the sequence sharded over ``mesh`` axis ``axis_name``.

    .. math::

        S_r = \varphi(K_r)^\top [V_r, 1],\qquad
        \text{state entering device } r = \sum_{r' < r} S_{r'},

    then device ``r`` runs the chunked causal form
    (:func:`arrayattn.reference.kernel_chunked`) on its own tokens from that state and
    divides numerator by denominator: the result of
    ``linear_attention(q, k, v, causal=True)`` on one device, to rounding.  Communication:
    one ``all_gather`` of ``p`` states of size ``m (dv + 1)``.

    Parameters
    ----------
    q, k, v : jax arrays, shapes ``(..., n, d)``, ``(..., n, d)``, ``(..., n, dv)``
        ``n`` a multiple of the axis size ``p``.
    mesh : jax.sharding.Mesh
    axis_name : str
    feature_map : str or FeatureMap
        As in :func:`arrayattn.linear_attention` (default ``"elu+1"``).
    chunk_size : int
        Chunk of the local chunked form.

    Returns
    -------
    jax array ``(..., n, dv)``, sharded over ``axis_name`` along the sequence.

    Examples
    --------
    >>> import numpy as np, jax
    >>> from jax.sharding import Mesh
    >>> from arrayattn import linear_attention
    >>> from arrayattn.distributed import sequence_parallel_linear_attention
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    >>> q, k, v = (np.random.default_rng(0).standard_normal((2, 16, 8)).astype(np.float32)
    ...            for _ in range(3))
    >>> out = sequence_parallel_linear_attention(q, k, v, mesh=mesh, axis_name="seq")
    >>> bool(np.allclose(out, linear_attention(q, k, v, causal=True), atol=1e-5))
    True
    """
    from .core.checks import check_positive_int, check_qkv
    from .kernel.feature_maps import get_feature_map
    p_ = check_qkv(q, k, v)
    p = mesh.shape[axis_name]
    if p_.n != p_.s or p_.n % p:
        raise ValueError(f"sequence-parallel linear attention needs n == s, a multiple of "
                         f"the {p} devices of axis {axis_name!r}; got n={p_.n}, s={p_.s}")
    chunk_size = check_positive_int("chunk_size", chunk_size)
    return _linear_program(mesh, axis_name, get_feature_map(feature_map), chunk_size,
                           q.ndim)(q, k, v)


@functools.lru_cache(maxsize=64)
def _linear_program(mesh, axis_name: str, fm, chunk_size: int, ndim: int):
    jax = _jax()
    import jax.numpy as jnp

    from . import reference
    p = mesh.shape[axis_name]
    spec = _sequence_spec(ndim, axis_name)

    def local(q, k, v):
        pq, pk = fm.query(q), fm.key(k)
        v1 = jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)
        mine = jnp.swapaxes(pk, -1, -2) @ v1                           # (..., m, dv+1)
        states = jax.lax.all_gather(mine, axis_name)                   # (p, ..., m, dv+1)
        before = jnp.arange(p) < jax.lax.axis_index(axis_name)
        sz0 = jnp.sum(jnp.where(before.reshape((p,) + (1,) * mine.ndim), states, 0), axis=0)
        num, _ = reference.kernel_chunked(pq, pk, v1, sz0, chunk_size)
        eps = float(jnp.finfo(num.dtype).smallest_normal)
        return reference.guarded_divide(num, eps).astype(q.dtype)

    return jax.jit(_shard_map()(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
