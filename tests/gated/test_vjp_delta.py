"""The backward of the delta rule: DeltaNet (``delta_attention``, ``deltanet``) and gated
DeltaNet (``gated_delta_attention``, ``gated_deltanet``).

Oracles: torch autograd through the forward *reference forms* (float64, relative error <=
1e-10, the issue's bar) for every differentiable argument (``q, k, v, beta, g,
initial_state``), central finite differences (NumPy), the recurrent backward for the
chunked one, and the NumPy result for the other backends and under ``jax.jit``.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn import delta_attention, gated_delta_attention

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, make_qkv

RTOL = 1e-10
METHODS = ["chunked", "recurrent"]


def test_every_variant_of_the_family_is_covered():
    mine = {r.name for r in arrayattn.variants()
            if r.fn in (delta_attention, gated_delta_attention)}
    assert mine == {"deltanet", "gated_deltanet"}
    assert all(arrayattn.backward.has_backward(name) for name in mine)
    assert all(arrayattn.backward.has_backward(fn)
               for fn in (delta_attention, gated_delta_attention))


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _case(rng, *, gated=True, normalize_qk=True, batch=(2, 3), n=21, d=6, dv=5,
          state=True, scale=None, key_mask=False):
    """``(args, options, do)``: ``args`` the differentiable arrays by keyword name.
    Realistic norms (8) with normalize_qk; without it the keys keep norm 8 and ``beta``
    is small enough (``beta ||k||^2 <= 1``) for the update to stay a contraction."""
    q, k, v = make_qkv(rng, batch=batch, n=n, d=d, dv=dv, norm=8.0, sharp=True)
    beta = rng.random((*batch, n)) * (1.0 if normalize_qk else 1.0 / 64)
    args = {"q": q, "k": k, "v": v, "beta": beta}
    if gated:
        args["g"] = np.log(rng.uniform(0.6, 1.0, (*batch, n)))
    if state:
        args["initial_state"] = rng.standard_normal((*batch, d, dv))
    opts = {"normalize_qk": normalize_qk}
    if scale is not None:
        opts["scale"] = scale
    if key_mask:
        shared = (batch[0], *[1] * (len(batch) - 1))     # shared over heads
        opts["key_mask"] = rng.random((*shared, n)) > 0.3
    return args, opts, rng.standard_normal((*batch, n, dv))


def _forward(args, opts, *, method="chunked", chunk_size=16):
    """The public forward on ``args`` (any namespace)."""
    fn = gated_delta_attention if "g" in args else delta_attention
    gates = (args["beta"], args["g"]) if "g" in args else (args["beta"],)
    opts = {"method": method, "chunk_size": chunk_size, **opts}
    return fn(args["q"], args["k"], args["v"], *gates,
              initial_state=args.get("initial_state"), **opts)


def _vjp(args, do, opts, **kw):
    fn = gated_delta_attention if "g" in args else delta_attention
    rest = {name: x for name, x in args.items() if name not in "qkv"}
    return arrayattn.vjp(fn, args["q"], args["k"], args["v"], do, **rest, **opts, **kw)


def _torch_grads(args, do, opts, **kw):
    torch = pytest.importorskip("torch")
    t = {name: torch.tensor(x, requires_grad=True) for name, x in args.items()}
    topts = {key: torch.tensor(val) if hasattr(val, "shape") else val
             for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = _forward(t, topts, **kw)
    out.backward(torch.tensor(do))
    return {name: x.grad.numpy() for name, x in t.items()}


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "delta"])
@pytest.mark.parametrize("normalize_qk", [True, False], ids=["l2", "raw"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("chunk_size", [4, 16, 64])
def test_vjp_equals_torch_autograd(gated, normalize_qk, method, chunk_size, rng):
    args, opts, do = _case(rng, gated=gated, normalize_qk=normalize_qk, scale=0.7)
    grads = _vjp(args, do, opts, method=method, chunk_size=chunk_size)
    expected = _torch_grads(args, do, opts, method=method, chunk_size=chunk_size)
    assert sorted(grads) == sorted(args)
    for name, x in args.items():
        assert grads[name].shape == x.shape and grads[name].dtype == np.float64
        assert _rel(grads[name], expected[name]) <= RTOL, name


@pytest.mark.parametrize("method", METHODS)
def test_vjp_broadcast_arguments_are_summed(method, rng):
    """``beta``/``g`` shared over heads, one initial state for the batch, ``k``/``v``
    broadcast over the batch: each cotangent summed to its argument's shape."""
    args, opts, do = _case(rng, batch=(2, 3), n=11)
    args["beta"] = args["beta"][:, :1]                   # (2, 1, n)
    args["g"] = args["g"][0, 0]                          # (n,)
    args["initial_state"] = args["initial_state"][0, 0]  # (dk, dv)
    args["k"], args["v"] = args["k"][:1], args["v"][:1]   # (1, 3, n, .)
    grads = _vjp(args, do, opts, method=method, chunk_size=4)
    expected = _torch_grads(args, do, opts, method=method, chunk_size=4)
    for name, x in args.items():
        assert grads[name].shape == x.shape
        assert _rel(grads[name], expected[name]) <= RTOL, name


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "delta"])
def test_chunked_backward_equals_recurrent(gated, rng):
    args, opts, do = _case(rng, gated=gated, n=45, key_mask=True)
    rec = _vjp(args, do, opts, method="recurrent", chunk_size=7)
    for c in (1, 5, 16, 64):
        got = _vjp(args, do, opts, chunk_size=c)
        for name in args:
            # two float64 evaluations of the same sums (measured: <= 8e-16)
            assert _rel(got[name], rec[name]) <= 1e-13, (c, name)


