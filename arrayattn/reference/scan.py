"""One loop over a sequence axis, for every reference form that carries a state.

``carry, ys = scan(step, carry, xs, axis=a)`` runs ``carry, y = step(carry, *x_i)`` for
``i = 0 .. len - 1`` along axis ``a`` of every array in ``xs`` (the slice ``x_i`` has that
axis removed, as in :func:`jax.lax.scan`) and stacks the ``y`` back along ``a``.
``reverse=True`` walks from the end (the backward pass's reverse-time recurrences); the
``ys`` keep the forward order.

On JAX it *is* :func:`jax.lax.scan`: the body is traced once, so the compiled program and
its compile time do not grow with the sequence length (a Python loop is unrolled by
``jax.jit``).  Everywhere else it is the plain loop it describes.  ``step`` returns
``(carry, y)``; ``y`` may be an array, a tuple of arrays or ``None`` (nothing stacked).
The carry must keep its shapes and dtypes from step to step.
"""
from __future__ import annotations

import array_api_compat

__all__ = ["scan", "fori"]


def _is_jax(xs, carry):
    probe = [x for x in (*xs, *_leaves(carry)) if hasattr(x, "shape")]
    return bool(probe) and array_api_compat.is_jax_array(probe[0])


def _leaves(tree):
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in _leaves(t)]
    return [] if tree is None else [tree]


def scan(step, carry, xs, *, axis: int, reverse: bool = False):
    """``(carry, ys)``: ``step(carry, *slices)`` along ``axis`` of each array in ``xs``.

    Parameters
    ----------
    step : callable
        ``step(carry, *x_i) -> (carry, y)``.
    carry : array or tuple of arrays
        The loop-carried state (fixed shapes and dtypes).
    xs : tuple of arrays
        Scanned together along ``axis`` (same length there).
    axis : int
        The sequence axis (negative: counted from the end, the same for every array).
    reverse : bool
        Walk from the last index to the first.

    Returns
    -------
    carry, ys
        The final carry and the stacked ``y`` (same structure as ``y``; ``None`` when the
        step returns ``None``).
    """
    xs = tuple(xs)
    if _is_jax(xs, carry):
        import jax
        import jax.numpy as jnp

        moved = tuple(jnp.moveaxis(x, axis, 0) for x in xs)
        carry, ys = jax.lax.scan(lambda c, x: step(c, *x), carry, moved, reverse=reverse)
        return carry, _map(lambda y: jnp.moveaxis(y, 0, axis), ys)
    xp = _namespace(xs, carry)
    length = xs[0].shape[axis]
    ys = []
    for i in (range(length - 1, -1, -1) if reverse else range(length)):
        carry, y = step(carry, *(_take(x, i, axis) for x in xs))
        ys.append(y)
    if reverse:
        ys.reverse()
    if not ys or ys[0] is None:
        return carry, None
    if isinstance(ys[0], tuple):
        return carry, tuple(xp.stack([y[j] for y in ys], axis=axis)
                            for j in range(len(ys[0])))
    return carry, xp.stack(ys, axis=axis)


def fori(step, carry, count: int):
    """``carry = step(carry)`` ``count`` times (``jax.lax.fori_loop`` on JAX): fixed-count
    iterations such as the iterative pseudo-inverse, traced once under ``jax.jit``."""
    leaves = _leaves(carry)
    if leaves and array_api_compat.is_jax_array(leaves[0]):
        import jax
        return jax.lax.fori_loop(0, count, lambda _, c: step(c), carry)
    for _ in range(count):
        carry = step(carry)
    return carry


def _namespace(xs, carry):
    return array_api_compat.array_namespace(*xs, *_leaves(carry))


def _take(x, i: int, axis: int):
    axis = axis % x.ndim
    return x[(slice(None),) * axis + (i, ...)]   # array-api-strict wants the ellipsis


def _map(fn, ys):
    if ys is None:
        return None
    if isinstance(ys, tuple):
        return tuple(fn(y) for y in ys)
    return fn(ys)
