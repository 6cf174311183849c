"""The backward pass of every registered variant (``arrayattn.vjp``), and exact attention's.

Oracles: torch autograd and ``jax.vjp`` taken through the forward *reference form* (float64,
relative error <= 1e-10), central finite differences on sampled entries (NumPy), and the
NumPy result itself for the other backends and under ``jax.jit``.  Families test their own
options (gates, states, patterns) in ``test_vjp_<family>.py``; here every registry record
is covered in its uniform call, and exact attention with every option it takes.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.backward import has_backward

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, make_qkv

RECORDS = arrayattn.variants()
IDS = [r.name for r in RECORDS]
#: Relative error against autodiff through the reference form, float64 (the issue's bar).
RTOL = 1e-10


#: Options that fit a record's default approximation parameter to the small sizes here
#: (the default of 64 landmarks needs n, s >= 64).
SMALL = {"num_landmarks": 4}


def _small(rec):
    return {rec.parameter: SMALL[rec.parameter]} if rec.parameter in SMALL else {}


def _inputs(rec, rng, *, batch=(1, 2), n=24, s=32, d=8, dv=5, norm=3.0):
    n = n if rec.cross else s
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=dv, norm=norm)
    do = rng.standard_normal((*batch, n, dv))
    return q, k, v, do


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _torch_grads(rec, q, k, v, do, **options):
    torch = pytest.importorskip("torch")
    t = {name: torch.tensor(x, requires_grad=True) for name, x in (("q", q), ("k", k),
                                                                   ("v", v))}
    out = rec.reference(t["q"], t["k"], t["v"], **options)
    out.backward(torch.tensor(do))
    return {name: (x.grad.numpy() if x.grad is not None else np.zeros(x.shape))
            for name, x in t.items()}


def _with_backward(records):
    return [pytest.param(r, id=r.name, marks=() if has_backward(r) else pytest.mark.skip(
        reason=f"{r.name}: no backward yet (listed in PENDING)")) for r in records]


#: Registered variants whose backward has not landed yet (test_every_variant_has_a_backward
#: fails when this list is out of date in either direction): none.
PENDING: set[str] = set()


def test_every_variant_has_a_backward():
    missing = {r.name for r in RECORDS if not has_backward(r)}
    assert missing == PENDING


@pytest.mark.parametrize("rec", _with_backward(RECORDS))
def test_vjp_equals_torch_autograd_through_the_reference(rec, rng):
    q, k, v, do = _inputs(rec, rng)
    grads = arrayattn.vjp(rec.name, q, k, v, do, **_small(rec))
    expected = _torch_grads(rec, q, k, v, do, **_small(rec))
    for name in ("q", "k", "v"):
        got = grads.get(name, np.zeros_like(expected[name]))
        assert got.shape == expected[name].shape and got.dtype == np.float64
        assert _rel(got, expected[name]) <= RTOL, name


@pytest.mark.parametrize("rec", _with_backward(RECORDS))
def test_vjp_equals_jax_vjp_through_the_reference(rec, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, do = _inputs(rec, rng, batch=(1,), n=12, s=16)
    out, pull = jax.vjp(lambda a, b, c: rec.reference(a, b, c, **_small(rec)), *map(jax.numpy.asarray,
                                                                       (q, k, v)))
    expected = dict(zip("qkv", pull(jax.numpy.asarray(do))))
    grads = arrayattn.vjp(rec.name, q, k, v, do, **_small(rec))
    for name in ("q", "k", "v"):
        got = grads.get(name, np.zeros(expected[name].shape))
        assert _rel(got, np.asarray(expected[name])) <= RTOL, name


@pytest.mark.parametrize("rec", _with_backward(RECORDS))
@pytest.mark.parametrize("name", ["strict", "strict_device1", "torch", "jax"])
def test_vjp_on_every_backend(rec, name, rng):
    backend = get_backend(name)
    q, k, v, do = _inputs(rec, rng, batch=(1,), n=12, s=16)
    assert_grads_on_backend(backend, lambda *a, **o: arrayattn.vjp(rec.name, *a, **o),
                            q, k, v, do, _small(rec))


@pytest.mark.parametrize("rec", _with_backward(RECORDS))
def test_vjp_traces_under_jax_jit(rec, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, do = _inputs(rec, rng, batch=(1,), n=12, s=16)
    expected = arrayattn.vjp(rec.name, q, k, v, do, **_small(rec))
    grads = jax.jit(lambda *a: arrayattn.vjp(rec.name, *a, **_small(rec)))(
        *map(jax.numpy.asarray, (q, k, v, do)))
    for key, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), expected[key], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(expected[key])))


# --- exact attention: every option, blockwise = dense, finite differences -----------------

def _exact_options(rng, batch, n, s):
    return [
        {},
        {"causal": True},
        {"key_mask": rng.random((*batch[:-1], 1, s)) > 0.3},
        {"mask": rng.random((n, s)) > 0.3, "causal": True},
        {"bias": rng.standard_normal((*batch, n, s))},
        {"bias": rng.standard_normal((n, s)), "key_mask": rng.random((*batch, s)) > 0.2,
         "scale": 0.3},
    ]


@pytest.mark.parametrize("case", range(6))
@pytest.mark.parametrize("block_size", [None, 5, 16])
def test_exact_vjp_options_against_torch(case, block_size, rng):
    torch = pytest.importorskip("torch")
    batch, n, s = (2, 3), 11, 13
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=6, dv=4, norm=8.0, sharp=True)
    do = rng.standard_normal((*batch, n, 4))
    opts = _exact_options(rng, batch, n, s)[case]
    grads = arrayattn.vjp(arrayattn.softmax_attention, q, k, v, do, block_size=block_size,
                          **opts)
    t = {name: torch.tensor(x, requires_grad=True) for name, x in
         (("q", q), ("k", k), ("v", v), ("bias", opts.get("bias")))
         if x is not None}
    topts = {key: (t[key] if key == "bias" else torch.tensor(val) if hasattr(val, "shape")
                   else val) for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = arrayattn.softmax_attention(t["q"], t["k"], t["v"], **topts)
    out.backward(torch.tensor(do))
    assert sorted(grads) == sorted(t)
    for name, x in t.items():
        assert grads[name].shape == tuple(x.shape)
        assert _rel(grads[name], x.grad.numpy()) <= RTOL, name


def test_exact_vjp_grouped_heads_sum_over_each_group(rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=9, s=9, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=9, s=9, d=6)
    do = rng.standard_normal((2, 4, 9, 6))
    grads = arrayattn.vjp("softmax", q, k, v, do, causal=True)
    rep = {"k": np.repeat(k, 2, axis=1), "v": np.repeat(v, 2, axis=1)}
    full = arrayattn.vjp("softmax", q, rep["k"], rep["v"], do, causal=True)
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-13, atol=1e-13)
    for name in ("k", "v"):
        assert grads[name].shape == (2, 2, 9, 6)
        np.testing.assert_allclose(grads[name], full[name].reshape(2, 2, 2, 9, 6).sum(2),
                                   rtol=1e-12, atol=1e-13)


def test_exact_vjp_central_differences(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=7, s=9, d=4, norm=3.0)
    do = rng.standard_normal((2, 7, 4))
    bias = rng.standard_normal((7, 9))
    opts = dict(causal=True, bias=bias)
    grads = arrayattn.vjp("softmax", q, k, v, do, **opts)
    args = {"q": q, "k": k, "v": v, "bias": bias}
    h = 1e-6

    def loss(**kw):
        a = {**args, **kw}
        out = arrayattn.softmax_attention(a["q"], a["k"], a["v"], causal=True, bias=a["bias"])
        return float(np.sum(out * do))

    for name, x in args.items():
        for idx in [tuple(rng.integers(0, m) for m in x.shape) for _ in range(4)]:
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * h)
            # central differences: O(h^2) truncation plus eps * |loss| / h rounding
            assert abs(grads[name][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (name, idx)


def test_exact_blockwise_vjp_equals_dense_and_float32(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=40, s=70, d=8, norm=8.0, sharp=True)
    do = rng.standard_normal((2, 40, 8))
    km = rng.random((2, 70)) > 0.2
    dense = arrayattn.vjp("softmax", q, k, v, do, causal=True, key_mask=km)
    block = arrayattn.vjp("softmax", q, k, v, do, causal=True, key_mask=km, block_size=16)
    for name in "qkv":
        assert _rel(block[name], dense[name]) <= 1e-13
    f32 = arrayattn.vjp("softmax", *(x.astype(np.float32) for x in (q, k, v, do)),
                        causal=True, key_mask=km, block_size=16)
    for name in "qkv":
        assert f32[name].dtype == np.float32
        # float32 rounding through ~s terms of sharp attention: a few hundred eps
        assert _rel(f32[name], dense[name]) <= 1e3 * np.finfo(np.float32).eps


def test_exact_vjp_masked_keys_never_leak_into_gradients(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=6, s=8, d=4)
    do = rng.standard_normal((2, 6, 4))
    km = np.ones((2, 8), bool)
    km[:, -3:] = False
    clean = arrayattn.vjp("softmax", q, k, v, do, key_mask=km)
    k2, v2 = k.copy(), v.copy()
    k2[:, -3:] = np.nan
    v2[:, -3:] = np.inf
    for bs in (None, 3):
        dirty = arrayattn.vjp("softmax", q, k2, v2, do, key_mask=km, block_size=bs)
        for name in "qkv":
            np.testing.assert_allclose(dirty[name], clean[name], rtol=1e-13, atol=1e-14)
        assert np.all(dirty["k"][:, -3:] == 0) and np.all(dirty["v"][:, -3:] == 0)


def test_exact_vjp_empty_rows_and_no_keys(rng):
    q, k, v = make_qkv(rng, batch=(1,), n=5, s=3, d=4)
    do = rng.standard_normal((1, 5, 4))
    mask = np.ones((5, 3), bool)
    mask[2] = False
    g = arrayattn.vjp("softmax", q, k, v, do, mask=mask, block_size=2)
    assert np.all(g["q"][:, 2] == 0) and all(np.isfinite(x).all() for x in g.values())
    g0 = arrayattn.vjp("softmax", q, k[:, :0], v[:, :0], do)
    assert g0["q"].shape == q.shape and not g0["q"].any() and g0["k"].shape == (1, 0, 4)


def test_vjp_refuses_bad_cotangents_and_unknown_variants(rng):
    q, k, v, do = _inputs(arrayattn.get_variant("softmax"), rng, batch=(1,), n=4, s=4)
    with pytest.raises(ValueError, match="do must have the output's shape"):
        arrayattn.vjp("softmax", q, k, v, do[..., :2])
    with pytest.raises(TypeError, match="do must have a real floating dtype"):
        arrayattn.vjp("softmax", q, k, v, do.astype(np.int64))
    with pytest.raises(TypeError, match="do must be an array"):
        arrayattn.vjp("softmax", q, k, v, do.tolist())
    with pytest.raises(ValueError, match="no variant named"):
        arrayattn.vjp("sofmax", q, k, v, do)
    with pytest.raises(NotImplementedError, match="no backward"):
        arrayattn.vjp(lambda q, k, v: v, q, k, v, do)


@pytest.mark.parametrize("impl", ["engine", "engine_split"])
@pytest.mark.parametrize("opts", [{}, {"causal": True}, {"causal": True, "key_mask": True},
                                  {"mask": True}])
@pytest.mark.parametrize("n, s", [(37, 37), (20, 50), (50, 20)])
def test_exact_vjp_numpy_engine_equals_reference(impl, opts, n, s, rng):
    from conftest import implementation
    q, k, v = make_qkv(rng, batch=(2, 3), n=n, s=s, d=8, norm=8.0, sharp=True)
    do = rng.standard_normal((2, 3, n, 8))
    opts = dict(opts)
    if opts.get("key_mask"):
        opts["key_mask"] = rng.random((2, 1, s)) > 0.2
    if opts.get("mask"):
        opts["mask"] = rng.random((n, s)) > 0.1
    with implementation(impl):
        got = arrayattn.vjp("softmax", q, k, v, do, **opts)
    with arrayattn.use_engine("reference"):
        ref = arrayattn.vjp("softmax", q, k, v, do, **opts)
    for name in "qkv":
        assert _rel(got[name], ref[name]) <= 1e-13, name
