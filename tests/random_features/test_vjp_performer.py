"""The backward of the random-feature family: Performer (``performer_positive``,
``performer_hyperbolic``, ``performer_trig``, ``performer_favorpp``, ``performer_relu``)
and RFA (``rfa``, plain and gated).

Oracles: torch autograd and ``jax.vjp`` through the forward *reference form* (float64,
relative error <= 1e-10, the issue's bar) -- autodiff differentiates through the
stabilisers' maxima, which the backward holds constant, so agreement also checks that
their total derivative is zero -- central finite differences (NumPy), and the NumPy
result for the other backends and under ``jax.jit``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import arrayattn
from arrayattn.random_features.performer import performer_attention
from arrayattn.random_features.rfa import rfa_attention

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, make_qkv

torch = pytest.importorskip("torch")

RTOL = 1e-10
KINDS = ["positive", "hyperbolic", "trig", "favor++", "relu"]
NAMES = ["performer_positive", "performer_hyperbolic", "performer_trig",
         "performer_favorpp", "performer_relu", "rfa"]


def test_every_variant_of_the_family_is_covered():
    mine = {r.name for r in arrayattn.variants() if r.fn in (performer_attention,
                                                              rfa_attention)}
    assert mine == set(NAMES)
    assert all(arrayattn.backward.has_backward(name) for name in NAMES)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if b.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _garbage(km, k, v, batch, s):
    """Masked keys and values hold NaN / inf: they must never be read."""
    full = np.broadcast_to(km, (*batch, s))
    k, v = k.copy(), v.copy()
    k[~full] = np.nan
    v[~full] = np.inf
    return k, v


def _torch_grads(fn, q, k, v, do, opts, diff=()):
    """Autograd of ``fn`` (a public function, reference engine) through torch; ``diff``
    names array options that are differentiated too."""
    t = {name: torch.tensor(x, requires_grad=True) for name, x in
         (("q", q), ("k", k), ("v", v), *((d, opts[d]) for d in diff))}
    topts = {key: (t[key] if key in t else torch.tensor(val) if isinstance(val, np.ndarray)
                   else val) for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = fn(t["q"], t["k"], t["v"], **topts)
    out.backward(torch.tensor(do))
    return {name: x.grad.numpy() for name, x in t.items()}


def _check(grads, expected, rtol=RTOL):
    assert sorted(grads) == sorted(expected)
    for key, g in expected.items():
        assert grads[key].shape == g.shape and grads[key].dtype == g.dtype, key
        assert np.all(np.isfinite(grads[key])), key
        assert _rel(grads[key], g) <= rtol, (key, _rel(grads[key], g))


# --- Performer ------------------------------------------------------------------------

def _performer_case(kind, causal, masked, rng, *, batch=(2, 3), n=20, s=24, d=32, dv=6,
                    norm=8.0, sharp=True, m=64):
    """Sharp inputs (norm 8 at d = 32: the stabilisers matter), NaN / inf padding."""
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=dv, norm=norm, sharp=sharp)
    opts = {"kind": kind, "num_features": m, "causal": causal, "seed": 3}
    if kind == "favor++" and causal:
        opts["gerf_a"] = -0.05          # A* depends on every key: causal needs a fixed A
    if kind == "trig":
        opts["scale"] = 0.05            # trig features grow like exp(|x~|^2 / 2)
    if masked:
        km = rng.random((batch[0], *[1] * (len(batch) - 1), s)) > 0.3
        km[..., -1] = True              # the last key real: every causal row sees one
        opts["key_mask"] = km
        k, v = _garbage(km, k, v, batch, s)
    do = rng.standard_normal((*batch, n, dv))
    return q, k, v, do, opts


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "key_mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kind", KINDS)
def test_performer_vjp_equals_torch_autograd(kind, causal, masked, rng):
    q, k, v, do, opts = _performer_case(kind, causal, masked, rng)
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    _check(grads, _torch_grads(performer_attention, q, k, v, do, opts))
    if masked:
        full = np.broadcast_to(opts["key_mask"], k.shape[:-1])
        assert np.all(grads["k"][~full] == 0) and np.all(grads["v"][~full] == 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, s", [(9, 17), (17, 9)])
def test_performer_vjp_causal_end_aligned(kind, n, s, rng):
    q, k, v, do, opts = _performer_case(kind, True, True, rng, n=n, s=s, d=8, norm=3.0,
                                        sharp=False)
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    _check(grads, _torch_grads(performer_attention, q, k, v, do, opts))


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trig", "favor++"])
def test_performer_vjp_negative_scale(kind, rng):
    q, k, v, do, opts = _performer_case(kind, kind == "positive", True, rng, d=8,
                                        norm=3.0, sharp=False)
    opts["scale"] = -0.2
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    _check(grads, _torch_grads(performer_attention, q, k, v, do, opts))


@pytest.mark.parametrize("causal", [False, True])
def test_favorpp_gerf_a_array_gets_a_cotangent(causal, rng):
    q, k, v, do, opts = _performer_case("favor++", causal, True, rng, d=8, norm=3.0)
    opts["gerf_a"] = rng.uniform(-0.2, 0.0, (2, 1, 1, 1))       # one A per batch element
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    expected = _torch_grads(performer_attention, q, k, v, do, opts, diff=("gerf_a",))
    _check(grads, expected)


def test_favorpp_data_dependent_a_is_differentiated(rng):
    """A* = A*(q, k) does not cancel: the gradient differs from that at the same A
    held fixed, by far more than rounding (and equals autograd through A*)."""
    q, k, v, do, opts = _performer_case("favor++", False, True, rng, d=8, norm=3.0)
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    kz = np.where(opts["key_mask"][..., None], k, 0.0)
    a = arrayattn.gerf_parameter(q, kz, key_mask=opts["key_mask"])
    fixed = arrayattn.vjp(performer_attention, q, k, v, do, **{**opts, "gerf_a": a})
    assert _rel(fixed["v"], grads["v"]) <= 1e-13          # v does not enter A*
    assert _rel(fixed["q"], grads["q"]) > 1e-6
    assert "gerf_a" in fixed and fixed["gerf_a"].shape == a.shape


def test_performer_vjp_callable_kind_by_central_difference(rng):
    """A caller's f(t) is differentiated by a central difference: error ~eps^(2/3)
    (3.7e-11) per slope, times the conditioning of the ratio (measured 6e-12)."""
    q, k, v, do, opts = _performer_case("relu", True, True, rng, d=8, norm=3.0)
    opts["kind"] = lambda t: t * t + 0.5
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    _check(grads, _torch_grads(performer_attention, q, k, v, do, opts), rtol=1e-9)


def test_performer_vjp_uniform_call_replays_omega(rng):
    q, k, v, do, _ = _performer_case("positive", False, False, rng, d=8, norm=3.0)
    omega = rng.standard_normal((16, 8))
    grads = arrayattn.vjp("performer_hyperbolic", q, k, v, do, omega=omega)
    ref = arrayattn.vjp(performer_attention, q, k, v, do, kind="hyperbolic",
                        features=omega)
    assert sorted(grads) == ["k", "q", "v"]                # omega: a constant
    for key in grads:
        np.testing.assert_array_equal(grads[key], ref[key])
    expected = _torch_grads(performer_attention, q, k, v, do,
                            {"kind": "hyperbolic", "features": omega})
    _check(grads, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True])
def test_performer_vjp_central_differences(kind, causal, rng):
    q, k, v, do, opts = _performer_case(kind, causal, True, rng, batch=(2,), n=7, s=9,
                                        d=4, dv=3, norm=2.0, sharp=False, m=8)
    if kind == "relu":      # keep every exponent away from the kink at 0
        opts["projection"] = "iid"
    grads = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    km = opts["key_mask"]
    args = {"q": q, "k": k, "v": v}
    h = 1e-6

    def loss(**kw):
        a = {**args, **kw}
        return float(np.sum(performer_attention(a["q"], a["k"], a["v"], **opts) * do))

    for key, x in args.items():
        for _ in range(6):
            idx = tuple(int(rng.integers(0, size)) for size in x.shape)
            if key in ("k", "v") and not np.broadcast_to(km, x.shape[:-1])[idx[:-1]]:
                assert grads[key][idx] == 0.0
                continue
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
            # O(h^2) truncation plus eps |loss| / h rounding
            assert abs(grads[key][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (key, idx, fd)


@pytest.mark.parametrize("kind", KINDS)
def test_performer_vjp_equals_jax_vjp(kind, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v, do, opts = _performer_case(kind, kind != "favor++", True, rng, d=8, norm=3.0,
                                        sharp=False, batch=(2,))
    fixed = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val)
             for key, val in opts.items()}

    def f(a, b, c):
        with arrayattn.use_engine("reference"):
            return performer_attention(a, b, c, **fixed)

    _, pull = jax.vjp(f, *map(jnp.asarray, (q, k, v)))
    expected = {key: np.asarray(g) for key, g in zip("qkv", pull(jnp.asarray(do)))}
    _check(arrayattn.vjp(performer_attention, q, k, v, do, **opts), expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend_name", ["strict", "strict_device1", "torch", "jax"])
def test_performer_vjp_on_every_backend(kind, backend_name, rng):
    backend = get_backend(backend_name)
    q, k, v, do, opts = _performer_case(kind, kind != "favor++", True, rng, d=8, norm=3.0,
                                        batch=(2,))
    assert_grads_on_backend(
        backend, lambda *a, **o: arrayattn.vjp(performer_attention, *a, **o), q, k, v, do,
        opts)


@pytest.mark.parametrize("kind", KINDS)
def test_performer_vjp_traces_under_jax_jit(kind, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    causal = kind != "favor++"
    q, k, v, do, opts = _performer_case(kind, causal, True, rng, d=8, norm=3.0, batch=(2,))
    expected = arrayattn.vjp(performer_attention, q, k, v, do, **opts)
    static = {key: val for key, val in opts.items() if key != "key_mask"}
    grads = jax.jit(lambda q, k, v, do, km: arrayattn.vjp(
        performer_attention, q, k, v, do, key_mask=km, **static))(
        *map(jax.numpy.asarray, (q, k, v, do, opts["key_mask"])))
    for key, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), expected[key], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(expected[key])))


@pytest.mark.parametrize("name", NAMES)
def test_vjp_grouped_heads_sum_over_each_group(name, rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=10, s=10, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=10, s=10, d=6)
    do = rng.standard_normal((2, 4, 10, 6))
    km = rng.random((2, 1, 10)) > 0.2
    opts = {"num_features": 16, "key_mask": km, "causal": name != "performer_favorpp"}
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    rep = {"k": np.repeat(k, 2, axis=1), "v": np.repeat(v, 2, axis=1)}
    full = arrayattn.vjp(name, q, rep["k"], rep["v"], do, **opts)
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-12, atol=1e-13)
    for key in ("k", "v"):
        assert grads[key].shape == (2, 2, 10, 6)
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 10, 6).sum(2),
                                   rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_vjp_float32_is_cast_back(name, rng):
    q, k, v = make_qkv(rng, batch=(2,), n=12, s=16, d=8, norm=3.0)
    do = rng.standard_normal((2, 12, 8))
    km = rng.random((2, 16)) > 0.3
    opts = {"num_features": 32, "key_mask": km}
    grads = arrayattn.vjp(name, *(x.astype(np.float32) for x in (q, k, v, do)), **opts)
    expected = arrayattn.vjp(name, q, k, v, do, **opts)
    for key, g in grads.items():
        assert g.dtype == np.float32
        # float32 rounding through O(s m) sums of positive terms: a few hundred eps
        assert _rel(g, expected[key]) <= 1e3 * np.finfo(np.float32).eps, key


def test_performer_vjp_no_keys_and_errors(rng):
    q, k, v = make_qkv(rng, batch=(1,), n=5, s=4, d=4)
    do = rng.standard_normal((1, 5, 4))
    g0 = arrayattn.vjp(performer_attention, q, k[:, :0], v[:, :0], do)
    assert g0["q"].shape == q.shape and not g0["q"].any() and g0["k"].shape == (1, 0, 4)
    g0 = arrayattn.vjp(performer_attention, q, k[:, :0], v[:, :0], do, kind="favor++")
    assert not g0["q"].any() and g0["v"].shape == (1, 0, 4)
    g0 = arrayattn.vjp(rfa_attention, q, k[:, :0], v[:, :0], do, causal=True)
    assert not g0["q"].any() and g0["k"].shape == (1, 0, 4)
    with pytest.raises(ValueError, match="gerf_a"):
        arrayattn.vjp(performer_attention, q, k, v, do[:, :, :4], kind="favor++",
                      causal=True)
    with pytest.raises(ValueError, match="gerf_a is only used"):
        arrayattn.vjp(performer_attention, q, k, v, do, gerf_a=-0.1)
    with pytest.raises(ValueError, match="kind"):
        arrayattn.vjp(performer_attention, q, k, v, do, kind="softmax")


# --- RFA -------------------------------------------------------------------------------

def _rfa_case(rng, *, gate=None, masked=True, batch=(2, 3), n=23, s=None, d=8, dv=5,
              norm=3.0, m=16):
    s = n if s is None else s
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=dv, norm=norm)
    opts = {"num_features": m, "sigma": 1.3, "seed": 1}
    if gate is not None:
        opts.update(causal=True, gate=gate)
    if masked:
        km = rng.random((batch[0], *[1] * (len(batch) - 1), s)) > 0.3
        km[..., 0] = True
        opts["key_mask"] = km
        k, v = _garbage(km, k, v, batch, s)
    do = rng.standard_normal((*batch, n, dv))
    return q, k, v, do, opts


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "key_mask"])
@pytest.mark.parametrize("causal, n, s", [(False, 13, 17), (True, 17, 17), (True, 9, 17),
                                          (True, 17, 9)])
@pytest.mark.parametrize("method", [None, "recurrent"])
def test_rfa_vjp_equals_torch_autograd(causal, n, s, masked, method, rng):
    q, k, v, do, opts = _rfa_case(rng, masked=masked, n=n, s=s)
    opts.update(causal=causal, method=method if causal else None, chunk_size=4)
    grads = arrayattn.vjp(rfa_attention, q, k, v, do, **opts)
    _check(grads, _torch_grads(rfa_attention, q, k, v, do, opts))


def _gates(rng, case, batch=(2, 3), n=23):
    if case == "per_token":
        return rng.uniform(0.5, 1.0, (*batch, n))
    if case == "ends":      # restarts (g = 0) and skips (g = 1)
        g = rng.uniform(0.5, 1.0, (*batch, n))
        g[..., 5], g[..., 11], g[..., 17] = 0.0, 1.0, 0.0
        return g
    if case == "per_head":  # (..., 1): one gate per head, broadcast over the batch
        return rng.uniform(0.5, 1.0, (3, 1))
    return rng.uniform(0.05, 0.3, (*batch, n))           # "fast": strong decay


@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "key_mask"])
@pytest.mark.parametrize("case", ["per_token", "ends", "per_head", "fast"])
@pytest.mark.parametrize("method, chunk_size", [("recurrent", 64), ("chunked", 4),
                                                ("chunked", 64)])
def test_gated_rfa_vjp_equals_torch_autograd(case, masked, method, chunk_size, rng):
    """The gate's cotangent too.  At g = 0 the chunked forward clamps log g, so its
    autodiff misses the term <U_t, S_(t-1)>; the backward is the exact one-sided
    derivative, which autodiff of the recurrent form gives: compare there."""
    if case == "ends" and method == "chunked":
        pytest.skip("the chunked form's autodiff is not the derivative at g = 0")
    q, k, v, do, opts = _rfa_case(rng, gate=_gates(rng, case), masked=masked)
    opts.update(method=method, chunk_size=chunk_size)
    grads = arrayattn.vjp(rfa_attention, q, k, v, do, **opts)
    _check(grads, _torch_grads(rfa_attention, q, k, v, do, opts, diff=("gate",)))
    assert grads["gate"].shape == opts["gate"].shape
    if masked:      # a masked token is skipped: its gate gets nothing
        full = np.broadcast_to(opts["key_mask"], (2, 3, 23))
        if case != "per_head":
            assert np.all(grads["gate"][~full] == 0)


def test_gated_rfa_vjp_chunk_sizes_agree_and_float_gate(rng):
    q, k, v, do, opts = _rfa_case(rng, gate=_gates(rng, "ends"))
    ref = arrayattn.vjp(rfa_attention, q, k, v, do, **opts, chunk_size=64)
    for c in (1, 5, 23):
        got = arrayattn.vjp(rfa_attention, q, k, v, do, **opts, chunk_size=c)
        for key in ref:
            assert _rel(got[key], ref[key]) <= 1e-12, (c, key)
    opts["gate"] = 0.8                                   # a float: no cotangent
    grads = arrayattn.vjp(rfa_attention, q, k, v, do, **opts)
    assert sorted(grads) == ["k", "q", "v"]
    expected = _torch_grads(rfa_attention, q, k, v, do, opts)
    _check(grads, expected)


@pytest.mark.parametrize("gated", [False, True])
def test_rfa_vjp_central_differences(gated, rng):
    q, k, v, do, opts = _rfa_case(rng, gate=_gates(rng, "per_token", (2,), 9) if gated
                                  else None, batch=(2,), n=9, d=4, dv=3, m=8)
    opts["causal"] = True
    grads = arrayattn.vjp(rfa_attention, q, k, v, do, **opts)
    args = {"q": q, "k": k, "v": v, **({"gate": opts["gate"]} if gated else {})}
    km = opts["key_mask"]
    h = 1e-6

    def loss(**kw):
        a = {**opts, **args, **kw}
        return float(np.sum(rfa_attention(a.pop("q"), a.pop("k"), a.pop("v"), **a) * do))

    for key, x in args.items():
        for _ in range(6):
            idx = tuple(int(rng.integers(0, size)) for size in x.shape)
            tok = idx if key == "gate" else idx[:-1]
            if key != "q" and not np.broadcast_to(km, (2, 9))[tok]:
                assert grads[key][idx] == 0.0
                continue
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
            assert abs(grads[key][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (key, idx, fd)


@pytest.mark.parametrize("gated", [False, True])
def test_rfa_vjp_equals_jax_vjp(gated, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v, do, opts = _rfa_case(rng, gate=_gates(rng, "per_token") if gated else None)
    opts.setdefault("causal", True)
    diff = [q, k, v] + ([opts["gate"]] if gated else [])
    fixed = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val)
             for key, val in opts.items() if key != "gate"}

    def f(*a):
        with arrayattn.use_engine("reference"):
            return rfa_attention(*a[:3], **fixed, **({"gate": a[3]} if gated else {}))

    _, pull = jax.vjp(f, *map(jnp.asarray, diff))
    expected = {key: np.asarray(g) for key, g in zip(["q", "k", "v", "gate"],
                                                     pull(jnp.asarray(do)))}
    _check(arrayattn.vjp(rfa_attention, q, k, v, do, **opts), expected)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("backend_name", ["strict", "strict_device1", "torch", "jax"])
def test_rfa_vjp_on_every_backend(gated, backend_name, rng):
    backend = get_backend(backend_name)
    q, k, v, do, opts = _rfa_case(rng, gate=_gates(rng, "ends", (2, 2)) if gated else None,
                                  batch=(2, 2))
    opts.update(causal=True, chunk_size=5)
    assert_grads_on_backend(backend, lambda *a, **o: arrayattn.vjp(rfa_attention, *a, **o),
                            q, k, v, do, opts)


@pytest.mark.parametrize("gated", [False, True])
def test_rfa_vjp_traces_under_jax_jit(gated, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, do, opts = _rfa_case(rng, gate=_gates(rng, "ends") if gated else None)
    opts.update(causal=True, chunk_size=5)
    expected = arrayattn.vjp(rfa_attention, q, k, v, do, **opts)
    arrays = {key: val for key, val in opts.items() if isinstance(val, np.ndarray)}
    static = {key: val for key, val in opts.items() if key not in arrays}
    grads = jax.jit(lambda q, k, v, do, arrays: arrayattn.vjp(
        rfa_attention, q, k, v, do, **arrays, **static))(
        *map(jax.numpy.asarray, (q, k, v, do)),
        {key: jax.numpy.asarray(val) for key, val in arrays.items()})
    assert sorted(grads) == sorted(expected)
    for key, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), expected[key], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(expected[key])))


def test_rfa_vjp_rejects_what_the_forward_rejects(rng):
    q, k, v, do, opts = _rfa_case(rng, masked=False, n=6)
    with pytest.raises(ValueError, match="causal=True"):
        arrayattn.vjp(rfa_attention, q, k, v, do, gate=np.full((2, 3, 6), 0.5))
    with pytest.raises(ValueError, match="sigma"):
        arrayattn.vjp(rfa_attention, q, k, v, do, sigma=0.0)
    with pytest.raises(ValueError, match="method"):
        arrayattn.vjp(rfa_attention, q, k, v, do, causal=True, gate=0.5, method="cumsum")


@pytest.mark.parametrize("gate_heads", [4, 2, 1])
def test_gated_rfa_vjp_grouped_heads(gate_heads, rng):
    """Grouped-query heads with a gate per query head, per key head or shared: equal to
    repeating k, v (and the gate) over each group; the gate's cotangent summed likewise."""
    q, _, _ = make_qkv(rng, batch=(2, 4), n=10, s=10, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=10, s=10, d=6)
    do = rng.standard_normal((2, 4, 10, 6))
    g = rng.uniform(0.5, 1.0, (2, gate_heads, 10))
    g_full = np.repeat(g, 2, axis=1) if gate_heads == 2 else g
    opts = {"num_features": 16, "causal": True, "chunk_size": 4}
    grads = arrayattn.vjp("rfa", q, k, v, do, gate=g, **opts)
    rep = {"k": np.repeat(k, 2, axis=1), "v": np.repeat(v, 2, axis=1)}
    full = arrayattn.vjp("rfa", q, rep["k"], rep["v"], do, gate=g_full, **opts)
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-12, atol=1e-13)
    for key in ("k", "v"):
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 10, 6).sum(2),
                                   rtol=1e-11, atol=1e-12)
    expected = full["gate"].reshape(2, 2, 2, 10).sum(2) if gate_heads == 2 else full["gate"]
    assert grads["gate"].shape == g.shape
    np.testing.assert_allclose(grads["gate"], expected, rtol=1e-11, atol=1e-12)
