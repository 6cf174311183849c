"""What the registry's uniform calls draw (``Variant.draws``) and :class:`jit_uniform`.

The gated records' uniform calls draw their gates from ``seed`` on the host.  Handed back
as options they make the same call, and :class:`arrayattn.jit_uniform` hands them to a
``jax.jit`` as arguments: drawn inside the traced call they would be constants of the
program, whose size (and compile time) grows with n (#26).
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import jit_uniform
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import make_qkv

DRAWING = [r for r in arrayattn.variants() if r.draws is not None]
IDS = [r.name for r in DRAWING]


def test_the_gated_draws_are_the_ones_of_sequence_size():
    """Exactly the records that draw per-token inputs say so: the four gated records
    whose uniform call has no gates of its own (retention's decays are per head)."""
    assert {r.name for r in DRAWING} == {"gla", "ssd", "deltanet", "gated_deltanet"}
    assert all(r.random and r.family == "gated" for r in DRAWING)


@pytest.mark.parametrize("rec", DRAWING, ids=IDS)
def test_draws_handed_back_are_the_same_call(rec, backend, rng):
    """``rec(q, k, v, **rec.draws(q, seed))`` is ``rec(q, k, v, seed=seed)`` bit for bit,
    and the draws have the sequence's shape, the dtype and library of ``q``."""
    q, k, v = (backend.asarray(x) for x in make_qkv(rng, batch=(1, 2), n=24, d=8))
    drawn = rec.draws(q, 3)
    assert list(drawn) == list(rec.draws.names)
    for name, x in drawn.items():
        assert x.dtype == q.dtype and tuple(x.shape) in (tuple(q.shape), tuple(q.shape[:-1])), name
        assert type(x) is type(q), name
    xp_assert_equal(rec(q, k, v, **drawn), rec(q, k, v, seed=3))


def test_a_given_gate_wins_and_the_rest_is_drawn(rng):
    """gated DeltaNet draws ``beta`` and ``g`` together: giving ``beta`` alone keeps the
    caller's ``beta`` and the drawn ``g``."""
    rec = arrayattn.get_variant("gated_deltanet")
    q, k, v = make_qkv(rng, batch=(1, 2), n=24, d=8)
    beta = np.full(q.shape[:-1], 0.25)
    g = rec.draws(q, 0)["g"]
    want = arrayattn.gated_delta_attention(q, k, v, beta, g, normalize_qk=True)
    np.testing.assert_array_equal(rec(q, k, v, beta=beta), want)


@pytest.mark.parametrize("name", ["gla", "softmax", "performer_positive"])
def test_jit_uniform_eager_is_the_uniform_call(name, rng):
    """With an identity "jit", :class:`jit_uniform` is the uniform call with its options
    (the records that draw nothing get no extra options)."""
    rec = arrayattn.get_variant(name)
    q, k, v = make_qkv(rng, batch=(1, 2), n=24, d=8)
    opts = {"causal": True} if rec.causal else {}
    np.testing.assert_array_equal(jit_uniform(rec, lambda f: f, **opts)(q, k, v),
                                  rec(q, k, v, **opts))


@pytest.mark.parametrize("rec", DRAWING, ids=IDS)
def test_jit_uniform_under_jax_jit(rec, rng):
    """Under ``jax.jit`` (float64) it equals the eager uniform call to rounding, and the
    program carries no constant of the sequence's size: its text is the same at two
    lengths, where the plain ``jax.jit`` of the uniform call grows by the gates' bytes."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v = (jnp.asarray(x) for x in make_qkv(rng, batch=(1, 2), n=40, d=8))
    eps = float(np.finfo(np.float64).eps)
    xp_assert_close(jit_uniform(rec)(q, k, v), rec(q, k, v), rtol=1e3 * eps, atol=1e3 * eps)

    def text(call, n):
        x = jnp.zeros((1, 2, n, 16), jnp.float32)
        return len(call.lower(x, x, x).as_text())

    # A constant of one float32 per token and head adds >= 4 bytes each to the text
    # (hex: 8 characters); shape-dependent branches add a few hundred characters.
    threshold = 4 * 2 * (4096 - 512)
    plain = jax.jit(lambda q, k, v: rec(q, k, v))
    assert text(plain, 4096) - text(plain, 512) > threshold, (
        "the sizes are too small to see a constant of the gates")
    sizes = [text(jit_uniform(rec), n) for n in (512, 4096)]
    assert sizes[1] - sizes[0] < threshold, (
        f"jit_uniform's program grows with n ({sizes}): a drawn input is a constant")


@pytest.mark.parametrize("rec", DRAWING, ids=IDS)
def test_vjp_with_the_draws_handed_back(rec, rng):
    """``arrayattn.vjp`` of the registry call with its draws handed back gives the same
    ``q, k, v`` cotangents as with them drawn, and the draws' own cotangents: all equal
    to the vjp of the public function called with them (so a jitted training step that
    passes them as arguments is differentiated as the public function is)."""
    q, k, v, do = (*make_qkv(rng, batch=(1, 2), n=24, d=8), rng.standard_normal((1, 2, 24, 8)))
    drawn = rec.draws(q, 0)
    given = arrayattn.vjp(rec.name, q, k, v, do, **drawn)
    inside = arrayattn.vjp(rec.name, q, k, v, do)
    public = arrayattn.vjp(rec.fn, q, k, v, do, **drawn,
                           **{x: y for x, y in rec.defaults.items() if x != "seed"})
    assert set(given) == {"q", "k", "v", *drawn} and set(inside) == {"q", "k", "v"}
    for name in ("q", "k", "v"):
        np.testing.assert_array_equal(given[name], inside[name], err_msg=name)
    for name in given:
        np.testing.assert_array_equal(given[name], public[name], err_msg=name)
