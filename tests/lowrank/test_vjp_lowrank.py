"""The backward of the low-rank family: Linformer (``linformer``) and Luna (``luna``).

Oracles: torch autograd and ``jax.vjp`` through the forward *reference form* (float64,
relative error <= 1e-10), central finite differences (NumPy), and the NumPy result for
the other backends and under ``jax.jit``.  Cotangents of the caller's projections
(Linformer's ``e``/``f``), of Luna's packed sequence ``p`` and unpack projections are
checked as well as ``q, k, v``; projections drawn from ``seed`` get none.  Neither
variant can be causal: the backward refuses ``causal=True`` as the forward does.
"""
from __future__ import annotations

import numpy as np
import pytest

import arrayattn
from arrayattn.lowrank.linformer import linformer_attention
from arrayattn.lowrank.luna import luna_attention

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, make_qkv

RTOL = 1e-10
FNS = {"linformer": linformer_attention, "luna": luna_attention}


def test_every_variant_of_the_family_is_covered():
    mine = {r.name for r in arrayattn.variants() if r.fn in FNS.values()}
    assert mine == set(FNS)
    assert all(arrayattn.backward.has_backward(fn) for fn in FNS.values())


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def _garbage(km, k, v, batch):
    """Masked keys and values hold NaN / inf: they must never be read."""
    km = np.broadcast_to(km, (*batch, k.shape[-2]))
    k, v = k.copy(), v.copy()
    k[~km] = np.nan
    v[~km] = np.inf
    return k, v


def _case(name, case, rng, *, batch=(2, 3), n=11, s=13, d=6, dv=5, m=4, l=5, norm=3.0,
          sharp=False):
    """``(q, k, v, do, options)``: ``options`` holds the arrays passed by keyword (the
    differentiable ones among them are the float arrays other than masks)."""
    if name == "luna" and case in ("plain", "key_mask", "empty_pack", "scale"):
        dv = d                        # no W_K: the unpack keys are P' itself
    q, k, v = make_qkv(rng, batch=batch, n=n, s=s, d=d, dv=dv, norm=norm, sharp=sharp)
    opts = {}
    heads = batch[-1]
    if name == "linformer":
        if case == "drawn":
            opts["proj_dim"] = m
        elif case == "drawn_key_mask":
            opts.update(proj_dim=m, key_mask=rng.random((*batch, s)) > 0.3)
        elif case == "shared":                               # F = E
            opts["e"] = rng.standard_normal((m, s)) / np.sqrt(m)
        elif case == "e_f":                                  # E per head, F shared
            opts.update(e=rng.standard_normal((heads, m, s)), f=rng.standard_normal((m, s)))
        elif case == "key_mask":
            km = rng.random((batch[0], 1, s)) > 0.3
            km[..., -1] = False                              # masked in every head
            opts.update(e=rng.standard_normal((m, s)),
                        f=rng.standard_normal((*batch, m, s)), key_mask=km)
        elif case == "scale":
            opts.update(e=rng.standard_normal((m, s)), scale=0.3)
        elif case == "broadcast":                            # the output's batch from e
            q, k, v = q[0, 0], k[0], v[0]
            opts["e"] = rng.standard_normal((*batch, m, s))
    else:
        opts["p"] = rng.standard_normal((l, d))
        if case in ("key_mask", "empty_pack"):
            km = rng.random((*batch, s)) > 0.3
            if case == "empty_pack":                         # one head: no real key
                km[0, 1] = False
            opts["key_mask"] = km
        elif case == "scale":
            opts["scale"] = 0.3
        elif case == "wk":
            opts["unpack_key_proj"] = rng.standard_normal((dv, d)) / np.sqrt(dv)
        elif case == "wk_wv":                                 # per head, dv2 = 3
            opts.update(unpack_key_proj=rng.standard_normal((heads, dv, d)),
                        unpack_value_proj=rng.standard_normal((dv, 3)),
                        key_mask=rng.random((*batch, s)) > 0.3)
        elif case == "broadcast":                            # p per batch element
            q, k, v = q[0], k[0], v[0]
            opts.update(p=rng.standard_normal((batch[0], 1, l, d)),
                        unpack_key_proj=rng.standard_normal((dv, d)))
    if "key_mask" in opts:
        k, v = _garbage(opts["key_mask"], k, v, batch)
    fn = FNS[name]
    with arrayattn.use_engine("reference"):
        out = (fn(q, k, v, opts["p"], **{a: b for a, b in opts.items() if a != "p"})
               if name == "luna" else fn(q, k, v, **opts))
    do = rng.standard_normal(out.shape)
    return q, k, v, do, opts


