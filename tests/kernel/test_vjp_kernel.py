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


# --- linear attention: every feature map, every causal shape, masks, methods ------------

MAPS = ["elu+1", "relu", "cosine", "taylor"]
RECORDS = {"elu+1": "linear_elu", "relu": "linear_relu", "cosine": "linear_cosine",
           "taylor": "linear_taylor"}


def test_every_variant_of_the_family_is_covered():
    mine = {r.name for r in arrayattn.variants() if r.family == "kernel"}
    assert mine == {*RECORDS.values(), "efficient"}
    assert all(arrayattn.backward.has_backward(name) for name in mine)


def _torch_public(fn, args: dict, do, **options):
    """Autograd through the public function on torch tensors (its reference form)."""
    t = {name: torch.tensor(x, requires_grad=True) for name, x in args.items()}
    opts = {key: torch.tensor(val) if isinstance(val, np.ndarray) else val
            for key, val in options.items()}
    with arrayattn.use_engine("reference"):
        out = fn(*t.values(), **opts)
    out.backward(torch.tensor(do))
    return {name: (x.grad.numpy() if x.grad is not None else np.zeros(x.shape))
            for name, x in t.items()}


def _masked_qkv(rng, *, batch=(2, 2), n, s, d=6, dv=5, norm=3.0, sharp=False, masked=True):
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=dv, norm=norm, sharp=sharp)
    km = None
    if masked:
        km = rng.random((*batch, s)) > 0.3
        k[~km] = np.nan                 # padding holds garbage: it must never be read
        v[~km] = np.inf
    return q, k, v, rng.standard_normal((*batch, n, dv)), km


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("causal, n, s", [(False, 13, 17)] + [(True, n, s) for n, s in SHAPES])
@pytest.mark.parametrize("method", ["chunked", "cumsum", "recurrent"])
@pytest.mark.parametrize("masked", [False, True])
def test_linear_attention_vjp_equals_torch_autograd(fmap, causal, n, s, method, masked, rng):
    if not causal and method != "chunked":
        pytest.skip("non-causal attention has one form")
    q, k, v, do, km = _masked_qkv(rng, n=n, s=s, masked=masked)
    opts = dict(feature_map=fmap, causal=causal, key_mask=km, method=method, chunk_size=4)
    grads = arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, **opts)
    expected = _torch_public(arrayattn.linear_attention, {"q": q, "k": k, "v": v}, do, **opts)
    for name in "qkv":
        assert grads[name].shape == expected[name].shape
        assert _rel(grads[name], expected[name]) <= RTOL, name
    if masked:
        assert np.all(grads["k"][~km] == 0) and np.all(grads["v"][~km] == 0)


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_vjp_sharp_inputs(fmap, causal, rng):
    """Realistic norms: |q|, |k| = 8 at d = 32, each query aimed at one key."""
    q, k, v, do, km = _masked_qkv(rng, batch=(1, 2), n=40, s=40, d=32, dv=8, norm=8.0,
                                  sharp=True)
    opts = dict(feature_map=fmap, causal=causal, key_mask=km, chunk_size=16)
    grads = arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, **opts)
    expected = _torch_public(arrayattn.linear_attention, {"q": q, "k": k, "v": v}, do, **opts)
    for name in "qkv":
        assert _rel(grads[name], expected[name]) <= RTOL, name


@pytest.mark.parametrize("fmap", MAPS)
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_vjp_unnormalised(fmap, causal, rng):
    q, k, v, do, km = _masked_qkv(rng, n=11, s=14)
    opts = dict(feature_map=fmap, causal=causal, key_mask=km, normalize=False, chunk_size=4)
    grads = arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, **opts)
    expected = _torch_public(arrayattn.linear_attention, {"q": q, "k": k, "v": v}, do, **opts)
    for name in "qkv":
        assert _rel(grads[name], expected[name]) <= RTOL, name


def test_linear_attention_vjp_methods_and_chunk_sizes_agree(rng):
    q, k, v, do, km = _masked_qkv(rng, n=23, s=23)
    base = arrayattn.vjp("linear_elu", q, k, v, do, causal=True, key_mask=km,
                         method="recurrent")
    for method in ("cumsum", "chunked"):
        for chunk in (1, 5, 23, 64):
            got = arrayattn.vjp("linear_elu", q, k, v, do, causal=True, key_mask=km,
                                method=method, chunk_size=chunk)
            for name in "qkv":
                assert _rel(got[name], base[name]) <= 1e-13, (method, chunk, name)


