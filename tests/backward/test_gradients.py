"""Gradients flow through our array-API code (no autograd code of our own)."""
from __future__ import annotations

import numpy as np
import pytest

from arrayattn import softmax_attention

from conftest import get_backend, make_qkv
from oracle import softmax_attention as oracle


@pytest.mark.parametrize("block_size", [None, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_gradcheck(rng, block_size, causal):
    get_backend("torch")
    import torch

    q, k, v = (torch.tensor(x, requires_grad=True)
               for x in make_qkv(rng, batch=(2,), n=5, s=7, d=3, dv=2, norm=2.0))
    km = torch.tensor(rng.random((2, 7)) < 0.8)
    assert torch.autograd.gradcheck(
        lambda a, b, c: softmax_attention(a, b, c, causal=causal, key_mask=km,
                                          block_size=block_size),
        (q, k, v))


@pytest.mark.parametrize("block_size", [None, 3])
def test_jax_grad_matches_finite_differences(rng, block_size):
    get_backend("jax")
    import jax
    import jax.numpy as jnp

    q, k, v = make_qkv(rng, batch=(), n=4, s=6, d=3, dv=2)
    w = rng.standard_normal((4, 2))

    def loss(qq):
        return jnp.sum(softmax_attention(qq, jnp.asarray(k), jnp.asarray(v), causal=True,
                                         block_size=block_size) * w)

    g = np.asarray(jax.grad(loss)(jnp.asarray(q)))
    # Central differences on the float64 oracle: error O(h^2) ~ 1e-10.
    h, fd = 1e-5, np.zeros_like(q)
    for idx in np.ndindex(*q.shape):
        e = np.zeros_like(q)
        e[idx] = h
        fd[idx] = (np.sum(oracle(q + e, k, v, causal=True) * w)
                   - np.sum(oracle(q - e, k, v, causal=True) * w)) / (2 * h)
    np.testing.assert_allclose(g, fd, rtol=0, atol=1e-8)