def _diff(opts):
    """The differentiable keyword arrays of a call."""
    return {a: b for a, b in opts.items()
            if hasattr(b, "dtype") and b.dtype.kind == "f"}


CASES = {"linformer": ["drawn", "drawn_key_mask", "shared", "e_f", "key_mask", "scale",
                       "broadcast"],
         "luna": ["plain", "key_mask", "empty_pack", "scale", "wk", "wk_wv", "broadcast"]}
PARAMS = [pytest.param(name, case, id=f"{name}-{case}")
          for name, cases in CASES.items() for case in cases]


def _call(name, lib, q, k, v, opts):
    fn = FNS[name]
    if name == "luna":
        return fn(q, k, v, opts["p"], **{a: b for a, b in opts.items() if a != "p"})
    return fn(q, k, v, **opts)


def _torch_grads(name, q, k, v, do, opts):
    torch = pytest.importorskip("torch")
    diff = {"q": q, "k": k, "v": v, **_diff(opts)}
    t = {key: torch.tensor(x, requires_grad=True) for key, x in diff.items()}
    topts = {key: (t[key] if key in t else torch.tensor(val) if hasattr(val, "shape")
                   else val) for key, val in opts.items()}
    with arrayattn.use_engine("reference"):
        out = _call(name, torch, t["q"], t["k"], t["v"], topts)
    out.backward(torch.tensor(do))
    return {key: x.grad.numpy() for key, x in t.items()}


@pytest.mark.parametrize("name, case", PARAMS)
def test_vjp_equals_torch_autograd(name, case, rng):
    q, k, v, do, opts = _case(name, case, rng)
    grads = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    expected = _torch_grads(name, q, k, v, do, opts)
    assert sorted(grads) == sorted(expected)
    for key, g in expected.items():
        assert grads[key].shape == g.shape and grads[key].dtype == np.float64
        assert np.all(np.isfinite(grads[key])), key
        assert _rel(grads[key], g) <= RTOL, (key, _rel(grads[key], g))
    km = opts.get("key_mask")
    if km is not None:                 # masked keys: exactly zero, NaN/inf and all
        km = np.broadcast_to(km, k.shape[:-1])
        assert np.all(grads["k"][~km] == 0) and np.all(grads["v"][~km] == 0)


@pytest.mark.parametrize("name, case", [p for p in PARAMS if p.values[1] in
                                        ("e_f", "key_mask", "wk_wv", "empty_pack")])