def test_linear_attention_vjp_eps_rows(rng):
    """Rows without a visible key (n > s causal; relu rows with zero kernel sum) have zero
    output and zero gradient; a large ``eps`` zeroes the rows it guards."""
    q, k, v, do, _ = _masked_qkv(rng, n=9, s=5, masked=False)
    g = arrayattn.vjp("linear_relu", q, k, v, do, causal=True)
    assert np.all(g["q"][..., :4, :] == 0)
    eps = 1e3
    opts = dict(feature_map="elu+1", causal=True, eps=eps)
    grads = arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, **opts)
    expected = _torch_public(arrayattn.linear_attention, {"q": q, "k": k, "v": v}, do, **opts)
    for name in "qkv":
        assert _rel(grads[name], expected[name]) <= RTOL, name


# --- feature maps ----------------------------------------------------------------------

@pytest.mark.parametrize("fmap", MAPS + ["taylor(0.5)"])
def test_feature_map_vjps_equal_torch_autograd(fmap, rng):
    from arrayattn.kernel.feature_maps import get_feature_map, taylor_feature_map
    fm = taylor_feature_map(0.5) if fmap == "taylor(0.5)" else get_feature_map(fmap)
    x = rng.standard_normal((3, 7, 5))
    x[0, 0] = 0.0                               # a zero row (cosine), zeros (relu, elu)
    x[1, 2, :2] = 0.0
    dphi = rng.standard_normal((3, 7, fm.dim(5)))
    tx = torch.tensor(x, requires_grad=True)
    fm.query(tx).backward(torch.tensor(dphi))
    got = fm.query_vjp(x, dphi)
    # torch's clamp passes the gradient at its boundary (x = 0) to both branches: slope
    # 2 for elu+1 (whose derivative from either side is 1) and 1 for relu (documented
    # here: the subgradient 0)
    if fmap == "elu+1":
        expected = np.where(x == 0, dphi, tx.grad.numpy())
    elif fmap == "relu":
        expected = np.where(x == 0, 0.0, tx.grad.numpy())
    else:
        expected = tx.grad.numpy()
    assert _rel(got, expected) <= 1e-14
    assert fm.key_vjp is fm.query_vjp or fm.key_vjp(x, dphi).shape == x.shape


def test_user_feature_map_needs_derivatives(rng):
    from arrayattn.kernel.feature_maps import FeatureMap
    q, k, v, do, km = _masked_qkv(rng, n=8, s=8)
    with pytest.raises(NotImplementedError, match="derivatives of the feature map"):
        arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, feature_map=(np.abs, np.abs))

    def square(x):
        return x * x

    fm = FeatureMap("square", square, square, query_vjp=lambda x, g: 2 * x * g,
                    key_vjp=lambda x, g: 2 * x * g)
    grads = arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, feature_map=fm,
                          causal=True, key_mask=km, chunk_size=3)
    expected = _torch_public(arrayattn.linear_attention, {"q": q, "k": k, "v": v}, do,
                             feature_map=fm, causal=True, key_mask=km, chunk_size=3)
    for name in "qkv":
        assert _rel(grads[name], expected[name]) <= RTOL, name
    bad = FeatureMap("bad", square, square, query_vjp=lambda x, g: g[..., 1:],
                     key_vjp=lambda x, g: g)
    with pytest.raises(ValueError, match="query_vjp must return the cotangent"):
        arrayattn.vjp(arrayattn.linear_attention, q, k, v, do, feature_map=bad, key_mask=km)


# --- feature_attention: cotangents phi_q, phi_k, v and the initial state ----------------

