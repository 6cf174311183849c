"""The backward of the kernel family: kernel attention on features
(``reference.kernel_attention_vjp``, shared with the random-feature variants), the feature
maps, :func:`arrayattn.linear_attention`, :func:`arrayattn.feature_attention` and
:func:`arrayattn.efficient_attention`.

Oracles: torch autograd through the forward reference forms (float64, relative error
<= 1e-10, the issue's bar), central finite differences, and the NumPy result itself for
the other backends and under ``jax.jit``.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import reference

from conftest import get_backend, make_qkv

torch = pytest.importorskip("torch")

#: Relative error against autodiff through the reference form, float64 (the issue's bar).
RTOL = 1e-10
SHAPES = [(13, 13), (9, 17), (17, 9)]          # n == s, n < s, n > s (end-aligned)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if b.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _torch_feature_grads(args: dict, do, **options):
    """Autograd through ``reference.kernel_attention`` (its ``method``, its chunks)."""
    t = {name: torch.tensor(x, requires_grad=True) for name, x in args.items()}
    km = options.pop("key_mask", None)
    out, _ = reference.kernel_attention(
        t["phi_q"], t["phi_k"], t["v"], state=t.get("state"),
        key_mask=None if km is None else torch.tensor(km), **options)
    out.backward(torch.tensor(do))
    return {name: (x.grad.numpy() if x.grad is not None else np.zeros(x.shape))
            for name, x in t.items()}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, s", SHAPES + [(0, 5), (5, 0)])
@pytest.mark.parametrize("method", ["chunked", "cumsum", "recurrent"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_kernel_attention_vjp_equals_torch_autograd(causal, n, s, method, normalize,
                                                    with_state, rng):
    m, dv = 5, 3
    args = {"phi_q": rng.random((2, n, m)), "phi_k": rng.random((2, s, m)),
            "v": rng.standard_normal((2, s, dv))}
    if with_state:
        args["state"] = rng.random((2, m, dv + 1))
    km = rng.random((2, s)) > 0.3
    args["phi_k"][~km] = np.nan                  # masked padding: never enters arithmetic
    args["v"][~km] = np.inf
    do = rng.standard_normal((2, n, dv))
    opts = dict(causal=causal, key_mask=km, method=method, chunk_size=4, eps=0.0,
                normalize=normalize)
    grads = reference.kernel_attention_vjp(args["phi_q"], args["phi_k"], args["v"], do,
                                           state=args.get("state"), **opts)
    expected = _torch_feature_grads(args, do, **opts)
    assert sorted(grads) == sorted(args)
    for name, x in args.items():
        assert grads[name].shape == x.shape
        assert _rel(grads[name], expected[name]) <= RTOL, name
    assert np.all(grads["phi_k"][~km] == 0) and np.all(grads["v"][~km] == 0)