def test_vjp_equals_jax_vjp(name, case, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v, do, opts = _case(name, case, rng)
    diff = {"q": q, "k": k, "v": v, **_diff(opts)}
    fixed = {key: (jnp.asarray(val) if hasattr(val, "shape") else val)
             for key, val in opts.items() if key not in diff}

    def f(*args):
        a = {**fixed, **dict(zip(diff, args))}
        with arrayattn.use_engine("reference"):
            return _call(name, jnp, a.pop("q"), a.pop("k"), a.pop("v"), a)

    _, pull = jax.vjp(f, *map(jnp.asarray, diff.values()))
    expected = dict(zip(diff, pull(jnp.asarray(do))))
    grads = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    assert sorted(grads) == sorted(expected)
    for key, g in expected.items():
        assert _rel(grads[key], np.asarray(g)) <= RTOL, key


@pytest.mark.parametrize("name, case", [p for p in PARAMS if p.values[1] in
                                        ("e_f", "key_mask", "wk_wv", "broadcast")])
def test_vjp_central_differences(name, case, rng):
    q, k, v, do, opts = _case(name, case, rng, batch=(2, 2), n=6, s=7, d=4, dv=3, m=3,
                              l=3)
    grads = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    args = {"q": q, "k": k, "v": v, **_diff(opts)}
    km = opts.get("key_mask")
    km = None if km is None else np.broadcast_to(km, k.shape[:-1])
    h = 1e-6

    def loss(**kw):
        a = {**opts, **args, **kw}
        return float(np.sum(_call(name, np, a.pop("q"), a.pop("k"), a.pop("v"), a) * do))

    for key, x in args.items():
        for _ in range(4):
            idx = tuple(int(rng.integers(0, size)) for size in x.shape)
            if km is not None and key in ("k", "v") and not km[idx[:-1]]:
                assert grads[key][idx] == 0.0       # a masked key gets no gradient
                continue
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
            # central differences: O(h^2) truncation plus eps |loss| / h rounding
            assert abs(grads[key][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (key, idx, fd)


def test_linformer_masked_columns_of_e_get_zero(rng):
    """A masked key's column of ``E`` multiplies a zeroed key: no effect, no gradient."""
    q, k, v, do, opts = _case("linformer", "key_mask", rng)
    grads = arrayattn.vjp(linformer_attention, q, k, v, do, **opts)
    never = ~np.any(opts["key_mask"], axis=(0, 1))           # masked in every head
    assert never.any()
    assert np.all(grads["e"][:, never] == 0) and np.all(grads["f"][..., never] == 0)


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("backend_name", ["strict", "strict_device1", "torch", "jax"])
def test_vjp_on_every_backend(name, backend_name, rng):
    backend = get_backend(backend_name)
    case = "key_mask" if name == "linformer" else "wk_wv"
    q, k, v, do, opts = _case(name, case, rng, batch=(2, 2))
    assert_grads_on_backend(backend, lambda *a, **o: arrayattn.vjp(FNS[name], *a, **o),
                            q, k, v, do, opts)


@pytest.mark.parametrize("name", FNS)
def test_vjp_traces_under_jax_jit(name, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    case = "key_mask" if name == "linformer" else "wk_wv"
    q, k, v, do, opts = _case(name, case, rng)
    expected = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    arrays = {key: val for key, val in opts.items() if hasattr(val, "shape")}
    rest = {key: val for key, val in opts.items() if key not in arrays}
    grads = jax.jit(lambda q, k, v, do, arrays: arrayattn.vjp(
        FNS[name], q, k, v, do, **arrays, **rest))(
        *map(jax.numpy.asarray, (q, k, v, do)), {a: jax.numpy.asarray(b)
                                                 for a, b in arrays.items()})
    assert sorted(grads) == sorted(expected)
    for key, g in grads.items():
        np.testing.assert_allclose(np.asarray(g), expected[key], rtol=1e-12,
                                   atol=1e-12 * np.max(np.abs(expected[key])))


@pytest.mark.parametrize("name", FNS)
def test_vjp_sharp_inputs(name, rng):
    """Rows of q, k with norm 8 at d = 32 (trained heads' norms), aimed queries."""
    case = "key_mask" if name == "linformer" else "wk_wv"
    q, k, v, do, opts = _case(name, case, rng, batch=(1, 2), n=24, s=32, d=32, dv=8, m=8,
                              l=8, norm=8.0, sharp=True)
    grads = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    expected = _torch_grads(name, q, k, v, do, opts)
    for key, g in expected.items():
        assert _rel(grads[key], g) <= RTOL, (key, _rel(grads[key], g))


# --- the uniform calls (registry names): drawn matrices get no cotangent ----------------

def test_linformer_uniform_call(rng):
    torch = pytest.importorskip("torch")
    q, k, v, do, _ = _case("linformer", "drawn", rng)
    grads = arrayattn.vjp("linformer", q, k, v, do, proj_dim=4)
    assert sorted(grads) == ["k", "q", "v"]                   # E drawn from seed
    q2, k2, v2, do2, _ = _case("linformer", "drawn", rng)
    e = rng.standard_normal((4, k2.shape[-2]))
    given = arrayattn.vjp("linformer", q2, k2, v2, do2, e=e)
    assert sorted(given) == ["e", "k", "q", "v"]
    # a host NumPy e with torch q is moved to torch (as the forward does): a constant
    moved = arrayattn.vjp("linformer", *(torch.tensor(x) for x in (q2, k2, v2, do2)), e=e)
    assert sorted(moved) == ["k", "q", "v"]
    for key in moved:
        assert _rel(moved[key].numpy(), given[key]) <= 1e-13
    te = arrayattn.vjp("linformer", *(torch.tensor(x) for x in (q2, k2, v2, do2)),
                       e=torch.tensor(e))
    assert _rel(te["e"].numpy(), given["e"]) <= 1e-13


def test_luna_uniform_call(rng):
    """``p`` (and ``W_K`` when ``dv != d``) drawn from ``seed``: no cotangent; a given
    ``W_K`` or ``W_V`` gets one.  Equal to the function's vjp with the same draws."""
    from arrayattn.lowrank.luna import uniform_inputs
    q, k, v, do, _ = _case("luna", "wk", rng)                 # dv = 5 != d = 6
    grads = arrayattn.vjp("luna", q, k, v, do, num_packed=4, seed=3)
    assert sorted(grads) == ["k", "q", "v"]
    p, opts = uniform_inputs(q, k, v, num_packed=4, seed=3)
    full = arrayattn.vjp(luna_attention, q, k, v, do, p=p, **opts)
    assert sorted(full) == ["k", "p", "q", "unpack_key_proj", "v"]
    for key in grads:
        assert _rel(grads[key], full[key]) <= 1e-14
    wv = rng.standard_normal((5, 2))
    do2 = rng.standard_normal((*do.shape[:-1], 2))
    given = arrayattn.vjp("luna", q, k, v, do2, unpack_key_proj=opts["unpack_key_proj"],
                          unpack_value_proj=wv, num_packed=4, seed=3)
    assert sorted(given) == ["k", "q", "unpack_key_proj", "unpack_value_proj", "v"]
    expected = _torch_grads("luna", q, k, v, do2, dict(
        p=p, unpack_key_proj=opts["unpack_key_proj"], unpack_value_proj=wv))
    for key in given:
        assert _rel(given[key], expected[key]) <= RTOL, key


# --- grouped-query heads: forward and backward equal to repeating k, v per group --------

def _grouped_case(name, heads, rng):
    q, _, _ = make_qkv(rng, batch=(2, 4), n=9, s=10, d=6)
    _, k, v = make_qkv(rng, batch=(2, 2), n=9, s=10, d=6)
    km = rng.random((2, 1, 10)) > 0.2
    if name == "linformer":
        opts = {"e": rng.standard_normal((heads, 3, 10)), "f": rng.standard_normal((3, 10)),
                "key_mask": km}
    else:
        opts = {"p": rng.standard_normal((heads, 4, 6)),
                "unpack_value_proj": rng.standard_normal((heads, 6, 6)), "key_mask": km}
    return q, k, v, opts


@pytest.mark.parametrize("name", FNS)
@pytest.mark.parametrize("heads", [4, 2, 1])
def test_grouped_heads_sum_over_each_group(name, heads, rng):
    """Per-head projections (``e``; ``p`` and ``W_V``) with the query heads (4), the
    key/value heads (2) or one head: the grouped call equals the repeated one."""
    q, k, v, opts = _grouped_case(name, heads, rng)
    do = rng.standard_normal((2, 4, 9, 6))

    def repeat(x):
        return np.repeat(x, 2, axis=-3)

    rep = {key: (repeat(val) if heads == 2 and key != "key_mask" and val.ndim == 3
                 else val) for key, val in opts.items()}
    rec = arrayattn.get_variant(name)
    if name == "linformer":          # the forward (Luna's uniform call draws p)
        np.testing.assert_allclose(rec(q, k, v, **opts),
                                   rec(q, repeat(k), repeat(v), **rep), rtol=1e-12,
                                   atol=1e-12)
    grads = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    full = arrayattn.vjp(FNS[name], q, repeat(k), repeat(v), do, **rep)
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-12, atol=1e-13)
    for key in ("k", "v"):
        assert grads[key].shape == k.shape
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 10, 6).sum(2),
                                   rtol=1e-11, atol=1e-12)
    for key, val in opts.items():
        if key == "key_mask":
            continue
        assert grads[key].shape == val.shape
        expected = (full[key].reshape(2, 2, *val.shape[1:]).sum(1)
                    if heads == 2 and val.ndim == 3 else full[key])
        np.testing.assert_allclose(grads[key], expected, rtol=1e-11, atol=1e-12)


def test_luna_grouped_forward_with_per_head_projection(rng):
    """The forward bug this backward found: a per-key-head ``W_K`` under grouped heads."""
    q, _, _ = make_qkv(rng, batch=(1, 4), n=5, s=7, d=4)
    _, k, v = make_qkv(rng, batch=(1, 2), n=5, s=7, d=4, dv=3)
    wk = rng.standard_normal((2, 3, 4))
    rec = arrayattn.get_variant("luna")
    np.testing.assert_allclose(rec(q, k, v, unpack_key_proj=wk),
                               rec(q, np.repeat(k, 2, 1), np.repeat(v, 2, 1),
                                   unpack_key_proj=np.repeat(wk, 2, 0)),
                               rtol=1e-12, atol=1e-12)


# --- dtypes, empty inputs, errors -------------------------------------------------------

@pytest.mark.parametrize("name", FNS)
def test_vjp_float32_is_cast_back(name, rng):
    case = "key_mask" if name == "linformer" else "wk_wv"
    q, k, v, do, opts = _case(name, case, rng)
    expected = arrayattn.vjp(FNS[name], q, k, v, do, **opts)
    opts32 = {key: (val.astype(np.float32) if key in _diff(opts) else val)
              for key, val in opts.items()}
    grads = arrayattn.vjp(FNS[name], *(x.astype(np.float32) for x in (q, k, v, do)),
                          **opts32)
    for key, g in grads.items():
        assert g.dtype == np.float32
        # float32 rounding of the logits x becomes a relative error ~eps |x| through exp,
        # plus a few chained matmuls: measured <= 21 eps with logits up to ~20 (norm 8,
        # d = 32, sharp), <= 15 eps here
        assert _rel(g, expected[key]) <= 64 * np.finfo(np.float32).eps, key


def test_linformer_projection_dtype_is_its_own(rng):
    """``e`` in float64 with float32 ``q``: its cotangent comes back in float64."""
    q, k, v, do, opts = _case("linformer", "shared", rng)
    grads = arrayattn.vjp(linformer_attention,
                          *(x.astype(np.float32) for x in (q, k, v, do)), **opts)
    assert grads["e"].dtype == np.float64 and grads["q"].dtype == np.float32


@pytest.mark.parametrize("name", FNS)
def test_vjp_without_keys_is_zero(name, rng):
    q, k, v, do, opts = _case(name, "wk_wv" if name == "luna" else "e_f", rng)
    k0, v0 = k[..., :0, :], v[..., :0, :]
    opts = {key: (val[..., :0] if key in ("e", "f") else val) for key, val in opts.items()}
    opts.pop("key_mask", None)
    grads = arrayattn.vjp(FNS[name], q, k0, v0, do, **opts)
    assert grads["k"].shape == k0.shape and grads["v"].shape == v0.shape
    for key, g in grads.items():
        assert not np.any(g), key


def test_vjp_rejects_what_the_forward_rejects(rng):
    q, k, v, do, opts = _case("linformer", "shared", rng)
    with pytest.raises(ValueError, match="cannot be causal|causal"):
        arrayattn.vjp(linformer_attention, q, k, v, do, causal=True, **opts)
    with pytest.raises(ValueError, match="f was given without e"):
        arrayattn.vjp(linformer_attention, q, k, v, do, f=opts["e"])
    with pytest.raises(ValueError, match="e must have shape"):
        arrayattn.vjp(linformer_attention, q, k, v, do, e=opts["e"][:, :-1])
    with pytest.raises(ValueError, match="do must have the output's shape"):
        arrayattn.vjp(linformer_attention, q, k, v, do[..., :2], **opts)
    q, k, v, do, opts = _case("luna", "wk_wv", rng)
    with pytest.raises(TypeError, match="needs the packed sequence"):
        arrayattn.vjp(luna_attention, q, k, v, do,
                      **{key: val for key, val in opts.items() if key != "p"})
    with pytest.raises(ValueError, match="causal"):
        arrayattn.vjp(luna_attention, q, k, v, do, causal=True, **opts)
    with pytest.raises(ValueError, match="do must have the output's shape"):
        arrayattn.vjp(luna_attention, q, k, v, do[..., :2], **opts)    # W_V gives dv2 = 3
    with pytest.raises(ValueError, match="unpack_key_proj must map"):
        arrayattn.vjp(luna_attention, q, k, v, do, **{**opts, "unpack_key_proj":
                                                       opts["unpack_key_proj"][..., :2]})