@pytest.mark.parametrize("causal, n, s", [(False, 9, 12)] + [(True, n, s) for n, s in SHAPES])
def test_feature_attention_vjp_with_state(causal, n, s, rng):
    m, dv = 5, 4
    pq, pk = rng.random((2, 3, n, m)), rng.random((2, 3, s, m))
    v, do = rng.standard_normal((2, 3, s, dv)), rng.standard_normal((2, 3, n, dv))
    km = rng.random((2, 3, s)) > 0.3
    pk[~km], v[~km] = np.nan, -np.inf
    S, z = rng.standard_normal((3, m, dv)), rng.random((3, m))   # shared over the batch
    state = arrayattn.LinearAttentionState(S, z, 7)
    opts = dict(causal=causal, key_mask=km, chunk_size=4)
    grads = arrayattn.vjp(arrayattn.feature_attention, pq, pk, v, do, state=state, **opts)
    assert sorted(grads) == ["phi_k", "phi_q", "state", "v"]
    t = {name: torch.tensor(x, requires_grad=True)
         for name, x in (("phi_q", pq), ("phi_k", pk), ("v", v), ("S", S), ("z", z))}
    out = arrayattn.feature_attention(
        t["phi_q"], t["phi_k"], t["v"], state=arrayattn.LinearAttentionState(t["S"], t["z"]),
        causal=causal, key_mask=torch.tensor(km), chunk_size=4)
    out.backward(torch.tensor(do))
    for name in ("phi_q", "phi_k", "v"):
        assert _rel(grads[name], t[name].grad.numpy()) <= RTOL, name
    st = grads["state"]
    assert isinstance(st, arrayattn.LinearAttentionState) and st.num_tokens == 7
    assert st.S.shape == S.shape and st.z.shape == z.shape
    assert _rel(st.S, t["S"].grad.numpy()) <= RTOL
    assert _rel(st.z, t["z"].grad.numpy()) <= RTOL


# --- efficient attention ---------------------------------------------------------------

@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("norm, sharp", [(3.0, False), (8.0, True)])
def test_efficient_attention_vjp_equals_torch_autograd(masked, norm, sharp, rng):
    q, k, v, do, km = _masked_qkv(rng, n=11, s=15, d=8, norm=norm, sharp=sharp,
                                  masked=masked)
    if masked:
        km[0, 0] = False                         # one head with every key masked
        k[0, 0], v[0, 0] = np.nan, np.nan
    grads = arrayattn.vjp("efficient", q, k, v, do, key_mask=km)
    expected = _torch_public(arrayattn.efficient_attention, {"q": q, "k": k, "v": v}, do,
                             key_mask=km)
    for name in "qkv":
        assert _rel(grads[name], expected[name]) <= RTOL, name
    if masked:
        assert np.all(grads["k"][~km] == 0) and np.all(grads["v"][~km] == 0)
        assert np.all(grads["q"][0, 0] == 0)


def test_efficient_attention_vjp_refuses_causal_and_handles_no_keys(rng):
    q, k, v, do, _ = _masked_qkv(rng, n=4, s=5, masked=False)
    with pytest.raises(ValueError, match="efficient_attention"):
        arrayattn.vjp("efficient", q, k, v, do, causal=True)
    g = arrayattn.vjp("efficient", q, k[..., :0, :], v[..., :0, :], do)
    assert g["q"].shape == q.shape and not g["q"].any() and g["k"].shape == (2, 2, 0, 6)


# --- causality: a future key never reaches an earlier query's gradient -----------------

def test_causal_vjp_future_changes_leave_earlier_dq_unchanged(rng):
    """A finite change of a future key or value leaves ``dq`` of every earlier row
    bit-for-bit unchanged (in the chunk and across chunks)."""
    q, k, v, do, _ = _masked_qkv(rng, n=20, s=20, masked=False)
    base = arrayattn.vjp("linear_elu", q, k, v, do, causal=True, chunk_size=8)
    for j in (5, 13):                          # inside a chunk, in a later chunk
        k2, v2 = k.copy(), v.copy()
        k2[..., j, :] += 3.0
        v2[..., j, :] *= -7.0
        got = arrayattn.vjp("linear_elu", q, k2, v2, do, causal=True, chunk_size=8)
        np.testing.assert_array_equal(got["q"][..., :j, :], base["q"][..., :j, :])


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_causal_vjp_nan_in_a_later_chunk_never_reaches_earlier_rows(rng):
    q, k, v, do, _ = _masked_qkv(rng, n=20, s=20, masked=False)
    base = arrayattn.vjp("linear_elu", q, k, v, do, causal=True, chunk_size=8)
    k2, v2 = k.copy(), v.copy()
    k2[..., 16, :], v2[..., 17, :] = np.nan, np.inf
    got = arrayattn.vjp("linear_elu", q, k2, v2, do, causal=True, chunk_size=8)
    np.testing.assert_array_equal(got["q"][..., :16, :], base["q"][..., :16, :])


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_causal_vjp_nan_inside_the_chunk_never_reaches_earlier_rows(rng):
    q, k, v, do, _ = _masked_qkv(rng, n=20, s=20, masked=False)
    base = arrayattn.vjp("linear_elu", q, k, v, do, causal=True, chunk_size=8)
    v2 = v.copy()
    v2[..., 5, :] = np.nan
    got = arrayattn.vjp("linear_elu", q, k, v2, do, causal=True, chunk_size=8)
    np.testing.assert_array_equal(got["q"][..., :5, :], base["q"][..., :5, :])


