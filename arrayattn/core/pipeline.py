"""The one call pipeline every public attention function runs through: :func:`run`.

``run(spec, q, k, v, **options)`` does, in this order and in no other place:

1. **check** the call once (``spec.check``: every argument, in :mod:`arrayattn.core.checks`
   and its sibling validation modules) into a *call* record holding the
   :class:`~arrayattn.core.checks.Problem` ``p`` and the resolved options;
2. **empty inputs** (no query, no key, zero heads): zeros of the output's shape, or
   ``spec.empty(call)`` where the variant returns more than the output;
3. **cast** ``q, k, v`` to the working dtype (float32 for half precisions) and **zero the
   rows of masked keys** (padding may hold anything, NaN included), once;
4. **take out non-finite keys** where the spec marks them (``spec.poison(call)``): a key or
   value row holding NaN/inf is zeroed and marked in ``bad (..., s)``, and the variant makes
   NaN exactly the rows that may see it (:mod:`arrayattn.reference.finite`).  On NumPy
   one cheap pass first (:func:`finite_on_host`, a sum of ``k`` and one of ``v``): where it
   finds every value finite, nothing is marked (``bad`` is ``None``) and no row is
   poisoned -- the guarantee costs ~1% of a call on finite inputs (issue #39).  Other
   namespaces always take the careful, ``where``-based path (no host read: it traces
   under ``jax.jit``);
5. **enter the namespace** (:func:`arrayattn.core.engine.entry`: the NumPy engine's lock, full
   float32 matmul precision elsewhere);
6. **choose the implementation**: the spec's NumPy engine when the inputs are NumPy and
   ``spec.work(call, w)`` -- the bytes of the engine's largest temporary -- is large enough
   to pay (:func:`arrayattn.core.engine.numpy_engine`); the dense definition under
   ``use_engine("reference")`` for variants whose every call runs a gathered form
   (``spec.dense``); else the reference form (:func:`implementation`, which the backward
   adapters call too: no other module chooses);
7. **cast back** the output (the first element when the variant returns a tuple) to the
   caller's dtype.

A :class:`Spec` is data: which functions do each step, and what each option's ``None``
means.  A public function is its signature, its numpydoc and one ``run`` call.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple

import array_api_compat

from .engine import dense_reference, entry, numpy_engine
from .._numpy.finite import all_finite
from ..reference.finite import drop_nonfinite, nonfinite_rows
from ..reference.masks import zero_masked_keys

__all__ = ["Spec", "Working", "run", "working", "implementation", "engine_pays",
           "finite_on_host", "nan_free_on_host"]


class Working(NamedTuple):
    """``q, k, v`` in the working dtype, masked keys zeroed; ``bad (..., s)`` marks the
    keys taken out for holding a non-finite value (``None`` where the spec does not mark
    them, or where :func:`finite_on_host` found every key and value finite: then no row
    is poisoned)."""

    q: Any
    k: Any
    v: Any
    bad: Any = None


@dataclass(frozen=True)
class Spec:
    """How one public function runs: the pipeline's steps for it, as data.

    Attributes
    ----------
    name : str
        The public function's name (for messages and the docs).
    check : callable
        ``check(q, k, v, **options) -> call``: validates every argument once; ``call.p``
        is the :class:`~arrayattn.core.checks.Problem`, ``call.key_mask`` the validated key
        mask (or ``None``).
    reference : callable
        ``reference(call, w) -> out``: the reference form (:mod:`arrayattn.reference`)
        on the :class:`Working` arrays ``w``.
    engine : callable, optional
        ``engine(call, w) -> out``: the NumPy-CPU engine (:mod:`arrayattn._numpy`).
    work : callable, optional
        ``work(call, w) -> int or None``: bytes of the engine's largest temporary (the
        engine runs when it pays); ``None`` where the engine cannot take this call.
    dense : callable, optional
        ``dense(call, w) -> out``: the dense definition, for variants whose every call
        runs a gathered form; it runs under ``use_engine("reference")`` when
        ``scores(call)`` (query-key pairs) is small
        (:func:`arrayattn.core.engine.dense_reference`).
    scores : callable, optional
        ``scores(call) -> int``, with ``dense``.
    poison : callable, optional
        ``poison(call) -> bool``: whether non-finite keys are taken out and marked in
        ``w.bad`` (the variant then makes exactly the rows that see them NaN).
    empty : callable, optional
        ``empty(call)``: the result of an empty problem where it is not just the zeros of
        the output's shape (e.g. ``(out, lse)``).
    inputs : callable, optional
        ``inputs(call) -> (q, k, v)``: the arrays the pipeline works on where the check
        made them from the caller's (a paged cache's gathered pages, grouped heads).
    finish : callable, optional
        ``finish(call, result)``: the result in the caller's shapes, with ``inputs``
        (grouped heads merged back).
    none_means : mapping
        For each option whose default is ``None``: what ``None`` means (``"1/sqrt(d)"``,
        ``"no mask"``, ``"drawn from seed"`` ...), for the docs and the catalogue's test.
    """

    name: str
    check: Callable
    reference: Callable
    engine: Callable | None = None
    work: Callable | None = None
    dense: Callable | None = None
    scores: Callable | None = None
    poison: Callable | None = None
    empty: Callable | None = None
    inputs: Callable | None = None
    finish: Callable | None = None
    none_means: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "none_means", MappingProxyType(dict(self.none_means)))


def working(p, q, k, v, key_mask, *, poison: bool = False) -> Working:
    """Steps 3-4 of the pipeline: ``q, k, v`` cast to ``p.work_dtype``, the rows of
    masked keys zeroed and, with ``poison``, the non-finite key rows zeroed and marked."""
    xp, wd = p.xp, p.work_dtype
    wk, wv = zero_masked_keys(key_mask, xp.astype(k, wd, copy=False),
                              xp.astype(v, wd, copy=False))
    bad = None
    if poison and not finite_on_host(xp, wk, wv):
        bad = nonfinite_rows(wk, wv)
        wk, wv = drop_nonfinite(bad, wk, wv)
    return Working(xp.astype(q, wd, copy=False), wk, wv, bad)


def finite_on_host(xp, *arrays) -> bool:
    """Whether one cheap host pass proves every value of ``arrays`` finite.

    On NumPy (no device: reading a value syncs nothing) one sum over each array (of its
    squares where it is contiguous, :func:`arrayattn._numpy.finite.host_sum`): it is
    finite only where every value is (a NaN propagates, ``inf - inf`` is NaN); a sum of finite values that
    overflows answers ``False``, which only sends the call to the careful path.  One read
    of each array, no temporary -- about 0.6 ms for 8M float32 values, against the
    ~70 ms of the per-row reductions and ``where`` copies it spares at n = 16384
    (issue #39).  ``None``
    entries are skipped.  On every other namespace ``False`` (not known): those callers
    keep the ``where``-based path, which reads no value and traces under ``jax.jit``.
    """
    if not array_api_compat.is_numpy_namespace(xp):
        return False
    return all_finite(*arrays)


def nan_free_on_host(xp, *arrays) -> bool:
    """Like :func:`finite_on_host` for arrays whose infinities are allowed but all of one
    sign (log gates ``<= 0``, ``-inf`` a restart): no NaN, proved by a sum that is not
    NaN.  ``False`` on every namespace but NumPy."""
    if not array_api_compat.is_numpy_namespace(xp):
        return False
    import numpy as np
    with np.errstate(over="ignore", invalid="ignore"):
        return all(x is None or x.size == 0 or not bool(np.isnan(np.sum(x))) for x in arrays)


def implementation(spec: Spec, call, w) -> Callable:
    """Step 6, the one place an implementation is chosen: ``spec.dense`` where the
    reference is forced and the dense form is small
    (:func:`~arrayattn.core.engine.dense_reference` on ``spec.scores(call)``),
    ``spec.engine`` where the inputs are NumPy and
    ``spec.work(call, w)`` pays (:func:`~arrayattn.core.engine.numpy_engine`), else
    ``spec.reference``.  The forward passes (:func:`run`) and the backward adapters
    (:mod:`arrayattn.backward`, whose specs' functions also take the cotangent) call it."""
    if spec.dense is not None and dense_reference(spec.scores(call)):
        return spec.dense
    # the work estimate only where the engine could run: it may read NumPy values
    if spec.engine is not None and engine_pays(call.p.xp, None):
        work = spec.work(call, w)
        if work is not None and engine_pays(call.p.xp, work):
            return spec.engine
    return spec.reference


def engine_pays(xp, work: int | None) -> bool:
    """Whether the NumPy engine runs a computation of ``work`` bytes (its largest
    temporary; ``None``: whether it may run at all) in namespace ``xp``: the rule of
    :func:`~arrayattn.core.engine.numpy_engine`, for the few functions that are not
    attention calls (one array: :func:`~arrayattn.segment_means`,
    :func:`~arrayattn.pinv`)."""
    return numpy_engine(xp, work)


def run(spec: Spec, q, k, v, /, **options):
    """Run the public function described by ``spec`` on ``q, k, v`` (see the module
    docstring for the steps).  Returns what the function documents: the output
    ``(..., n, dv)`` in the caller's namespace, device and dtype, or a tuple whose first
    element is that output."""
    call = spec.check(q, k, v, **options)
    if spec.inputs is not None:
        q, k, v = spec.inputs(call)
    p = call.p
    if p.empty:
        out = p.zeros() if spec.empty is None else spec.empty(call)
    else:
        poison = spec.poison is not None and spec.poison(call)
        w = working(p, q, k, v, call.key_mask, poison=poison)
        with entry(p.xp):
            out = implementation(spec, call, w)(call, w)
        if isinstance(out, tuple):
            out = (p.xp.astype(out[0], p.dtype, copy=False), *out[1:])
        else:
            out = p.xp.astype(out, p.dtype, copy=False)
    return out if spec.finish is None else spec.finish(call, out)
