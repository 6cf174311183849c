"""The record of one attention variant (:class:`Variant`): its function, uniform call,
defaults and metadata; the catalogue's rows and the registry's entries."""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

__all__ = ["Variant"]


@dataclass(frozen=True)
class Variant:
    """One registered attention variant.

    Attributes
    ----------
    name : str
        Registry key, e.g. ``"softmax"`` or ``"performer_positive"``.
    fn : callable
        The public function, ``fn(q, k, v, **options)``.
    family : str
        ``"exact"``, ``"kernel"``, ``"random_features"``, ``"low_rank"``, ``"sparse"``,
        ``"hashing"`` ...
    exact : bool
        Whether the output equals exact softmax attention (up to rounding).
    causal, key_mask, mask : bool
        Which of the common options the variant supports.
    normalized : bool
        Whether rows of the implied attention matrix sum to 1.
    defaults : mapping
        Options passed on every call through the record (user options win).
    parameter : str or None
        Name of the option that sets the approximation size (``num_features``,
        ``num_landmarks``, ``window`` ...), for reports and plots.
    complexity, citation : str
        For the docs and reports.
    call : callable or None
        Adapter ``call(q, k, v, **options)`` for variants whose function takes other
        inputs (e.g. shared-QK LSH uses ``q`` as ``qk`` and ignores ``k``); documented in
        ``notes``.
    random : bool
        Whether the variant draws random matrices (controlled by ``seed``).
    cross : bool
        Whether ``n != s`` (cross-attention) is supported.
    notes : str
        Anything a user of the uniform call must know.
    linear_in_v : bool
        Whether the output is linear in ``v`` (so that :func:`attention_matrix` gives
        the matrix the variant applies).  False for variants whose weights depend on
        ``v`` (Luna: the unpack step attends to keys made from the packed values).
    prepare : callable or None
        ``prepare(q, options) -> options``: options resolved from the caller's ``q``
        before grouped-query heads are split (retention's default per-head decays).
    draws : callable or None
        ``draws(q, seed=0) -> {option: array}``: the inputs of the sequence's size that
        the uniform call draws on the host from ``seed`` (the gated families' gates,
        for ``q``'s shape as given).  ``rec(q, k, v, **rec.draws(q))`` is the same call;
        under ``jax.jit`` pass them as arguments (:func:`jit_uniform`), or they are
        constants of the program and its compile time grows with ``n``.

    Examples
    --------
    >>> import numpy as np
    >>> from arrayattn import get_variant
    >>> rec = get_variant("softmax_blockwise")
    >>> rec.family, rec.exact, rec.parameter, rec.parameter_value
    ('exact', True, 'block_size', 'auto')
    >>> q = k = v = np.ones((3, 4))
    >>> rec(q, k, v, block_size=2).shape     # the uniform call; options override defaults
    (3, 4)
    """

    name: str
    fn: Callable
    family: str
    exact: bool
    causal: bool
    key_mask: bool
    complexity: str
    citation: str
    mask: bool = False
    normalized: bool = True
    defaults: Mapping[str, Any] = field(default_factory=dict)
    parameter: str | None = None
    call: Callable | None = None
    random: bool = False
    cross: bool = True
    notes: str = ""
    linear_in_v: bool = True
    prepare: Callable | None = None
    draws: Callable | None = None

    def __post_init__(self):
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    def __call__(self, q, k, v, /, **options):
        """Run the variant with its default options overridden by ``options``.

        Grouped-query heads are accepted: ``q`` with ``Hq`` heads (axis -3) and ``k``,
        ``v`` with ``Hkv`` heads, ``Hq`` a multiple of ``Hkv`` (as SDPA's ``enable_gqa``;
        see :mod:`arrayattn.core.heads`), without copying ``k`` and ``v``.
        """
        from ..core.heads import group_heads

        opts = {**self.defaults, **options}
        if self.prepare is not None:
            opts = self.prepare(q, opts)
        fn = self.call or self.fn
        grouped = group_heads(q, k, v, opts) if hasattr(q, "shape") else None
        if grouped is None:
            return fn(q, k, v, **opts)
        qg, kg, vg, opts, ungroup = grouped
        return ungroup(fn(qg, kg, vg, **opts))

    def reference(self, q, k, v, /, **options):
        """Run the variant's reference form (:mod:`arrayattn.reference`) with its default
        options overridden by ``options``: the same validation and dtype rules as the
        uniform call, never an engine.  The engines are tested equal to it, and
        :mod:`arrayattn.testing` validates other implementations against it."""
        from ..core.engine import use_engine
        with use_engine("reference"):
            return self(q, k, v, **options)

    @property
    def parameter_value(self):
        """The default value of the approximation parameter (or ``None``)."""
        return None if self.parameter is None else self.defaults.get(self.parameter)
