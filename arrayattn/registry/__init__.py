"""The one registry of attention variants, built from the catalogue's table.

The registry holds the records of :data:`arrayattn.registry.catalogue.VARIANTS` (read the first time
the registry is, in the table's order) and any record a user adds with :func:`register`;
tests, the CLI, the benchmarks and the docs iterate over :func:`variants`, so a row in the
table is all it takes to have a variant tested, benchmarked and documented.
"""
from __future__ import annotations


from .variant import Variant

__all__ = ["Variant", "register", "variants", "get_variant", "attention_matrix", "jit_uniform"]


_REGISTRY: dict[str, Variant] = {}
_BUILT = False


def _registry() -> dict[str, Variant]:
    """The registry, built from the catalogue's table on first use."""
    global _BUILT
    if not _BUILT:
        from .catalogue import VARIANTS
        table = {}
        for rec in VARIANTS:
            if rec.name in table:
                raise ValueError(f"the catalogue lists {rec.name!r} twice")
            table[rec.name] = rec
        added = {name: rec for name, rec in _REGISTRY.items() if name not in table}
        _REGISTRY.clear()
        _REGISTRY.update(table)
        _REGISTRY.update(added)
        _BUILT = True
    return _REGISTRY


def register(variant: Variant) -> Variant:
    """Add ``variant`` to the registry (names are unique).

    For variants outside arrayattn (arrayattn's own are the rows of
    :data:`arrayattn.registry.catalogue.VARIANTS`): tests, the report, the benchmarks and the docs
    then pick the variant up.

    Parameters
    ----------
    variant : Variant
        The record; its ``name`` must not be registered yet.

    Returns
    -------
    Variant
        ``variant`` itself.

    Raises
    ------
    ValueError
        When a variant of that name is already registered.

    Examples
    --------
    >>> from arrayattn import Variant, get_variant, register, softmax_attention
    >>> rec = Variant(name="softmax_block64", fn=softmax_attention, family="exact",
    ...               exact=True, causal=True, key_mask=True, mask=True,
    ...               defaults={"block_size": 64}, parameter="block_size",
    ...               complexity="O(n s d)", citation="Dao et al. 2022")
    >>> register(rec)  # doctest: +SKIP
    >>> register(get_variant("softmax"))
    Traceback (most recent call last):
    ...
    ValueError: a variant named 'softmax' is already registered
    """
    if not isinstance(variant, Variant):
        raise TypeError(f"register takes a Variant record; got {type(variant).__name__}")
    registry = _registry()
    if variant.name in registry:
        raise ValueError(f"a variant named {variant.name!r} is already registered")
    registry[variant.name] = variant
    return variant


def variants(*, family: str | None = None, exact: bool | None = None,
             causal: bool | None = None) -> tuple[Variant, ...]:
    """All registered variants in the catalogue's order (then those added by
    :func:`register`), optionally filtered.

    Parameters
    ----------
    family : str, optional
        Keep only this family (``"exact"``, ``"kernel"`` ...).
    exact, causal : bool, optional
        Keep only variants that are (not) exact, that do (not) support ``causal``.

    Returns
    -------
    tuple of Variant

    Examples
    --------
    >>> import arrayattn
    >>> [v.name for v in arrayattn.variants(exact=True)][:2]
    ['softmax', 'softmax_blockwise']
    """
    out = []
    for rec in _registry().values():
        if family is not None and rec.family != family:
            continue
        if exact is not None and rec.exact != exact:
            continue
        if causal is not None and rec.causal != causal:
            continue
        out.append(rec)
    return tuple(out)


def get_variant(name: str) -> Variant:
    """The registered variant called ``name``.

    Parameters
    ----------
    name : str or Variant
        A registry name (a :class:`Variant` is returned as it is).

    Returns
    -------
    Variant

    Raises
    ------
    ValueError
        Listing the registered names when there is none called ``name``.

    Examples
    --------
    >>> from arrayattn import get_variant
    >>> get_variant("softmax").citation
    'Vaswani et al. 2017, Attention Is All You Need'
    >>> get_variant("sofmax")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: no variant named 'sofmax'; registered: softmax, softmax_blockwise...
    """
    if isinstance(name, Variant):
        return name
    registry = _registry()
    try:
        return registry[name]
    except KeyError:
        raise ValueError(
            f"no variant named {name!r}; registered: {', '.join(registry)}"
        ) from None


