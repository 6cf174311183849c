"""``reference.scan.running_sum``: the states entering and leaving each chunk (#26).

A loop oracle on every backend, forward and reverse, with a zero or broadcast start, at
5 steps (one ``cumulative_sum`` everywhere) and 40 (a ``fori_loop`` for JAX on a CPU);
and the reason for the loop: the program XLA's CPU backend compiles has no reduce-window
and the same size at 32 and 256 steps (a cumulative sum there is a tree of
reduce-windows that deepens with the length).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from arrayattn.reference.scan import running_sum


def _oracle(x, start, reverse):
    steps = x.shape[-3]
    acc = np.zeros(x.shape[:-3] + x.shape[-2:]) + (0.0 if start is None else start)
    before = [None] * steps
    for i in (reversed(range(steps)) if reverse else range(steps)):
        before[i] = acc
        acc = acc + x[..., i, :, :]
    return np.stack(before, axis=-3), acc


@pytest.mark.parametrize("steps", [5, 40])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_start", [False, True])
def test_running_sum_loop_oracle(backend, steps, reverse, with_start):
    rng = np.random.default_rng(steps + 2 * reverse + 4 * with_start)
    x = rng.standard_normal((2, 3, steps, 4, 5))
    start = rng.standard_normal((3, 4, 5)) if with_start else None   # broadcast batch
    want_before, want_total = _oracle(x, start, reverse)
    before, total = running_sum(backend.asarray(x, "float32"),
                                None if start is None else backend.asarray(start, "float32"),
                                axis=-3, reverse=reverse)
    tol = 8 * steps * np.finfo(np.float32).eps * (1 + np.abs(x).sum(axis=-3).max())
    for got, want in ((before, want_before), (total, want_total)):
        assert got.dtype == backend.dtype("float32")
        np.testing.assert_allclose(backend.to_numpy(got), want, rtol=0, atol=tol)


def test_running_sum_compiles_flat():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("the loop is for XLA's CPU backend")

    def compiled(steps):
        x = jax.ShapeDtypeStruct((2, steps, 8, 9), jax.numpy.float32)
        text = jax.jit(lambda x: running_sum(x, axis=-3)).lower(x).compile().as_text()
        body = [line for line in text.splitlines() if re.match(r"\s*(ROOT )?%\S+ = ", line)]
        return len(body), text.count("reduce-window")

    (short, rw_short), (long, rw_long) = compiled(32), compiled(256)
    assert rw_short == rw_long == 0
    assert short == long
