"""The backward of the sparse and hashing families: the patterns (``local``,
``longformer``, ``bigbird``, ``strided``, ``fixed``, and :func:`arrayattn.sparse_attention`
itself), ``poolingformer`` and ``lsh``.

Oracles: torch autograd and ``jax.vjp`` through the forward's dense *reference
definition* (float64, relative error <= 1e-10), central finite differences (NumPy), the
dense backward for the gathered one (the same sums in another order: <= 1e-13), and the
NumPy result for the other backends and under ``jax.jit``.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import arrayattn
from arrayattn import sparse as sparse_mod
from arrayattn.backward import lsh_attention_vjp

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, implementation, make_qkv

# (arrayattn.backward.sparse, the module: the package's name "sparse" is arrayattn.sparse)
sparse_vjp_mod = importlib.import_module("arrayattn.backward.sparse")
PATTERNS = ["local", "longformer", "bigbird", "strided", "fixed"]
NAMES = [*PATTERNS, "poolingformer", "lsh"]
#: Relative error against autodiff through the reference definition, float64 (the issue's bar).
RTOL = 1e-10
#: The gathered backward against the dense one: the same sums in another order, over
#: at most a few hundred terms.
SAME = 1e-13
#: Small-problem options (several blocks, chunks and windows at n = 70).
SMALL = {"local": {"window": 9, "block_size": 8}, "longformer": {"window": 5, "block_size": 8},
         "bigbird": {"block_size": 8, "num_random_blocks": 2},
         "strided": {"stride": 3, "block_size": 8}, "fixed": {"stride": 3, "block_size": 8},
         "poolingformer": {"window": 5, "pool_window": 20, "pool_size": 4, "block_size": 8},
         "lsh": {"num_hashes": 3, "chunk_size": 8, "num_buckets": 4}}


def test_every_variant_of_the_family_is_covered():
    fns = (sparse_mod.sparse_attention, sparse_mod.local_attention,
           arrayattn.pooling_attention, arrayattn.lsh_attention)
    mine = {r.name for r in arrayattn.variants() if r.fn in fns}
    assert mine == set(NAMES)
    assert all(arrayattn.backward.has_backward(name) for name in NAMES)
    assert arrayattn.backward.has_backward(arrayattn.sparse_attention)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _garbage_at_masked(km, *arrays):
    """Copies of ``arrays (..., s, c)`` holding NaN / inf in the rows ``km`` masks."""
    out = []
    for x, bad in zip(arrays, (np.nan, np.inf, -np.inf)):
        x = x.copy()
        x[~np.broadcast_to(km, x.shape[:-1])] = bad
        out.append(x)
    return out


def _case(name, case, rng, *, batch=(2, 3), n=70, d=16, dv=5):
    """``(arrays, do, options)``: ``arrays`` the differentiable arguments by name."""
    q, k, v = make_qkv(rng, batch=batch, n=n, s=n, d=d, dv=dv, norm=8.0, sharp=True)
    opts = dict(SMALL.get(name, {}))
    arrays = {"q": q, "k": k, "v": v}
    if case == "causal":
        opts["causal"] = True
    elif case in ("key_mask", "causal_key_mask"):
        km = rng.random((*batch[:-1], 1, n) if len(batch) > 1 else (*batch, n)) > 0.3
        km[(0,) * (km.ndim - 1)][:20] = False      # rows with no real key in the window
        opts.update(key_mask=km, causal=case.startswith("causal"))
        arrays["k"], arrays["v"] = _garbage_at_masked(km, k, v)
    elif case == "bias":                           # shared over the batch
        opts["bias"] = rng.standard_normal((n, n))
    elif case == "causal_bias":                    # per head, -inf entries act as masked
        bias = rng.standard_normal((batch[-1], n, n))
        bias[:, :, 3] = -np.inf
        opts.update(bias=bias, causal=True)
    elif case == "scale":
        opts["scale"] = 0.3
    return arrays, rng.standard_normal((*batch, n, dv)), opts


def _split(arrays, opts):
    """The call's ``(q, k, v, options)``, array options included."""
    extra = {key: x for key, x in arrays.items() if key not in "qkv"}
    return arrays["q"], arrays["k"], arrays["v"], {**opts, **extra}