class jit_uniform:
    """The uniform call of ``rec`` (a :class:`Variant` or registry name) with ``options``,
    compiled by ``jit`` (default :func:`jax.jit`), with what the call draws on the host
    (``rec.draws``: the gated families' gates) passed to the compiled call as arguments.

    ``jax.jit(lambda q, k, v: rec(q, k, v))`` gives the same numbers, but there the gates
    drawn inside are constants of the program: XLA copies and hashes them (gla's are
    ``(1, 8, n, 64)``, 32 MB at ``n = 16384``), and the compile time grows with ``n``.
    Here they are drawn once per shape of ``q`` (from ``seed``), outside the program.
    ``jit_uniform(rec)(q, k, v)`` calls it and ``.lower(q, k, v)`` lowers it.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import get_variant, jit_uniform
    >>> q = k = v = np.ones((1, 2, 8, 4))
    >>> call = jit_uniform("gla", lambda f: f)      # any jit; the identity runs eagerly
    >>> bool(np.allclose(call(q, k, v), get_variant("gla")(q, k, v)))
    True
    """

    def __init__(self, rec, jit=None, /, **options):
        if jit is None:
            import jax
            jit = jax.jit
        self.rec = get_variant(rec)
        self.seed = {**self.rec.defaults, **options}.get("seed", 0)
        self.fn = jit(lambda q, k, v, drawn: self.rec(q, k, v, **drawn, **options))
        self._drawn = {}

    def drawn(self, q) -> dict:
        """What the uniform call draws for ``q``'s shape (``{}`` for most variants)."""
        if self.rec.draws is None:
            return {}
        key = (tuple(q.shape), str(q.dtype), str(getattr(q, "device", "")))
        if key not in self._drawn:
            self._drawn[key] = self.rec.draws(q, self.seed)
        return self._drawn[key]

    def __call__(self, q, k, v):
        """The compiled uniform call on ``q (..., n, d)``, ``k (..., s, d)``,
        ``v (..., s, dv)``: ``(..., n, dv)``."""
        return self.fn(q, k, v, self.drawn(q))

    def lower(self, q, k, v):
        """``jit(...).lower`` on these inputs and the draws (``jax.jit``'s lowered
        program: ``.compile()``, ``.as_text()``)."""
        return self.fn.lower(q, k, v, self.drawn(q))


def attention_matrix(fn, q, k, /, **options):
    """The dense ``(..., n, s)`` attention matrix that a variant implies.

    Every variant is linear in ``v``, so ``A = fn(q, k, I_s)``; this runs ``fn`` once on
    an identity value matrix.  ``fn`` is a registry name, a :class:`Variant` or any
    callable ``fn(q, k, v, **options)``.  Meant for tests, docs and small ``s``: it
    costs ``s`` value columns.

    Parameters
    ----------
    fn : str, Variant or callable
        The variant.
    q : array, shape ``(..., n, d)``
        Queries.
    k : array, shape ``(..., s, d)``
        Keys.
    **options
        Passed to the variant.

    Returns
    -------
    array, shape ``(..., n, s)``
        Row ``i`` holds the weights query ``i`` gives to every key.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import attention_matrix, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((3, 4)), rng.standard_normal((5, 4))
    >>> a = attention_matrix("softmax", q, k, causal=True)
    >>> a.shape
    (3, 5)
    >>> bool(np.allclose(a.sum(axis=-1), 1.0))
    True
    """
    from ..core.xp import xp_device, xp_namespace

    if isinstance(fn, str):
        fn = get_variant(fn)
    xp = xp_namespace(q, k, names=("q", "k"))
    s = k.shape[-2]
    eye = xp.eye(s, dtype=q.dtype, device=xp_device(q))
    return fn(q, k, eye, **options)
