"""One loop over a sequence axis, for every reference form that carries a state.

``carry, ys = scan(step, carry, xs, axis=a)`` runs ``carry, y = step(carry, *x_i)`` for
``i = 0 .. len - 1`` along axis ``a`` of every array in ``xs`` (the slice ``x_i`` has that
axis removed, as in :func:`jax.lax.scan`) and stacks the ``y`` back along ``a``.
``reverse=True`` walks from the end (the backward pass's reverse-time recurrences); the
``ys`` keep the forward order.  An entry of ``xs`` may also be a static table, a Python
``range`` or list of ints (block offsets, counts): the step gets the Python int, or on
JAX a traced integer.

On JAX it *is* :func:`jax.lax.scan`: the body is traced once, so the compiled program and
its compile time do not grow with the sequence length (a Python loop is unrolled by
``jax.jit``).  Everywhere else it is the plain loop it describes.  ``step`` returns
``(carry, y)``; ``y`` may be an array, a tuple of arrays or ``None`` (nothing stacked).
The carry may start smaller than it ends (a ``(c, f)`` zero state that the first step
broadcasts to the batch, a float32 start promoted by float64 inputs): on JAX it is
broadcast and cast once to the shape and dtype one step gives it, as the plain loop
would have grown it.

:func:`running_sum` gives the states entering and leaving each chunk (a cumulative sum,
or the loop that XLA's CPU backend compiles the same at every length);
:func:`fori` repeats a step a fixed number of times (``jax.lax.fori_loop``);
:func:`cond` runs a step or skips it (``jax.lax.cond``: a skipped block costs nothing
under ``jax.jit``; elsewhere the condition is a Python bool).  All four are
differentiable by ``jax.grad``.
"""
from __future__ import annotations

import array_api_compat

from .device import device_kind

__all__ = ["scan", "fori", "cond", "running_sum", "XLA_CPU_CUMSUM_STEPS"]

#: The longest ``cumulative_sum`` that :func:`running_sum` leaves to XLA's CPU backend:
#: up to 16 steps it is one reduce-window, past that a tree of them.
XLA_CPU_CUMSUM_STEPS = 16


def _is_table(x) -> bool:
    return isinstance(x, (range, list, tuple))


def _leaves(tree):
    if isinstance(tree, (tuple, list)):
        return [leaf for t in tree for leaf in _leaves(t)]
    return [] if tree is None else [tree]


def _is_jax(*trees) -> bool:
    probe = [x for t in trees for x in _leaves(t) if hasattr(x, "shape")]
    return bool(probe) and array_api_compat.is_jax_array(probe[0])


def _settled(fn, carry, *args):
    """The carry broadcast and cast to what ``fn(carry, *args)`` returns as carry (JAX)."""
    import jax
    import jax.numpy as jnp

    for _ in range(3):     # each pass can only grow shapes / promote dtypes: few passes
        out = jax.eval_shape(fn, carry, *args)
        flat, tree = jax.tree_util.tree_flatten(carry)
        want = jax.tree_util.tree_leaves(out)
        if all(x.shape == w.shape and x.dtype == w.dtype for x, w in zip(flat, want)):
            return carry
        carry = jax.tree_util.tree_unflatten(tree, [
            jnp.broadcast_to(jnp.asarray(x), w.shape).astype(w.dtype)
            for x, w in zip(flat, want)])
    return carry


def scan(step, carry, xs, *, axis: int, reverse: bool = False, like=None):
    """``(carry, ys)``: ``step(carry, *slices)`` along ``axis`` of each array in ``xs``.

    Parameters
    ----------
    step : callable
        ``step(carry, *x_i) -> (carry, y)``.
    carry : array, tuple of arrays or None
        The loop-carried state.
    xs : tuple of arrays or static tables
        Scanned together along ``axis`` (same length there); a table (``range`` or list of
        ints) gives its ``i``-th entry.
    axis : int
        The sequence axis (negative: counted from the end, the same for every array and
        for the stacked ``ys``).
    reverse : bool
        Walk from the last index to the first.
    like : array, optional
        An array of the namespace, when neither ``carry`` nor ``xs`` holds an array.

    Returns
    -------
    carry, ys
        The final carry and the stacked ``y`` (same structure as ``y``; ``None`` when the
        step returns ``None``).
    """
    xs = tuple(xs)
    arrays = [x for x in xs if not _is_table(x)]
    if _is_jax(arrays, carry, like):
        import jax
        import jax.numpy as jnp

        moved = tuple(jnp.asarray(x, dtype=jnp.int32) if _is_table(x) else
                      jnp.moveaxis(x, axis, 0) for x in xs)

        def body(c, x):
            return step(c, *x)

        first = tuple(jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in moved)
        carry = _settled(lambda c, x: body(c, x)[0], carry, first)
        carry, ys = jax.lax.scan(body, carry, moved, reverse=reverse)
        return carry, _map(lambda y: jnp.moveaxis(y, 0, axis), ys)
    length = len(xs[0]) if _is_table(xs[0]) else xs[0].shape[axis]
    ys = []
    for i in (range(length - 1, -1, -1) if reverse else range(length)):
        carry, y = step(carry, *(x[i] if _is_table(x) else _take(x, i, axis) for x in xs))
        ys.append(y)
    if reverse:
        ys.reverse()
    if not ys or ys[0] is None:
        return carry, None
    xp = array_api_compat.array_namespace(*_leaves(ys[0]))
    if isinstance(ys[0], tuple):
        return carry, tuple(xp.stack([y[j] for y in ys], axis=axis)
                            for j in range(len(ys[0])))
    return carry, xp.stack(ys, axis=axis)


