"""Choosing the implementation once, at function entry: the reference form or an engine.

Every variant exists once as a **reference form** (:mod:`arrayattn.reference`: array API
only, shaped like the paper's equation) and, where it pays, as an **engine** for one
backend (today the NumPy-CPU engine, :mod:`arrayattn._numpy`).  This module holds the
rules (:func:`numpy_engine`, :func:`dense_reference`); the call pipeline applies them, in
one place (:func:`arrayattn.core.pipeline.implementation`); nothing backend-specific sits
inside the maths.

The choice can be forced for a block of code (:func:`use_engine`, e.g.
``with arrayattn.use_engine("reference"):``) or for the whole process with the
environment variable ``ARRAYATTN_ENGINE=reference``.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import array_api_compat

__all__ = ["use_engine", "engine_choice", "numpy_engine", "dense_reference", "entry",
           "ENGINE_MIN_BYTES", "DENSE_REFERENCE_MAX"]

#: Below this many bytes of the largest temporary the NumPy engine does not pay (a thread
#: hand-off costs tens of microseconds): the reference form runs.
ENGINE_MIN_BYTES = 1 << 20

#: Variants whose every call runs a gathered (block) form -- sparse patterns,
#: Poolingformer, LSH -- run their dense definition instead under
#: ``use_engine("reference")`` when it has at most this many scores: the definition is
#: what validation compares against, and what the gathered form is tested equal to.
DENSE_REFERENCE_MAX = 1 << 23

_CHOICES = ("auto", "reference", "numpy")
_choice: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "arrayattn_engine", default=None)


def engine_choice() -> str:
    """The choice in force: ``"auto"`` (the default), ``"reference"`` or ``"numpy"``."""
    choice = _choice.get()
    if choice is None:
        choice = os.environ.get("ARRAYATTN_ENGINE", "").strip().lower() or "auto"
        if choice not in _CHOICES:
            raise ValueError(
                f"ARRAYATTN_ENGINE must be one of {', '.join(_CHOICES)}; got {choice!r}")
    return choice


@contextlib.contextmanager
def use_engine(name: str):
    """Force the implementation that arrayattn's functions run inside the ``with`` block.

    Parameters
    ----------
    name : {"auto", "reference", "numpy"}
        ``"reference"``: the reference form on every backend (what :mod:`arrayattn.testing`
        validates against).  ``"numpy"``: the NumPy engine for NumPy inputs of any size
        (other libraries still run the reference form).  ``"auto"``: the default choice --
        the NumPy engine for NumPy inputs large enough to pay, else the reference form.

    The setting is per thread and per asyncio task (a :mod:`contextvars` variable), so
    concurrent callers do not see each other's choice.  ``ARRAYATTN_ENGINE=reference``
    in the environment forces the reference form for the whole process.

    Examples
    --------
    >>> import numpy as np
    >>> import arrayattn
    >>> q = k = v = np.ones((4, 8))
    >>> with arrayattn.use_engine("reference"):
    ...     out = arrayattn.softmax_attention(q, k, v)
    >>> out.shape
    (4, 8)
    """
    if name not in _CHOICES:
        raise ValueError(f"engine must be one of {', '.join(_CHOICES)}; got {name!r}")
    token = _choice.set(name)
    try:
        yield
    finally:
        _choice.reset(token)


def numpy_engine(xp, work_bytes: int | None) -> bool:
    """Whether this call runs the NumPy engine: NumPy inputs, not forced to the reference,
    and ``work_bytes`` (the size of the call's largest temporary) large enough to pay
    (``None``: whether the engine may run at all, whatever the size)."""
    if not array_api_compat.is_numpy_namespace(xp):
        return False
    choice = engine_choice()
    if choice == "reference":
        return False
    return choice == "numpy" or work_bytes is None or work_bytes >= ENGINE_MIN_BYTES


def dense_reference(scores: int) -> bool:
    """Whether a variant with a gathered form runs its dense definition instead: the
    reference is forced and the dense form has at most :data:`DENSE_REFERENCE_MAX`
    ``scores`` (query-key pairs over the batch)."""
    return engine_choice() == "reference" and scores <= DENSE_REFERENCE_MAX


@contextlib.contextmanager
def entry(xp):
    """The context every public function computes in.

    On NumPy it holds the engine's process lock (:func:`arrayattn._numpy.serialised`):
    the engine changes the BLAS thread count while its threads run, so concurrent calls
    are serialised -- each already uses every core -- and a call's result never depends on
    what other threads are doing.  The lock is also what makes ``fork`` safe (the child
    never inherits it held).  On the other backends it pins full float32 matmul precision
    for the call (:mod:`arrayattn.core.precision`: no silent TF32).
    """
    if array_api_compat.is_numpy_namespace(xp):
        from .._numpy import serialised
        with serialised():
            yield
    else:
        from .precision import full_precision
        with full_precision(xp):
            yield
