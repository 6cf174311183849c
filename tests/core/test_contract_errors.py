"""Clear errors and empty inputs, for every variant on every backend (issue #25 point 2):
a table of bad calls, each with the error it must raise and the words its message must
hold; and the empty problems (no keys, no tokens, no heads) that return zeros of the
right shape instead of raising."""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn

from conftest import make_qkv

RECORDS = arrayattn.variants()


def _small(rec):
    return {"num_landmarks": 2} if rec.parameter == "num_landmarks" else {}


@pytest.mark.parametrize("shape", [
    pytest.param(((2, 6, 4), (2, 0, 4)), id="s=0"),
    pytest.param(((2, 0, 4), (2, 0, 4)), id="n=s=0"),
    pytest.param(((2, 0, 6, 4), (2, 0, 6, 4)), id="no-heads"),
])
@pytest.mark.parametrize("rec", RECORDS, ids=[r.name for r in RECORDS])
def test_empty_problems_return_zeros(rec, backend, shape, rng):
    """``s = 0``: every query attends to nothing, so zeros (the conventions' empty row);
    no tokens or no heads: an empty output of the right shape."""
    qs, ks = shape
    if qs[-2] != ks[-2] and not rec.cross:
        pytest.skip(f"{rec.name} is self-attention (n == s)")
    q, k, v = (backend.asarray(rng.standard_normal(s)) for s in (qs, ks, ks))
    out = backend.to_numpy(rec(q, k, v, **_small(rec)))
    assert out.shape == (*qs[:-1], ks[-1])
    assert not out.any() and np.isfinite(out).all()


def _gated_inputs(rng):
    q, k, v = make_qkv(rng, batch=(1, 2), n=6, d=4)
    return q, k, v


BAD_CALLS = {
    "retention gamma > 1 (array)": (
        lambda x, q, k, v: arrayattn.retention(x(q), x(k), x(v), gamma=x(np.array([0.9, 1.5]))),
        ValueError, "gamma must be decays in (0, 1]"),
    "retention gamma NaN (array)": (
        lambda x, q, k, v: arrayattn.retention(x(q), x(k), x(v),
                                              gamma=x(np.array([0.9, np.nan]))),
        ValueError, "gamma"),
    "retention gamma of booleans": (
        lambda x, q, k, v: arrayattn.retention(x(q), x(k), x(v),
                                              gamma=x(np.array([True, True]))),
        TypeError, "gamma must hold real numbers"),
    "gated initial_state of integers": (
        lambda x, q, k, v: arrayattn.gla_attention(
            x(q), x(k), x(v), x(np.full(q.shape, -0.1)),
            initial_state=x(np.zeros((1, 2, 4, 4), dtype=np.int64))),
        TypeError, "initial_state must have a real floating dtype"),
    "gated initial_state of another batch": (
        lambda x, q, k, v: arrayattn.delta_attention(
            x(q), x(k), x(v), x(np.full(q.shape[:-1], 0.5)),
            initial_state=x(np.zeros((3, 2, 4, 4)))),
        ValueError, "initial_state must have shape (..., dk, dv) broadcastable to the batch"),
    "lsh uniform call with a k of another shape": (
        lambda x, q, k, v: arrayattn.get_variant("lsh")(x(q), x(k[..., :3, :]), x(v)),
        ValueError, "ignores k, so k must have q's tokens and width"),
    "lsh uniform call with a k of another dtype (ignored before, issue #39)": (
        lambda x, q, k, v: arrayattn.get_variant("lsh")(x(q), x(k.astype(np.float32)), x(v)),
        TypeError, "k has dtype"),
    "retention list of gammas with a 2-D q (named gamma, issue #39)": (
        lambda x, q, k, v: arrayattn.retention(x(q[0, 0]), x(k[0, 0]), x(v[0, 0]),
                                              gamma=[0.9, 0.8]),
        ValueError, "gamma of shape (2,)"),
    "retention one-element list of gammas with a 2-D q": (
        lambda x, q, k, v: arrayattn.retention(x(q[0, 0]), x(k[0, 0]), x(v[0, 0]),
                                              gamma=[0.9]),
        ValueError, "no heads axis: pass one number as gamma"),
    "lsh uniform call names q": (
        lambda x, q, k, v: arrayattn.get_variant("lsh")(x(q[..., :5, :]), x(q), x(v)),
        ValueError, "q has"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_raise_clear_errors(case, backend, rng):
    call, error, words = BAD_CALLS[case]
    q, k, v = _gated_inputs(rng)
    with pytest.raises(error, match=__import__("re").escape(words)):
        call(backend.asarray, q, k, v)


def test_lsh_uniform_call_refuses_a_k_of_another_library(backend, rng):
    """``k`` is ignored by the shared-QK call, so a ``k`` of another library (or dtype)
    is a call meant for another variant: refused, naming k (issue #39 point 7)."""
    q, k, v = _gated_inputs(rng)
    strict = pytest.importorskip("array_api_strict")
    other = np.asarray(k) if "strict" in backend.name else strict.asarray(k)
    with pytest.raises(TypeError, match=r"\bk is\b"):
        arrayattn.get_variant("lsh")(backend.asarray(q), other, backend.asarray(v))


def test_retention_one_gamma_with_a_2d_q_is_the_3d_result(rng):
    """A scalar ``gamma`` works for a ``q`` without a heads axis (it failed in a
    broadcast before) and equals the one-head call."""
    q, k, v = (x[0, 0] for x in _gated_inputs(rng))
    np.testing.assert_allclose(arrayattn.retention(q, k, v, gamma=0.9),
                               arrayattn.retention(q[None], k[None], v[None],
                                                   gamma=[0.9])[0], rtol=1e-12, atol=0)


def test_retention_gamma_array_is_checked_like_a_list(rng):
    q, k, v = _gated_inputs(rng)
    for gamma in ([0.9, 1.5], np.array([0.9, 1.5])):
        with pytest.raises(ValueError, match=r"gamma must be decays in \(0, 1\]"):
            arrayattn.retention(q, k, v, gamma=gamma)
    good = np.array([0.9, 0.8])
    np.testing.assert_array_equal(arrayattn.retention(q, k, v, gamma=good),
                                  arrayattn.retention(q, k, v, gamma=[0.9, 0.8]))


def test_ring_attention_takes_true_or_false_only(rng):
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh

    from arrayattn.distributed import ring_attention
    mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
    q, k, v = (jax.numpy.asarray(x) for x in make_qkv(rng, batch=(1,), n=4, d=4))
    for flag in ("yes", 1, None):
        with pytest.raises((TypeError, ValueError), match="causal"):
            ring_attention(q, k, v, mesh=mesh, axis_name="seq", causal=flag)