def fori(step, carry, count: int):
    """``carry = step(carry)`` ``count`` times (``jax.lax.fori_loop`` on JAX): fixed-count
    iterations such as the iterative pseudo-inverse, traced once under ``jax.jit``."""
    if _is_jax(carry):
        import jax
        carry = _settled(step, carry)
        return jax.lax.fori_loop(0, count, lambda _, c: step(c), carry)
    for _ in range(count):
        carry = step(carry)
    return carry


def cond(pred, step, carry):
    """``step(carry)`` where ``pred`` holds, else ``carry``: :func:`jax.lax.cond` when
    ``pred`` is a JAX (traced) boolean -- the step not taken is not run -- and a Python
    ``if`` on a Python bool elsewhere (no host read)."""
    if isinstance(pred, bool):
        return step(carry) if pred else carry
    if not array_api_compat.is_jax_array(pred):
        raise TypeError(f"cond: pred must be a Python bool or a JAX boolean; got "
                        f"{type(pred).__name__}")
    import jax
    carry = _settled(step, carry)
    return jax.lax.cond(pred, step, lambda c: c, carry)


def running_sum(x, start=None, *, axis: int, reverse: bool = False):
    """``(before, total)``: the sums of ``x`` along ``axis`` (negative) before each index,
    ``before_i = start + sum_(j < i) x_j`` (``j > i`` with ``reverse``), and
    ``total = start + sum_j x_j``: the states entering each chunk and leaving the last.
    ``start``: ``x`` without that axis, or broadcastable to it (``None``: zero).

    One ``cumulative_sum``, except for JAX arrays on a CPU past 16 steps, where it is a
    ``fori_loop``: XLA's CPU backend compiles a cumulative sum of up to 16 steps as one
    reduce-window and a longer one as a tree of them that deepens with the length, so the
    compile time grew with ``n`` (causal Performer: 0.37 s at 16 chunks, 0.60 s at 256);
    the loop compiles the same at every length and runs 6-17 % faster.  On a GPU the
    cumulative sum is one kernel and a loop a launch per step (CuPy, 256 chunks: 3 ms
    against 36 ms, H200).
    """
    xp = array_api_compat.array_namespace(x)
    if (array_api_compat.is_jax_array(x) and device_kind(x) == "cpu"
            and x.shape[axis] > XLA_CPU_CUMSUM_STEPS):
        return _running_sum_jax(x, start, axis, reverse)
    sums = xp.cumulative_sum(xp.flip(x, axis=axis) if reverse else x, axis=axis,
                             include_initial=True)
    sums = sums if start is None else xp.expand_dims(start, axis=axis) + sums
    before = sums[(slice(None),) * (axis % sums.ndim) + (slice(None, -1), ...)]
    return (xp.flip(before, axis=axis) if reverse else before), _take(sums, -1, axis)


def _running_sum_jax(x, start, axis: int, reverse: bool):
    """:func:`running_sum` as a ``fori_loop`` that reads and writes along ``axis`` where
    it is: a :func:`scan` moves that axis to the front and back, two transposes of the
    stacked states (causal Performer, 256 features: 1.4x slower at ``n`` = 1024)."""
    import jax
    import jax.numpy as jnp

    acc = jnp.zeros_like(jax.lax.index_in_dim(x, 0, axis, keepdims=False))
    acc = acc if start is None else acc + start          # broadcast and promoted
    out = jnp.zeros(jnp.broadcast_shapes(x.shape, jnp.expand_dims(acc, axis).shape),
                    acc.dtype)
    length = x.shape[axis]

    def step(i, carry):
        acc, out = carry
        j = length - 1 - i if reverse else i
        out = jax.lax.dynamic_update_index_in_dim(out, acc, j, axis)
        return acc + jax.lax.dynamic_index_in_dim(x, j, axis, keepdims=False), out

    acc, out = jax.lax.fori_loop(0, length, step, (acc, out))
    return out, acc


def _take(x, i: int, axis: int):
    axis = axis % x.ndim
    return x[(slice(None),) * axis + (i, ...)]   # array-api-strict wants the ellipsis


def _map(fn, ys):
    if ys is None:
        return None
    if isinstance(ys, tuple):
        return tuple(fn(y) for y in ys)
    return fn(ys)