# --- grouped heads, float32, central differences, backends, jax.jit --------------------

def test_grouped_heads_sum_over_each_group(rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=9, s=9, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=9, s=9, d=6)
    do = rng.standard_normal((2, 4, 9, 6))
    for name in ("linear_cosine", "efficient"):
        opts = {"causal": True} if name != "efficient" else {}
        g = arrayattn.vjp(name, q, k, v, do, **opts)
        full = arrayattn.vjp(name, q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), do,
                             **opts)
        assert _rel(g["q"], full["q"]) <= 1e-13
        for arg in "kv":
            assert g[arg].shape == (2, 2, 9, 6)
            assert _rel(g[arg], full[arg].reshape(2, 2, 2, 9, 6).sum(2)) <= 1e-13


@pytest.mark.parametrize("name", [*RECORDS.values(), "efficient"])
def test_float32_is_cast_back(name, rng):
    q, k, v, do, km = _masked_qkv(rng, n=12, s=12, norm=4.0)
    opts = {"key_mask": km} if name == "efficient" else {"key_mask": km, "causal": True}
    ref = arrayattn.vjp(name, q, k, v, do, **opts)
    got = arrayattn.vjp(name, *(x.astype(np.float32) for x in (q, k, v, do)), **opts)
    for arg in "qkv":
        assert got[arg].dtype == np.float32
        # float32 rounding through the features, the chunk sums and the division
        assert _rel(got[arg], ref[arg]) <= 1e3 * np.finfo(np.float32).eps, arg


@pytest.mark.parametrize("name, opts", [
    ("linear_elu", {"causal": True}), ("linear_relu", {"causal": True}),
    ("linear_cosine", {}), ("linear_taylor", {"causal": True}), ("efficient", {}),
    ("linear_elu", {"causal": True, "normalize": False})])
def test_central_differences(name, opts, rng):
    q, k, v = make_qkv(rng, batch=(2,), n=7, s=9, d=4, norm=2.0)
    do = rng.standard_normal((2, 7, 4))
    rec = arrayattn.get_variant(name)
    opts = {**opts, "chunk_size": 3} if name != "efficient" else opts
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    args, h = {"q": q, "k": k, "v": v}, 1e-6

    def loss(**kw):
        a = {**args, **kw}
        return float(np.sum(rec(a["q"], a["k"], a["v"], **opts) * do))

    for arg, x in args.items():
        for idx in [tuple(rng.integers(0, m) for m in x.shape) for _ in range(5)]:
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{arg: plus}) - loss(**{arg: minus})) / (2 * h)
            # O(h^2) truncation plus eps |loss| / h rounding
            assert abs(grads[arg][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (arg, idx)


def _backend_case(rng):
    q, k, v, do, km = _masked_qkv(rng, batch=(1, 2), n=11, s=14)
    S, z = rng.standard_normal((1, 2, 7, 5)), rng.random((1, 2, 7))
    pq, pk = rng.random((1, 2, 11, 7)), rng.random((1, 2, 14, 7))
    return q, k, v, do, km, pq, pk, S, z


@pytest.mark.parametrize("name", ["strict", "strict_device1", "torch", "jax"])
def test_every_backend_equals_numpy(name, rng):
    backend = get_backend(name)
    q, k, v, do, km, pq, pk, S, z = _backend_case(rng)
    a = backend.asarray
    for fmap in MAPS:
        opts = dict(feature_map=fmap, causal=True, chunk_size=4)
        ref = arrayattn.vjp("linear_elu", q, k, v, do, key_mask=km, **opts)
        got = arrayattn.vjp("linear_elu", a(q), a(k), a(v), a(do), key_mask=a(km), **opts)
        for arg in "qkv":
            assert type(got[arg]) is type(a(q))
            np.testing.assert_allclose(backend.to_numpy(got[arg]), ref[arg], rtol=1e-12,
                                       atol=1e-12 * np.max(np.abs(ref[arg])))
    state = arrayattn.LinearAttentionState(S, z)
    ref = arrayattn.vjp(arrayattn.feature_attention, pq, pk, v, do, causal=True,
                        key_mask=km, state=state)
    got = arrayattn.vjp(arrayattn.feature_attention, a(pq), a(pk), a(v), a(do), causal=True,
                        key_mask=a(km), state=arrayattn.LinearAttentionState(a(S), a(z)))
    for arg, r, g in (("phi_q", ref["phi_q"], got["phi_q"]), ("v", ref["v"], got["v"]),
                      ("S", ref["state"].S, got["state"].S),
                      ("z", ref["state"].z, got["state"].z)):
        if backend.device is not None:
            assert arrayattn.core.xp.xp_device(g) == backend.device
        np.testing.assert_allclose(backend.to_numpy(g), r, rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(r)), err_msg=arg)


@pytest.mark.parametrize("name", ["strict", "torch", "jax"])
def test_many_chunks_every_backend_equals_numpy(name, rng):
    """20 chunks of 2 tokens, past the 16 steps at which JAX on a CPU carries the states
    between chunks with a loop (``reference.scan.running_sum``), forward and reverse."""
    backend = get_backend(name)
    q, k, v, do, km = _masked_qkv(rng, batch=(1, 2), n=40, s=40)
    a = backend.asarray
    opts = dict(feature_map="elu+1", causal=True, chunk_size=2)
    ref = arrayattn.vjp("linear_elu", q, k, v, do, key_mask=km, **opts)
    got = arrayattn.vjp("linear_elu", a(q), a(k), a(v), a(do), key_mask=a(km), **opts)
    for arg in "qkv":
        np.testing.assert_allclose(backend.to_numpy(got[arg]), ref[arg], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(ref[arg])), err_msg=arg)