def _torch_grads(name, arrays, do, opts, *, diff_options=("bias", "q2", "k2", "v2")):
    torch = pytest.importorskip("torch")
    t = {key: torch.tensor(x, requires_grad=True) for key, x in arrays.items()}
    t.update({key: torch.tensor(opts[key], requires_grad=True) for key in diff_options
              if key in opts})
    topts = {key: (t[key] if key in t else torch.tensor(val) if hasattr(val, "shape")
                   else val) for key, val in opts.items()}
    rec = arrayattn.get_variant(name)
    out = rec.reference(t["q"], t["k"], t["v"], **{key: val for key, val in topts.items()})
    out.backward(torch.tensor(do))
    return {key: (x.grad.numpy() if x.grad is not None else None) for key, x in t.items()}


CASES = ["plain", "causal", "key_mask", "causal_key_mask", "bias", "causal_bias", "scale"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", PATTERNS)
def test_patterns_equal_torch_autograd(name, case, rng):
    arrays, do, opts = _case(name, case, rng)
    expected = _torch_grads(name, arrays, do, opts)
    for engine in ("auto", "reference"):           # gathered, and the dense backward
        with arrayattn.use_engine(engine):
            grads = arrayattn.vjp(name, *_split(arrays, {})[:3], do, **opts)
        assert sorted(grads) == sorted(expected)
        for key, g in expected.items():
            g = np.where(np.isfinite(g), g, 0.0)    # torch: NaN/inf garbage at masked keys
            assert grads[key].shape == g.shape and grads[key].dtype == np.float64
            assert np.all(np.isfinite(grads[key])), key
            assert _rel(grads[key], g) <= RTOL, (engine, key, _rel(grads[key], g))


@pytest.mark.parametrize("name", PATTERNS)
@pytest.mark.parametrize("case", ["key_mask", "causal_bias"])
def test_gathered_backward_equals_dense(name, case, rng, monkeypatch):
    """With a tiny chunk budget (one block per chunk, long rows split into spans, groups
    out of order), and on the NumPy engine's threads, the gathered backward is the dense
    one."""
    arrays, do, opts = _case(name, case, rng)
    q, k, v, _ = _split(arrays, opts)
    with arrayattn.use_engine("reference"):
        dense = arrayattn.vjp(name, q, k, v, do, **opts)
    gathered = arrayattn.vjp(name, q, k, v, do, **opts)
    with implementation("engine_split"):
        threads = arrayattn.vjp(name, q, k, v, do, **opts)
    monkeypatch.setattr(sparse_vjp_mod, "CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(sparse_vjp_mod, "GROUP_OVERHEAD", 0)
    monkeypatch.setattr(sparse_mod.layout, "_GROUP_OVERHEAD", 0)
    tiny = arrayattn.vjp(name, q, k, v, do, **opts)
    for got in (gathered, threads, tiny):
        assert sorted(got) == sorted(dense)
        for key in dense:
            assert _rel(got[key], dense[key]) <= SAME, key


@pytest.mark.parametrize("n, s", [(30, 70), (70, 30), (1, 70)])
@pytest.mark.parametrize("causal", [False, True])
def test_local_cross_attention_n_neq_s(n, s, causal, rng):
    q, k, v = make_qkv(rng, batch=(2,), n=n, s=s, d=8, dv=4, norm=8.0, sharp=True)
    do = rng.standard_normal((2, n, 4))
    opts = dict(window=(7, 3), block_size=8, causal=causal,
                bias=rng.standard_normal((n, s)), key_mask=rng.random((2, s)) > 0.2)
    grads = arrayattn.vjp("local", q, k, v, do, **opts)
    expected = _torch_grads("local", {"q": q, "k": k, "v": v}, do, opts)
    for key, g in expected.items():
        assert _rel(grads[key], g) <= RTOL, key


def test_sparse_attention_function_and_its_errors(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=40, d=8, norm=8.0)
    do = rng.standard_normal((2, 40, 8))
    lay = arrayattn.bigbird_layout(40, block_size=4, num_random_blocks=1, seed=3)
    grads = arrayattn.vjp(arrayattn.sparse_attention, q, k, v, do, layout=lay, causal=True)
    ref = arrayattn.vjp("softmax", q, k, v, do, mask=lay.dense_mask(), causal=True)
    for key in "qkv":
        assert _rel(grads[key], ref[key]) <= SAME
    with pytest.raises(ValueError, match="layout was built for n=40"):
        arrayattn.vjp(arrayattn.sparse_attention, q[:, :30], k, v, do[:, :30], layout=lay)
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        arrayattn.vjp(arrayattn.sparse_attention, q, k, v, do, layout=lay.dense_mask())
    with pytest.raises(ValueError, match="bias must have shape"):
        arrayattn.vjp("bigbird", q, k, v, do, bias=np.zeros((40, 39)))


@pytest.mark.parametrize("name", [*PATTERNS, "poolingformer", "lsh"])
def test_grouped_heads_sum_over_each_group(name, rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=40, d=8, norm=6.0)
    _, k, v = make_qkv(rng, batch=(2, 2), n=40, d=8, norm=6.0)
    do = rng.standard_normal((2, 4, 40, 8))
    opts = {**SMALL[name], "causal": True}
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    full = arrayattn.vjp(name, q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), do,
                         **opts)
    assert sorted(grads) == sorted(full)
    for key in grads:
        want = full[key] if key == "q" else full[key].reshape(2, 2, 2, 40, 8).sum(2)
        assert grads[key].shape == want.shape
        assert _rel(grads[key], want) <= SAME, key


@pytest.mark.parametrize("name", NAMES)
def test_masked_keys_never_leak(name, rng):
    """NaN / inf in masked keys' rows change nothing; their cotangents are exactly 0;
    a query with no real key in reach has zero gradients."""
    q, k, v = make_qkv(rng, batch=(2,), n=48, d=8, norm=6.0)
    do = rng.standard_normal((2, 48, 8))
    km = rng.random((2, 48)) > 0.3
    km[:, :12] = False
    opts = {**SMALL[name], "key_mask": km}
    clean = arrayattn.vjp(name, q, k, v, do, **opts)
    k2, v2 = _garbage_at_masked(km, k, v)
    qk2 = _garbage_at_masked(km, q)[0] if name == "lsh" else q   # lsh: q is the shared qk
    for engine in ("auto", "reference"):
        with arrayattn.use_engine(engine):
            dirty = arrayattn.vjp(name, qk2, k2, v2, do, **opts)
        for key in clean:
            assert np.all(np.isfinite(dirty[key])), key
            assert _rel(dirty[key], clean[key]) <= SAME, (engine, key)
        for key in ("k", "v") if name != "lsh" else ("q", "v"):
            assert np.all(dirty[key][~km] == 0.0), key


@pytest.mark.parametrize("name, extra", [
    ("bigbird", {"bias": True}), ("local", {"causal": True}),
    ("poolingformer", {"pool": "mean", "causal": True}),
    ("poolingformer", {"pool": "max", "pool_stride": 3, "pool_size": 5}),
    ("lsh", {"causal": True}), ("lsh", {"dedup": False})])
def test_central_differences(name, extra, rng):
    n = 40
    q, k, v = make_qkv(rng, batch=(2,), n=n, d=6, dv=3, norm=3.0)
    do = rng.standard_normal((2, n, 3))
    opts = {**SMALL[name], **extra}
    if opts.pop("bias", False):
        opts["bias"] = rng.standard_normal((n, n))
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    args = {"q": q, "k": k, "v": v, **({"bias": opts["bias"]} if "bias" in opts else {})}
    rec, h = arrayattn.get_variant(name), 1e-6
    if name == "lsh":
        args.pop("k")
        buckets = arrayattn.lsh_buckets(q, **{key: opts[key] for key in
                                              ("num_hashes", "num_buckets", "chunk_size")})

    def loss(**kw):
        a = {**opts, **args, **kw}
        return float(np.sum(rec(a.pop("q"), a.pop("k", k), a.pop("v"), **a) * do))

    for key, x in args.items():
        for _ in range(6):
            idx = tuple(int(rng.integers(0, size)) for size in x.shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            if name == "lsh" and key == "q":     # the buckets are constants of the forward
                for y in (plus, minus):
                    assert np.array_equal(arrayattn.lsh_buckets(y, num_hashes=3,
                                                                num_buckets=4), buckets)
            fd = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
            # O(h^2) truncation plus eps |loss| / h rounding
            assert abs(grads[key][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (key, idx, fd)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend_name", ["strict", "strict_device1", "torch", "jax"])
def test_every_backend(name, backend_name, rng):
    backend = get_backend(backend_name)
    arrays, do, opts = _case(name, "causal_key_mask", rng, batch=(2,), n=40)
    if name in PATTERNS:
        opts["bias"] = rng.standard_normal((40, 40))
    q, k, v, opts = _split(arrays, opts)
    assert_grads_on_backend(backend, lambda *a, **o: arrayattn.vjp(name, *a, **o),
                            q, k, v, do, opts)


@pytest.mark.parametrize("name", NAMES)
def test_traces_under_jax_jit(name, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    arrays, do, opts = _case(name, "key_mask", rng, batch=(2,), n=40)
    q, k, v, opts = _split(arrays, opts)
    expected = arrayattn.vjp(name, q, k, v, do, **opts)
    km = jax.numpy.asarray(opts.pop("key_mask"))
    grads = jax.jit(lambda q, k, v, do, km: arrayattn.vjp(name, q, k, v, do, key_mask=km,
                                                          **opts))(
        *map(jax.numpy.asarray, (q, k, v, do)), km)
    assert sorted(grads) == sorted(expected)
    for key, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), expected[key], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(expected[key])))


@pytest.mark.parametrize("name", NAMES)
def test_float32_cast_back(name, rng):
    arrays, do, opts = _case(name, "causal", rng, batch=(2,), n=40)
    q, k, v, opts = _split(arrays, opts)
    ref = arrayattn.vjp(name, q, k, v, do, **opts)
    f32 = arrayattn.vjp(name, *(x.astype(np.float32) for x in (q, k, v, do)), **opts)
    for key, g in f32.items():
        assert g.dtype == np.float32
        # float32 rounding through ~100 terms of sharp attention: a few hundred eps
        assert _rel(g, ref[key]) <= 1e3 * np.finfo(np.float32).eps, key


# --- Poolingformer ------------------------------------------------------------------------

POOL_CASES = ["mean", "max", "max_ties", "separate", "stride", "key_mask"]


def _pool_case(case, rng, causal, *, n=70):
    arrays, do, opts = _case("poolingformer", "plain", rng, n=n)
    opts.update(causal=causal, pool="mean" if case in ("mean", "key_mask") else "max")
    if case == "max_ties":          # coarse values: many exact ties inside the windows
        arrays["k"] = np.round(arrays["k"])
        arrays["v"] = np.round(2 * arrays["v"]) / 2
    elif case == "separate":        # level-2 arguments of their own (d2 != d)
        q2, k2, v2 = make_qkv(rng, batch=(2, 3), n=n, d=6, dv=5, norm=8.0)
        arrays.update(q2=q2, k2=np.round(k2), v2=np.round(2 * v2) / 2)
    elif case == "stride":          # overlapping windows, a short last one
        opts.update(pool_size=5, pool_stride=3, pool="max")
    elif case == "key_mask":
        km = rng.random((2, 1, n)) > 0.3
        km[1, 0, 30:40] = False     # a whole pooled interval of padding
        opts["key_mask"] = km
        arrays["k"], arrays["v"] = _garbage_at_masked(km, arrays["k"], arrays["v"])
    return arrays, do, opts


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", POOL_CASES)
def test_poolingformer_equals_torch_autograd(case, causal, rng):
    arrays, do, opts = _pool_case(case, rng, causal)
    q, k, v, call = _split(arrays, opts)
    expected = _torch_grads("poolingformer", {"q": q, "k": k, "v": v}, do, call)
    for engine in ("auto", "reference"):
        with arrayattn.use_engine(engine):
            grads = arrayattn.vjp("poolingformer", q, k, v, do, **call)
        assert sorted(grads) == sorted(expected)
        for key, g in expected.items():
            g = np.where(np.isfinite(g), g, 0.0)
            assert _rel(grads[key], g) <= RTOL, (engine, key, _rel(grads[key], g))


def test_poolingformer_max_ties_split_evenly_as_jax(rng):
    """torch.amax and jax.numpy.max split a tie's cotangent evenly: so does the vjp."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    arrays, do, opts = _pool_case("max_ties", rng, False, n=40)
    rec = arrayattn.get_variant("poolingformer")
    _, pull = jax.vjp(lambda *a: rec.reference(*a, **opts),
                      *map(jax.numpy.asarray, (arrays["q"], arrays["k"], arrays["v"])))
    expected = dict(zip("qkv", pull(jax.numpy.asarray(do))))
    grads = arrayattn.vjp("poolingformer", arrays["q"], arrays["k"], arrays["v"], do, **opts)
    for key in "qkv":
        assert _rel(grads[key], np.asarray(expected[key])) <= RTOL, key
    # and the ties are real: some window holds two equal maxima of k
    kk = arrays["k"][..., :4, :]
    assert np.any(np.sum(kk == kk.max(axis=-2, keepdims=True), axis=-2) > 1)


# --- LSH ----------------------------------------------------------------------------------

LSH_CASES = [dict(num_hashes=1), dict(num_hashes=2), dict(num_hashes=4, causal=True),
             dict(num_hashes=3, key_mask=True), dict(num_hashes=3, dedup=False),
             dict(num_hashes=2, causal=True, key_mask=True), dict(num_hashes=2, scale=0.5),
             dict(num_hashes=2, num_buckets=1, chunk_size=64)]


def _lsh_case(rng, case, *, n=70):
    qk, _, v = make_qkv(rng, batch=(2, 3), n=n, d=16, dv=5, norm=6.0)
    opts = {"chunk_size": 8, "num_buckets": 4, **case}
    if opts.get("key_mask") is True:
        km = rng.random((2, 1, n)) > 0.3
        opts["key_mask"] = km
        qk, v = _garbage_at_masked(km, qk, v)
    return qk, v, rng.standard_normal((2, 3, n, 5)), opts


@pytest.mark.parametrize("case", LSH_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in
                                                                   c.items()))
def test_lsh_equals_torch_autograd(case, rng):
    torch = pytest.importorskip("torch")
    qk, v, do, opts = _lsh_case(rng, case)
    t = {"qk": torch.tensor(qk, requires_grad=True), "v": torch.tensor(v, requires_grad=True)}
    topts = {key: (torch.tensor(val) if hasattr(val, "shape") else val)
             for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = arrayattn.lsh_attention(t["qk"], t["v"], **topts)
    out.backward(torch.tensor(do))
    for engine in ("auto", "reference"):            # chunked, and the dense backward
        with arrayattn.use_engine(engine):
            grads = lsh_attention_vjp(qk, v, do, **opts)
        assert sorted(grads) == ["qk", "v"]
        for key, x in t.items():
            g = np.where(np.isfinite(x.grad.numpy()), x.grad.numpy(), 0.0)
            assert grads[key].shape == g.shape
            assert _rel(grads[key], g) <= RTOL, (engine, key, _rel(grads[key], g))


def test_lsh_uniform_call_has_no_k_cotangent_and_rotations_none(rng):
    qk, v, do, opts = _lsh_case(rng, {"num_hashes": 2})
    g = arrayattn.vjp("lsh", qk, np.full_like(qk, np.nan), v, do, **opts)
    assert sorted(g) == ["q", "v"]                 # k is ignored: no cotangent
    public = lsh_attention_vjp(qk, v, do, **opts)
    assert np.array_equal(g["q"], public["qk"]) and np.array_equal(g["v"], public["v"])
    rot = arrayattn.lsh_rotations(16, num_hashes=2, num_buckets=4, seed=5)
    own = lsh_attention_vjp(qk, v, do, rotations=rot, num_hashes=2, chunk_size=8)
    assert sorted(own) == ["qk", "v"]              # the caller's rotations: none either
    drawn = lsh_attention_vjp(qk, v, do, seed=5, num_hashes=2, chunk_size=8, num_buckets=4)
    assert all(np.array_equal(own[key], drawn[key]) for key in own)


def test_lsh_chunked_backward_equals_dense_on_every_chunking(rng):
    qk, v, do, opts = _lsh_case(rng, {"num_hashes": 3, "key_mask": True}, n=53)
    for chunk_size in (1, 5, 8, 53, 64):
        o = {**opts, "chunk_size": chunk_size}
        with arrayattn.use_engine("reference"):
            dense = lsh_attention_vjp(qk, v, do, **o)
        chunked = lsh_attention_vjp(qk, v, do, **o)
        for key in dense:
            assert _rel(chunked[key], dense[key]) <= SAME, (chunk_size, key)


def test_lsh_vjp_errors_and_empty(rng):
    qk, v, do, opts = _lsh_case(rng, {"num_hashes": 2})
    with pytest.raises(ValueError, match="do must have the output's shape"):
        lsh_attention_vjp(qk, v, do[..., :3], **opts)
    with pytest.raises(TypeError, match="do must have a real floating dtype"):
        lsh_attention_vjp(qk, v, do.astype(np.int64), **opts)
    with pytest.raises(ValueError, match="num_buckets must be 1 or even"):
        lsh_attention_vjp(qk, v, do, num_buckets=3)
    g = lsh_attention_vjp(qk[..., :0, :], v[..., :0, :], do[..., :0, :])
    assert g["qk"].shape == (2, 3, 0, 16) and g["v"].shape == (2, 3, 0, 5)


# --- cost and edges -----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["local", "bigbird", "lsh"])
def test_never_forms_n_by_s(name, rng):
    """n = s = 8192: an (n, s) float32 matrix alone is 256 MiB.  The backward holds the
    inputs' rows a few times over plus bounded tiles."""
    import tracemalloc
    n, d = 8192, 8
    q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(1,), n=n, d=d))
    do = rng.standard_normal((1, n, d)).astype(np.float32)
    opts = {"local": {"window": 16, "block_size": 16}, "bigbird": {"block_size": 16},
            "lsh": {"num_hashes": 2, "chunk_size": 32}}[name]
    tracemalloc.start()
    try:
        arrayattn.vjp(name, q, k, v, do, **opts)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < n * n * 4 // 4, peak     # < 64 MiB  <<  n * s * 4 = 256 MiB


@pytest.mark.parametrize("name", ["local", "poolingformer"])
def test_no_keys(name, rng):
    q = rng.standard_normal((2, 5, 4))
    k, v, do = np.zeros((2, 0, 4)), np.zeros((2, 0, 3)), rng.standard_normal((2, 5, 3))
    g = arrayattn.vjp(name, q, k, v, do)
    assert {key: x.shape for key, x in g.items()} == {"q": q.shape, "k": k.shape,
                                                       "v": v.shape}
    assert not g["q"].any()