@pytest.mark.parametrize("method", METHODS)
def test_masked_tokens_never_leak_into_gradients(method, rng):
    args, opts, do = _case(rng, n=19, key_mask=True)
    km = np.broadcast_to(opts["key_mask"], args["beta"].shape)
    clean = _vjp(args, do, opts, method=method, chunk_size=4)
    dirty = {name: x.copy() for name, x in args.items()}
    dirty["k"][~km] = np.nan
    dirty["v"][~km] = np.inf
    dirty["beta"][~km] = np.nan
    dirty["g"][~km] = np.inf
    got = _vjp(dirty, do, opts, method=method, chunk_size=4)
    for name in args:
        np.testing.assert_allclose(got[name], clean[name], rtol=1e-13, atol=1e-14)
    for name in ("k", "v"):
        assert np.all(got[name][~km] == 0)
    for name in ("beta", "g"):
        assert np.all(got[name][~km] == 0)
    assert np.any(got["q"][~km] != 0)            # a padded token still reads the state
    # and the masked forward agrees with torch on clean inputs
    expected = _torch_grads(args, do, opts, method=method, chunk_size=4)
    for name in args:
        assert _rel(clean[name], expected[name]) <= RTOL, name


@pytest.mark.parametrize("method", METHODS)
def test_gate_of_zero_is_an_exact_restart(method, rng):
    args, opts, do = _case(rng, n=17)
    args["g"][0, 1, 6] = -np.inf
    args["g"][1, 2, 0] = -np.inf
    grads = _vjp(args, do, opts, method=method, chunk_size=4)
    assert all(np.isfinite(x).all() for x in grads.values())
    assert grads["g"][0, 1, 6] == 0 and grads["g"][1, 2, 0] == 0
    assert np.all(grads["initial_state"][1, 2] == 0)     # restarted at the first token
    expected = _torch_grads(args, do, opts, method=method, chunk_size=4)
    for name in args:
        assert _rel(grads[name], expected[name]) <= RTOL, name


@pytest.mark.parametrize("name", ["gated_deltanet", "deltanet"])
def test_grouped_heads_sum_over_each_group(name, rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=13, d=6, norm=8.0)
    _, k, v = make_qkv(rng, batch=(2, 2), n=13, d=6, norm=8.0)
    do = rng.standard_normal((2, 4, 13, 6))
    grads = arrayattn.vjp(name, q, k, v, do, chunk_size=4)
    rep = {"k": np.repeat(k, 2, axis=1), "v": np.repeat(v, 2, axis=1)}
    full = arrayattn.vjp(name, q, rep["k"], rep["v"], do, chunk_size=4)
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-13, atol=1e-13)
    for key in ("k", "v"):
        assert grads[key].shape == (2, 2, 13, 6)
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 13, 6).sum(2),
                                   rtol=1e-12, atol=1e-13)


def test_uniform_call_equals_public_function_with_the_drawn_gates(rng):
    q, k, v = make_qkv(rng, batch=(2, 3), n=10, d=4, norm=8.0)
    do = rng.standard_normal((2, 3, 10, 4))
    r = np.random.default_rng(5)
    beta = 1.0 / (1.0 + np.exp(-r.standard_normal((2, 3, 10))))
    g = -np.logaddexp(0.0, -(r.standard_normal((2, 3, 10)) + 3.0))
    got = arrayattn.vjp("gated_deltanet", q, k, v, do, seed=5)
    want = arrayattn.vjp(gated_delta_attention, q, k, v, do, beta=beta, g=g,
                         normalize_qk=True)
    assert sorted(got) == ["k", "q", "v"]
    for name in got:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-14, atol=0)
    beta = 1.0 / (1.0 + np.exp(-np.random.default_rng(5).standard_normal((2, 3, 10))))
    got = arrayattn.vjp("deltanet", q, k, v, do, seed=5)
    want = arrayattn.vjp(delta_attention, q, k, v, do, beta=beta, normalize_qk=True)
    for name in got:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-14, atol=0)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "delta"])