def test_traces_under_jax_jit(rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, do, km, pq, pk, S, z = _backend_case(rng)
    a = jax.numpy.asarray
    for fmap in MAPS:
        opts = dict(feature_map=fmap, causal=True, chunk_size=4)
        ref = arrayattn.vjp("linear_elu", q, k, v, do, key_mask=km, **opts)
        got = jax.jit(lambda *x: arrayattn.vjp("linear_elu", *x[:4], key_mask=x[4], **opts))(
            a(q), a(k), a(v), a(do), a(km))
        for arg in "qkv":
            np.testing.assert_allclose(np.asarray(got[arg]), ref[arg], rtol=1e-12,
                                       atol=1e-12 * np.max(np.abs(ref[arg])))

    def fa(pq, pk, v, do, km, S, z):
        g = arrayattn.vjp(arrayattn.feature_attention, pq, pk, v, do, causal=True,
                          key_mask=km, state=arrayattn.LinearAttentionState(S, z))
        return g["phi_q"], g["phi_k"], g["v"], g["state"].S, g["state"].z

    ref = fa(pq, pk, v, do, km, S, z)
    got = jax.jit(fa)(*map(a, (pq, pk, v, do, km, S, z)))
    for r, g in zip(ref, got):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-12, atol=1e-12 * np.max(np.abs(r)))


# --- memory: the causal backward never forms (n, m, dv) or (n, n) ------------------------

def test_causal_backward_memory_is_chunk_local(rng):
    """At n = 16384, m = dv = 32, c = 64: an ``(n, m, dv)`` array is 134 MB and ``(n, n)``
    2.1 GB; the chunked backward's peak is its ``O(n (m + dv + c))`` working set (the
    features, one ``c x c`` block per chunk, one ``m x (dv + 1)`` state per chunk)."""
    import tracemalloc
    n, m, dv = 16384, 32, 32
    pq, pk = rng.random((n, m)), rng.random((n, m))
    v, do = rng.standard_normal((n, dv)), rng.standard_normal((n, dv))
    tracemalloc.start()
    try:
        reference.kernel_attention_vjp(pq, pk, v, do, causal=True, chunk_size=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    full, working = n * m * dv * 8, n * (m + dv + 1 + 64) * 8
    assert peak < 4 * working      # measured 53 MB = 3.2x (a few c x c blocks per chunk)
    assert peak < full / 2, f"peak {peak / 1e6:.1f} MB, one (n, m, dv) array is {full / 1e6:.0f} MB"
