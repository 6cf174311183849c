"""The backward of Nyströmformer (``nystrom_svd``, ``nystrom_iterative``), the two-softmax
landmark attention (``landmark``) and ``pinv`` (:func:`arrayattn.backward.pinv_vjp`).

Oracles: torch autograd and ``jax.vjp`` through the forward *reference form* (float64,
relative error <= 1e-10), central finite differences (NumPy), and the NumPy result for
the other backends and under ``jax.jit``.  The SVD pseudo-inverse is tested where its
autodiff is itself accurate: small, well-conditioned landmark matrices (at the default
m = 64 the landmark matrix of near-uniform attention has cond 1e4-1e5 and two SVDs of it
disagree far above 1e-10).
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.backward import pinv_vjp
from arrayattn.lowrank.nystrom import landmark_attention, nystrom_attention

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, make_qkv

NAMES = ["nystrom_svd", "nystrom_iterative", "landmark"]
RTOL = 1e-10


def test_every_variant_of_the_family_is_covered():
    mine = {r.name for r in arrayattn.variants()
            if r.fn in (nystrom_attention, landmark_attention)}
    assert mine == set(NAMES)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _case(name, case, rng, *, batch=(2, 2), n=13, s=17, d=6, dv=5, m=4, norm=3.0):
    """``(q, k, v, do, options)`` of option case ``case``."""
    opts = {"num_landmarks": m}
    if case in ("conv", "conv_masked"):
        s = n
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=dv, norm=norm)
    if case == "key_mask":
        opts["key_mask"] = rng.random((*batch, s)) > 0.3
    elif case == "both_masks":       # shared over heads; one key segment left empty
        shared = (batch[0], *[1] * (len(batch) - 1))
        km = rng.random((*shared, s)) > 0.25
        km[(0,) * len(batch)][:5] = False
        opts.update(key_mask=km, query_mask=rng.random((*shared, n)) > 0.3)
    elif case == "scale":
        opts["scale"] = 0.3
    elif case == "even":
        q, k, v = make_qkv(rng, batch=batch, n=12, s=16, d=d, dv=dv, norm=norm)
    elif case == "global":
        opts["pinv_init"] = "global"
    elif case == "iters":
        opts["pinv_iters"] = 3
    elif case == "conv":
        opts["conv_kernel"] = rng.standard_normal((batch[-1], 3))
    elif case == "conv_masked":
        opts.update(conv_kernel=rng.standard_normal((5,)),
                    key_mask=rng.random((*batch, s)) > 0.3)
    if "key_mask" in opts:           # masked keys and values hold garbage: never read
        km = np.broadcast_to(opts["key_mask"], (*batch, s))
        k, v = k.copy(), v.copy()
        k[~km] = np.nan
        v[~km] = np.inf
    do = rng.standard_normal((*batch, q.shape[-2], dv))
    return q, k, v, do, opts


CASES = ["plain", "key_mask", "both_masks", "scale", "even", "global", "iters", "conv",
         "conv_masked"]


def _params():
    out = []
    for name in NAMES:
        for case in CASES:
            if name != "nystrom_iterative" and case in ("global", "iters"):
                continue
            if name == "landmark" and case.startswith("conv"):
                continue
            out.append(pytest.param(name, case, id=f"{name}-{case}"))
    return out


def _torch_grads(name, q, k, v, do, opts):
    torch = pytest.importorskip("torch")
    diff = {"q": q, "k": k, "v": v}
    if "conv_kernel" in opts:
        diff["conv_kernel"] = opts["conv_kernel"]
    t = {key: torch.tensor(x, requires_grad=True) for key, x in diff.items()}
    topts = {key: (t[key] if key in t else torch.tensor(val) if hasattr(val, "shape")
                   else val) for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = arrayattn.get_variant(name)(t["q"], t["k"], t["v"], **topts)
    out.backward(torch.tensor(do))
    return {key: x.grad.numpy() for key, x in t.items()}


@pytest.mark.parametrize("name, case", _params())
def test_vjp_equals_torch_autograd(name, case, rng):
    q, k, v, do, opts = _case(name, case, rng)
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    expected = _torch_grads(name, q, k, v, do, opts)
    assert sorted(grads) == sorted(expected)
    for key, g in expected.items():
        assert grads[key].shape == g.shape and grads[key].dtype == np.float64
        assert np.all(np.isfinite(grads[key])), key
        assert _rel(grads[key], g) <= RTOL, (key, _rel(grads[key], g))


@pytest.mark.parametrize("name, case", [p for p in _params()
                                        if p.values[1] in ("plain", "both_masks", "conv")])
def test_vjp_equals_jax_vjp(name, case, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v, do, opts = _case(name, case, rng)
    rec = arrayattn.get_variant(name)
    fixed = {key: (jnp.asarray(val) if hasattr(val, "shape") else val)
             for key, val in opts.items() if key != "conv_kernel"}
    diff = [q, k, v] + ([opts["conv_kernel"]] if "conv_kernel" in opts else [])

    def f(*args):
        extra = {"conv_kernel": args[3]} if len(args) > 3 else {}
        return rec.reference(*args[:3], **fixed, **extra)

    _, pull = jax.vjp(f, *map(jnp.asarray, diff))
    expected = dict(zip(["q", "k", "v", "conv_kernel"], pull(jnp.asarray(do))))
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    assert sorted(grads) == sorted(expected)
    for key, g in expected.items():
        assert _rel(grads[key], np.asarray(g)) <= RTOL, key


@pytest.mark.parametrize("name, case", [p for p in _params()
                                        if p.values[1] in ("plain", "both_masks",
                                                           "conv_masked")])
def test_vjp_central_differences(name, case, rng):
    q, k, v, do, opts = _case(name, case, rng, batch=(2,), n=9, s=11, d=4, dv=3, m=3)
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    args = {"q": q, "k": k, "v": v}
    if "conv_kernel" in opts:
        args["conv_kernel"] = opts["conv_kernel"]
    km = opts.get("key_mask")
    h = 1e-6

    def loss(**kw):
        a = {**opts, **args, **kw}
        out = arrayattn.get_variant(name)(a.pop("q"), a.pop("k"), a.pop("v"), **a)
        return float(np.sum(out * do))

    for key, x in args.items():
        for _ in range(5):
            idx = tuple(int(rng.integers(0, size)) for size in x.shape)
            if km is not None and key in ("k", "v") and not km[idx[:-1]]:
                assert grads[key][idx] == 0.0       # a masked key gets no gradient
                continue
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
            # O(h^2) truncation plus eps |loss| / h rounding (times cond(A) for pinv)
            assert abs(grads[key][idx] - fd) <= 1e-6 * max(1.0, abs(fd)), (key, idx, fd)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend_name", ["strict", "strict_device1", "torch", "jax"])
def test_vjp_on_every_backend(name, backend_name, rng):
    backend = get_backend(backend_name)
    q, k, v, do, opts = _case(name, "key_mask", rng, batch=(2,))
    if name == "nystrom_svd" and backend_name.startswith("strict"):
        # array-api-strict has linalg.pinv: the SVD path runs there as well
        pass
    assert_grads_on_backend(backend, lambda *a, **o: arrayattn.vjp(name, *a, **o),
                            q, k, v, do, opts, rtol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_vjp_traces_under_jax_jit(name, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, do, opts = _case(name, "both_masks", rng)
    expected = arrayattn.vjp(name, q, k, v, do, **opts)
    km, qm = jax.numpy.asarray(opts["key_mask"]), jax.numpy.asarray(opts["query_mask"])
    grads = jax.jit(lambda q, k, v, do, km, qm: arrayattn.vjp(
        name, q, k, v, do, num_landmarks=4, key_mask=km, query_mask=qm))(
        *map(jax.numpy.asarray, (q, k, v, do)), km, qm)
    for key, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), expected[key], rtol=1e-10,
                                   atol=1e-10 * np.max(np.abs(expected[key])))


@pytest.mark.parametrize("name", NAMES)
def test_vjp_grouped_heads_sum_over_each_group(name, rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=10, s=10, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=10, s=10, d=6)
    do = rng.standard_normal((2, 4, 10, 6))
    km = rng.random((2, 1, 10)) > 0.2
    grads = arrayattn.vjp(name, q, k, v, do, num_landmarks=3, key_mask=km)
    rep = {"k": np.repeat(k, 2, axis=1), "v": np.repeat(v, 2, axis=1)}
    full = arrayattn.vjp(name, q, rep["k"], rep["v"], do, num_landmarks=3, key_mask=km)
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-12, atol=1e-13)
    for key in ("k", "v"):
        assert grads[key].shape == (2, 2, 10, 6)
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 10, 6).sum(2),
                                   rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_vjp_sharp_inputs(name, rng):
    """Rows of q, k with norm 8 at d = 32 (trained heads' norms), aimed queries."""
    q, k, v = make_qkv(rng, batch=(1, 2), n=24, s=32, d=32, dv=8, norm=8.0, sharp=True)
    do = rng.standard_normal((1, 2, 24, 8))
    opts = {"num_landmarks": 6}
    grads = arrayattn.vjp(name, q, k, v, do, **opts)
    expected = _torch_grads(name, q, k, v, do, opts)
    for key, g in expected.items():
        assert _rel(grads[key], g) <= RTOL, (key, _rel(grads[key], g))


def test_vjp_float32_is_cast_back(rng):
    q, k, v, do, opts = _case("nystrom_iterative", "key_mask", rng)
    grads = arrayattn.vjp("nystrom_iterative", *(x.astype(np.float32) for x in (q, k, v, do)),
                          **opts)
    expected = arrayattn.vjp("nystrom_iterative", q, k, v, do, **opts)
    for key, g in grads.items():
        assert g.dtype == np.float32
        assert _rel(g, expected[key]) <= 1e-3


def test_vjp_rejects_what_the_forward_rejects(rng):
    q, k, v, do, _ = _case("landmark", "plain", rng)
    with pytest.raises(ValueError, match="num_landmarks"):
        arrayattn.vjp("landmark", q, k, v, do, num_landmarks=40)
    with pytest.raises(ValueError, match="causal"):
        arrayattn.vjp("nystrom_svd", q, k, v, do, num_landmarks=4, causal=True)
    with pytest.raises(ValueError, match="pinv_rtol"):
        arrayattn.vjp("nystrom_iterative", q, k, v, do, num_landmarks=4, pinv_rtol=1e-3)


# --- pinv alone ---------------------------------------------------------------------------

def _pinv_fd(a, dz, h=1e-6, **opts):
    """Central differences of ``<dz, pinv(a)>`` for every entry of ``a``."""
    out = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
        plus, minus = a.copy(), a.copy()
        plus[idx] += h
        minus[idx] -= h
        out[idx] = np.sum(dz * (arrayattn.pinv(plus, **opts) - arrayattn.pinv(minus, **opts)))
    return out / (2 * h)


@pytest.mark.parametrize("shape", [(2, 4, 4), (5, 3), (3, 5)])
def test_pinv_vjp_full_rank_central_differences(shape, rng):
    a = rng.standard_normal(shape)
    dz = rng.standard_normal((*shape[:-2], shape[-1], shape[-2]))
    assert _rel(pinv_vjp(a, dz), _pinv_fd(a, dz)) <= 1e-7


@pytest.mark.parametrize("shape, rank", [((5, 4), 2), ((4, 6), 3), ((4, 4), 1)])
def test_pinv_vjp_rank_deficient_along_constant_rank(shape, rank, rng):
    """A = U W of rank r, perturbed as (U + h dU)(W + h dW): the rank stays r, where pinv
    is differentiable (an arbitrary perturbation raises the rank: a jump, no derivative)."""
    u, w = rng.standard_normal((shape[0], rank)), rng.standard_normal((rank, shape[1]))
    du, dw = rng.standard_normal(u.shape), rng.standard_normal(w.shape)
    dz = rng.standard_normal(shape[::-1])
    h = 1e-6
    got = np.sum(pinv_vjp(u @ w, dz) * (du @ w + u @ dw))
    plus = arrayattn.pinv((u + h * du) @ (w + h * dw))
    minus = arrayattn.pinv((u - h * du) @ (w - h * dw))
    fd = np.sum(dz * (plus - minus)) / (2 * h)
    assert abs(got - fd) <= 1e-7 * max(1.0, abs(fd))


@pytest.mark.parametrize("init", ["per_matrix", "global"])
@pytest.mark.parametrize("iters", [0, 1, 6])
def test_pinv_vjp_iterative_central_differences(init, iters, rng):
    a = rng.standard_normal((2, 4, 4)) + 3.0 * np.eye(4)
    dz = rng.standard_normal((2, 4, 4))
    opts = dict(method="iterative", iters=iters, init=init)
    assert _rel(pinv_vjp(a, dz, **opts), _pinv_fd(a, dz, **opts)) <= 1e-7


@pytest.mark.parametrize("method", ["svd", "iterative"])
def test_pinv_vjp_equals_torch_autograd(method, rng):
    torch = pytest.importorskip("torch")
    a = rng.standard_normal((3, 5, 5)) + 2.0 * np.eye(5)
    dz = rng.standard_normal((3, 5, 5))
    ta = torch.tensor(a, requires_grad=True)
    with arrayattn.use_engine("reference"):
        arrayattn.pinv(ta, method=method, iters=8).backward(torch.tensor(dz))
    assert _rel(pinv_vjp(a, dz, method=method, iters=8), ta.grad.numpy()) <= RTOL


def test_pinv_vjp_checks_its_cotangent(rng):
    a = rng.standard_normal((4, 3))
    with pytest.raises(ValueError, match="shape of pinv"):
        pinv_vjp(a, np.ones((4, 3)))
    with pytest.raises(ValueError, match="rtol"):
        pinv_vjp(a, np.ones((3, 4)), method="iterative", rtol=1e-3)


@pytest.mark.parametrize("method", ["svd", "iterative"])
@pytest.mark.parametrize("backend_name", ["strict", "strict_device1", "torch", "jax"])
def test_pinv_vjp_on_every_backend(method, backend_name, rng):
    backend = get_backend(backend_name)
    a = rng.standard_normal((2, 4, 3))
    dz = rng.standard_normal((2, 3, 4))
    expected = pinv_vjp(a, dz, method=method)
    got = pinv_vjp(backend.asarray(a), backend.asarray(dz), method=method)
    assert type(got) is type(backend.asarray(a))
    if backend.device is not None:
        assert arrayattn.core.xp.xp_device(got) == backend.device
    np.testing.assert_allclose(backend.to_numpy(got), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["svd", "iterative"])
def test_pinv_vjp_traces_under_jax_jit(method, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    a = rng.standard_normal((2, 4, 4)) + 2.0 * np.eye(4)
    dz = rng.standard_normal((2, 4, 4))
    got = jax.jit(lambda a, dz: pinv_vjp(a, dz, method=method))(a, dz)
    np.testing.assert_allclose(np.asarray(got), pinv_vjp(a, dz, method=method), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("kernel_heads", [4, 2, 1])
def test_grouped_heads_with_a_conv_kernel_per_head(kernel_heads, rng):
    """Forward and backward with grouped-query heads and ``conv_kernel (H, K)``: equal to
    repeating k, v (and a per-key-head kernel) over each group."""
    q, _, _ = make_qkv(rng, batch=(2, 4), n=10, s=10, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=10, s=10, d=6)
    do = rng.standard_normal((2, 4, 10, 6))
    w = rng.standard_normal((kernel_heads, 3))
    w_full = np.repeat(w, 2, axis=0) if kernel_heads == 2 else w
    rec = arrayattn.get_variant("nystrom_iterative")
    rep = {"k": np.repeat(k, 2, axis=1), "v": np.repeat(v, 2, axis=1)}
    np.testing.assert_allclose(rec(q, k, v, num_landmarks=3, conv_kernel=w),
                               rec(q, rep["k"], rep["v"], num_landmarks=3, conv_kernel=w_full),
                               rtol=1e-12, atol=1e-12)
    grads = arrayattn.vjp(rec.name, q, k, v, do, num_landmarks=3, conv_kernel=w)
    full = arrayattn.vjp(rec.name, q, rep["k"], rep["v"], do, num_landmarks=3,
                         conv_kernel=w_full)
    assert grads["conv_kernel"].shape == w.shape
    expected_w = full["conv_kernel"].reshape(2, 2, 3).sum(1) if kernel_heads == 2 else (
        full["conv_kernel"])
    np.testing.assert_allclose(grads["conv_kernel"], expected_w, rtol=1e-11, atol=1e-12)
    for key in ("k", "v"):
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 10, 6).sum(2),
                                   rtol=1e-11, atol=1e-12)