def test_central_differences(gated, rng):
    args, opts, do = _case(rng, gated=gated, batch=(2,), n=9, d=4, dv=3, key_mask=False)
    grads = _vjp(args, do, opts, chunk_size=4)
    h = 1e-6

    def loss(name, x):
        return float(np.sum(_forward({**args, name: x}, opts, chunk_size=4) * do))

    for name, x in args.items():
        for idx in [tuple(rng.integers(0, m) for m in x.shape) for _ in range(5)]:
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(name, plus) - loss(name, minus)) / (2 * h)
            # central differences: O(h^2) truncation plus eps * |loss| / h rounding
            assert abs(grads[name][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (name, idx)


def test_float32_is_cast_back(rng):
    args, opts, do = _case(rng, n=33)
    ref = _vjp(args, do, opts)
    f32 = {name: x.astype(np.float32) for name, x in args.items()}
    got = _vjp(f32, do.astype(np.float32), opts)
    for name in args:
        assert got[name].dtype == np.float32
        # float32 rounding accumulated as a random walk over the n = 33 steps of the
        # recurrence (sqrt(n)), 8x margin as arrayattn.testing (measured: ~2 eps)
        assert _rel(got[name], ref[name]) <= 8 * np.sqrt(33) * np.finfo(np.float32).eps, name


def test_empty_sequence_and_single_token(rng):
    args, opts, do = _case(rng, n=0)
    grads = _vjp(args, do, opts)
    assert all(grads[name].shape == x.shape for name, x in args.items())
    assert not grads["initial_state"].any()
    args, opts, do = _case(rng, n=1)
    for method in METHODS:
        grads = _vjp(args, do, opts, method=method)
        expected = _torch_grads(args, do, opts, method=method)
        for name in args:
            assert _rel(grads[name], expected[name]) <= RTOL, name


def test_errors_as_the_forward(rng):
    args, opts, do = _case(rng, n=6)
    bad = [({"causal": False}, ValueError), ({"method": "dense"}, ValueError),
           ({"chunk_size": 0}, ValueError), ({"scale": float("nan")}, ValueError),
           ({"key_mask": np.ones((2, 3, 5), bool)}, ValueError),
           ({"normalize_qk": "yes"}, TypeError)]
    for extra, exc in bad:
        kw = {**opts, **extra}
        with pytest.raises(exc) as forward:
            _forward(args, kw)
        with pytest.raises(exc) as backward:
            _vjp(args, do, kw)
        assert str(backward.value) == str(forward.value)
    for name, x in (("beta", args["beta"][..., :3]), ("g", args["g"][..., :3]),
                    ("initial_state", args["initial_state"][..., :2])):
        with pytest.raises(ValueError) as forward:
            _forward({**args, name: x}, opts)
        with pytest.raises(ValueError) as backward:
            _vjp({**args, name: x}, do, opts)
        assert str(backward.value) == str(forward.value)


@pytest.mark.parametrize("backend", ["strict", "strict_device1", "torch", "jax"])
@pytest.mark.parametrize("method", METHODS)
def test_every_backend(backend, method, rng):
    b = get_backend(backend)
    args, opts, do = _case(rng, batch=(2,), n=10, key_mask=True)
    fn = gated_delta_attention if "g" in args else delta_attention
    rest = {name: x for name, x in args.items() if name not in "qkv"}
    assert_grads_on_backend(b, lambda *a, **o: arrayattn.vjp(fn, *a, **o), args["q"],
                            args["k"], args["v"], do,
                            {**rest, **opts, "method": method, "chunk_size": 4})


@pytest.mark.parametrize("method", METHODS)
def test_jax_jit_and_jax_vjp(method, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    args, opts, do = _case(rng, batch=(2,), n=10, key_mask=True)
    jopts = {key: jax.numpy.asarray(val) if hasattr(val, "shape") else val
             for key, val in opts.items()}
    expected = _vjp(args, do, opts, method=method, chunk_size=4)
    names = sorted(args)

    def run(do, *arrays):
        return _vjp(dict(zip(names, arrays)), do, jopts, method=method, chunk_size=4)

    grads = jax.jit(run)(jax.numpy.asarray(do), *(jax.numpy.asarray(args[n]) for n in names))
    for name in names:
        np.testing.assert_allclose(np.asarray(grads[name]), expected[name], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(expected[name])))
    # jax's own autodiff through the reference forward agrees
    _, pull = jax.vjp(lambda *a: _forward(dict(zip(names, a)), jopts, method=method,
                                          chunk_size=4),
                      *(jax.numpy.asarray(args[n]) for n in names))
    for name, g in zip(names, pull(jax.numpy.asarray(do))):
        assert _rel(g, expected[name]) <= RTOL, name
