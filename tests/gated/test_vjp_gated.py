"""The backward of the decay-gated family: retention, GLA and SSD (``arrayattn.vjp`` of
:func:`arrayattn.retention`, :func:`arrayattn.gla_attention`,
:func:`arrayattn.ssd_attention` and of the registry's ``retention``, ``gla``, ``ssd``).

Oracles: torch autograd and ``jax.vjp`` through the forward reference forms (float64,
relative error <= 1e-10), a NumPy loop over the tokens that keeps every state and applies
the backward equations as written (``dg_t = a_t * rowsum(S_(t-1) * dS_t)``: the direct
form, independent of the reverse-cumsum identity the vjp uses), central finite
differences (NumPy), and the NumPy result for the other backends and under ``jax.jit``.
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest

import arrayattn
from arrayattn import gla_attention, reference, retention, ssd_attention

from vjp_checks import assert_grads_on_backend
from conftest import get_backend, make_qkv

NAMES = ["retention", "gla", "ssd"]
FUNCTIONS = {"retention": retention, "gla": gla_attention, "ssd": ssd_attention}
GATE = {"retention": None, "gla": "g", "ssd": "a"}
RTOL = 1e-10
METHODS = ["chunked", "recurrent"]


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def test_every_variant_of_the_family_is_covered():
    mine = {r.name for r in arrayattn.variants() if r.fn in FUNCTIONS.values()}
    assert mine == set(NAMES)
    assert all(arrayattn.backward.has_backward(f) for f in FUNCTIONS.values())


def test_adapter_defaults_are_the_forwards():
    import importlib
    adapters = importlib.import_module("arrayattn.backward.gated")   # not arrayattn.gated.api
    for name, fn in FUNCTIONS.items():
        adapter = getattr(adapters, fn.__name__ + "_vjp")
        fwd = {k: p.default for k, p in inspect.signature(fn).parameters.items()
               if p.kind is p.KEYWORD_ONLY}
        back = {k: p.default for k, p in inspect.signature(adapter).parameters.items()
                if p.kind is p.KEYWORD_ONLY and k != GATE[name]}
        assert fwd == back, name


def _gates(name, rng, shape, *, strong=False):
    """Log gates as the models make them: GLA ``logsigmoid(N(3, 1))`` per dimension, SSD
    ``-exp(N(-2.5, 0.5))`` per token (``strong``: decays far from 1)."""
    x = rng.standard_normal(shape)
    if name == "gla":
        return -np.logaddexp(0.0, -(x + (0.0 if strong else 3.0)))
    return -np.exp(0.5 * x + (0.0 if strong else -2.5))


def _tok(name, t):
    """The index of token ``t``'s gate(s): ``(..., t, :)`` (GLA) or ``(..., t)``."""
    return (Ellipsis, t, slice(None)) if name == "gla" else (Ellipsis, t)


def _case(name, case, rng, *, batch=(2, 3), n=37, d=16, dv=8, method="chunked"):
    """``(q, k, v, do, options, diff)``: ``diff`` the differentiable option arrays."""
    q, k, v = make_qkv(rng, batch=batch, n=n, d=d, dv=dv, norm=8.0, sharp=True)
    opts = {"method": method}
    gate_shape = (*batch, n, d) if name == "gla" else (*batch, n)
    if name == "retention":
        opts["gamma"] = [0.97, 0.9, 0.6][:batch[-1]] if len(batch) > 1 else 0.95
    if case == "state":
        opts.update(initial_state=rng.standard_normal((batch[-1], d, dv)), scale=0.3)
    elif case == "short":
        opts["chunk_size"] = 5
    elif case == "broadcast":           # gates and keys shared over the batch's first axis
        gate_shape = gate_shape[len(batch) - 1:]
        k, v = k[:1], v[:1]
    if name != "retention":
        g = _gates(name, rng, gate_shape, strong=case == "restart")
        if case == "restart":           # gates of exactly 0: a restart of the state
            g[_tok(name, 20)] = -np.inf
            g[_tok(name, 3)[:2] + ((slice(d // 2),) if name == "gla" else ())] = -np.inf
        opts[GATE[name]] = g
    if case == "key_mask":              # masked keys, values and gates hold garbage
        km = rng.random((*batch, n)) > 0.3
        opts["key_mask"] = km
        k, v = k.copy(), v.copy()
        k[~km], v[~km] = np.nan, np.inf
        if name != "retention":
            opts[GATE[name]][~km] = np.nan
    do = rng.standard_normal((*batch, n, dv))
    diff = {key: opts[key] for key in (GATE[name], "initial_state") if key in opts}
    return q, k, v, do, opts, diff


CASES = ["plain", "key_mask", "state", "restart", "short", "broadcast"]


def _vjp(name, q, k, v, do, opts):
    return arrayattn.vjp(FUNCTIONS[name], q, k, v, do, **opts)


def _torch_grads(name, q, k, v, do, opts, diff):
    torch = pytest.importorskip("torch")
    t = {key: torch.tensor(x, requires_grad=True) for key, x in
         {"q": q, "k": k, "v": v, **diff}.items()}
    topts = {key: (t[key] if key in t else torch.tensor(val) if hasattr(val, "shape")
                   else val) for key, val in opts.items()}
    gate = GATE[name]
    args = (t["q"], t["k"], t["v"]) + ((topts.pop(gate),) if gate else ())
    out = FUNCTIONS[name](*args, **topts)
    out.backward(torch.tensor(do))
    return {key: x.grad.numpy() for key, x in t.items()}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", NAMES)
def test_vjp_equals_torch_autograd(name, case, method, rng):
    q, k, v, do, opts, diff = _case(name, case, rng, method=method)
    grads = _vjp(name, q, k, v, do, opts)
    expected = _torch_grads(name, q, k, v, do, opts, diff)
    assert sorted(grads) == sorted(expected)
    for key, g in expected.items():
        assert grads[key].shape == g.shape and grads[key].dtype == np.float64, key
        assert np.all(np.isfinite(grads[key])), key
        assert _rel(grads[key], g) <= RTOL, (key, _rel(grads[key], g))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", NAMES)
def test_recurrent_equals_chunked(name, case, rng):
    q, k, v, do, opts, _ = _case(name, case, rng, n=45)
    rec = _vjp(name, q, k, v, do, {**opts, "method": "recurrent"})
    for chunk_size in (1, 3, 8, 16, 64):
        chunked = _vjp(name, q, k, v, do, {**opts, "chunk_size": chunk_size})
        for key in rec:
            # sums of <= n products in another order: a few ulps of the largest term
            assert _rel(chunked[key], rec[key]) <= 1e-12, (chunk_size, key)


# --- the backward equations as written, one token at a time, every state kept ---------

def _loop_vjp(q, k, v, g, s0, do, ds_n):
    """dS_t = q_t^T do_t + diag(a_(t+1)) dS_(t+1); dq = do S^T, dk = v dS^T, dv = k dS,
    dg_t = a_t rowsum(S_(t-1) dS_t), dS_0 = diag(a_1) dS_1 (NumPy, float64)."""
    n = q.shape[-2]
    a = np.exp(g)
    states = [s0]
    for t in range(n):
        states.append(a[..., t, :, None] * states[-1]
                      + k[..., t, :, None] * v[..., t, None, :])
    dq, dk, dv, dg = (np.zeros(np.broadcast_shapes(x.shape, states[-1].shape[:-2] + (
        n, x.shape[-1]))) for x in (q, k, v, g))
    ds = ds_n
    for t in range(n - 1, -1, -1):
        ds = ds + q[..., t, :, None] * do[..., t, None, :]
        dq[..., t, :] = np.einsum("...j,...ij->...i", do[..., t, :], states[t + 1])
        dk[..., t, :] = np.einsum("...j,...ij->...i", v[..., t, :], ds)
        dv[..., t, :] = np.einsum("...i,...ij->...j", k[..., t, :], ds)
        per_dim = a[..., t, :] * np.sum(states[t] * ds, axis=-1)
        dg[..., t, :] = per_dim if g.shape[-1] != 1 else per_dim.sum(-1, keepdims=True)
        ds = a[..., t, :, None] * ds
    return {"q": dq, "k": dk, "v": dv, "g": dg, "initial_state": ds}


@pytest.mark.parametrize("per_dim", [False, True])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_reference_vjp_equals_the_direct_equations(form, per_dim, rng):
    """The reverse-cumsum identity ``dg_t = sum_(l >= t) (q dq - k dk) + rowsum(S_n dS_n)``
    against ``a_t rowsum(S_(t-1) dS_t)``, with a final-state cotangent."""
    batch, n, d, dv = (2, 2), 29, 8, 5
    q, k, v = make_qkv(rng, batch=batch, n=n, d=d, dv=dv, norm=8.0, sharp=True)
    g = _gates("gla" if per_dim else "ssd", rng, (*batch, n, d if per_dim else 1))
    g[..., 7, :] = -np.inf
    s0, ds_n = (rng.standard_normal((*batch, d, dv)) for _ in range(2))
    do = rng.standard_normal((*batch, n, dv))
    expected = _loop_vjp(q, k, v, g, s0, do, ds_n)
    if form == "recurrent":
        got = reference.gla_recurrent_vjp(q, k, v, g, s0, do, ds_n)
    else:
        got = reference.gla_chunked_vjp(q, k, v, g, s0, do, 8, ds_n)
    for key, x in expected.items():
        assert _rel(got[key], x) <= 1e-12, key
    assert np.all(got["g"][..., 7, :] == 0.0)        # d exp(g) / dg = 0 at g = -inf


def test_final_state_cotangent_against_torch(rng):
    torch = pytest.importorskip("torch")
    batch, n, d, dv = (2,), 19, 6, 4
    q, k, v = make_qkv(rng, batch=batch, n=n, d=d, dv=dv, norm=8.0)
    g = _gates("gla", rng, (*batch, n, d))
    s0, ds_n = (rng.standard_normal((*batch, d, dv)) for _ in range(2))
    do = rng.standard_normal((*batch, n, dv))
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, s0)]
    out, s = reference.gla_recurrent(*t)
    (torch.sum(out * torch.tensor(do)) + torch.sum(s * torch.tensor(ds_n))).backward()
    for c in (4, 32):
        got = reference.gla_chunked_vjp(q, k, v, g, s0, do, c, ds_n)
        for key, x in zip(["q", "k", "v", "g", "initial_state"], t):
            assert _rel(got[key], x.grad.numpy()) <= RTOL, key


# --- options, masks, gates ----------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["gla", "ssd"])
def test_restart_gates_cut_the_gradient_exactly(name, method, rng):
    """``g_t = -inf`` forgets everything before ``t``: the tokens before it get no
    gradient from the outputs after it, and ``dg_t`` is an exact 0."""
    q, k, v, do, opts, _ = _case(name, "plain", rng, n=24, method=method)
    g = opts[GATE[name]]
    g[_tok(name, 10)] = -np.inf
    full = _vjp(name, q, k, v, do, opts)
    do_before = do.copy()
    do_before[..., 10:, :] = 0.0
    before = _vjp(name, q, k, v, do_before, opts)
    for key in ("k", "v"):      # the later outputs add exact zeros to these
        np.testing.assert_allclose(full[key][..., :10, :], before[key][..., :10, :],
                                   rtol=1e-14, atol=1e-14 * np.max(np.abs(full[key])))
    assert np.all(full[GATE[name]][_tok(name, 10)] == 0.0)
    assert np.all(np.isfinite(full[GATE[name]]))


@pytest.mark.parametrize("bad", [np.nan, 0.5])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", ["gla", "ssd"])
def test_a_bad_gate_drops_its_token_and_poisons_what_sees_it(name, method, bad, rng):
    """The forward's rule (:mod:`arrayattn.reference.finite`): a NaN (or positive, which
    the forward makes NaN) gate at token ``t`` drops the token and makes the rows from
    ``t`` on NaN.  Backward: ``dq`` of the earlier rows is that of the token dropped, bit
    for bit; ``dq`` from ``t`` on and every other gradient of that batch element are NaN
    (autodiff through a NaN output row); the other batch elements are untouched."""
    q, k, v, do, opts, _ = _case(name, "plain", rng, n=29, method=method)
    opts["initial_state"] = rng.standard_normal((3, 16, 8))
    t, elem = 13, (0, 1)
    gate = GATE[name]
    g = opts[gate].copy()
    g[elem + _tok(name, t)[1:]] = bad
    dirty = _vjp(name, q, k, v, do, {**opts, gate: g})
    kz, vz, gz = k.copy(), v.copy(), opts[gate].copy()
    kz[elem + (t,)], vz[elem + (t,)], gz[elem + _tok(name, t)[1:]] = 0.0, 0.0, 0.0
    dropped = _vjp(name, q, kz, vz, do, {**opts, gate: gz})
    np.testing.assert_array_equal(dirty["q"][elem][:t], dropped["q"][elem][:t])
    assert np.all(np.isnan(dirty["q"][elem][t:]))
    assert all(np.all(np.isnan(dirty[key][elem])) for key in ("k", "v", gate))
    # initial_state (3, dk, dv) is shared by the batch's first axis: head 1 summed over it
    assert np.isnan(dirty["initial_state"]).any(axis=(-2, -1)).tolist() == [False, True,
                                                                            False]
    other = np.ones((2, 3), bool)
    other[elem] = False
    for key in ("q", "k", "v", gate):
        np.testing.assert_array_equal(dirty[key][other], dropped[key][other])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", NAMES)
def test_masked_tokens_never_leak_and_get_no_gradient(name, method, rng):
    q, k, v, do, opts, _ = _case(name, "key_mask", rng, method=method)
    km = opts["key_mask"]
    grads = _vjp(name, q, k, v, do, opts)
    clean_k, clean_v = np.where(km[..., None], k, 0.0), np.where(km[..., None], v, 0.0)
    clean_opts = dict(opts)
    if name != "retention":
        clean_opts[GATE[name]] = np.where(km if name == "ssd" else km[..., None],
                                          opts[GATE[name]], -0.1)
    clean = _vjp(name, q, clean_k, clean_v, do, clean_opts)
    for key, x in grads.items():
        assert np.all(np.isfinite(x)), key
        np.testing.assert_allclose(x, clean[key], rtol=1e-13,
                                   atol=1e-13 * np.max(np.abs(clean[key])))
    for key in ["k", "v"] + ([GATE[name]] if name != "retention" else []):
        assert np.all(grads[key][~km] == 0.0), key
    assert np.any(grads["q"][~km] != 0.0)        # a padded token's query still reads S_t


@pytest.mark.parametrize("name", NAMES)
def test_grouped_heads_sum_over_each_group(name, rng):
    """Registry calls with 4 query heads over 2 key/value heads: equal to repeating the
    keys and values, ``dk``, ``dv`` summed over each group (the gates drawn from ``seed``
    are the same numbers in both layouts); and equal to torch autograd."""
    torch = pytest.importorskip("torch")
    q, _, _ = make_qkv(rng, batch=(2, 4), n=21, d=8, norm=8.0, sharp=True)
    _, k, v = make_qkv(rng, batch=(2, 2), n=21, d=8, norm=8.0)
    do = rng.standard_normal((2, 4, 21, 8))
    grads = arrayattn.vjp(name, q, k, v, do, chunk_size=8)
    full = arrayattn.vjp(name, q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), do,
                         chunk_size=8)
    assert sorted(grads) == ["k", "q", "v"]
    np.testing.assert_allclose(grads["q"], full["q"], rtol=1e-13, atol=1e-13)
    for key in ("k", "v"):
        assert grads[key].shape == (2, 2, 21, 8)
        np.testing.assert_allclose(grads[key], full[key].reshape(2, 2, 2, 21, 8).sum(2),
                                   rtol=1e-12, atol=1e-12 * np.max(np.abs(full[key])))
    t = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    arrayattn.get_variant(name).reference(*t, chunk_size=8).backward(torch.tensor(do))
    for key, x in zip("qkv", t):
        assert _rel(grads[key], x.grad.numpy()) <= RTOL, key


def test_retention_gamma_gets_no_cotangent_and_per_head_gammas_apply(rng):
    q, k, v = make_qkv(rng, batch=(2, 3), n=17, d=8, norm=8.0)
    do = rng.standard_normal((2, 3, 17, 8))
    gamma = np.array([0.9, 0.8, 0.99])
    grads = arrayattn.vjp(retention, q, k, v, do, gamma=gamma)
    assert sorted(grads) == ["k", "q", "v"]
    for h in range(3):      # head h alone, with its own scalar decay
        one = arrayattn.vjp(retention, q[:, h], k[:, h], v[:, h], do[:, h],
                            gamma=float(gamma[h]))
        for key in "qkv":
            assert _rel(grads[key][:, h], one[key]) <= 1e-13, (h, key)
    default = arrayattn.vjp("retention", q, k, v, do)      # RetNet's 1 - 2^(-5-h)
    named = arrayattn.vjp(retention, q, k, v, do, gamma=arrayattn.retention_gammas(3))
    for key in "qkv":
        np.testing.assert_array_equal(default[key], named[key])


@pytest.mark.parametrize("name", NAMES)
def test_central_differences(name, rng):
    """Every differentiable argument, including the log gates and the initial state, at
    sampled entries: ``|vjp - fd| <= 1e-7 max(1, |fd|)`` (``O(h^2)`` truncation plus
    ``eps |loss| / h`` rounding, ``|loss| ~ 1e2`` here)."""
    q, k, v, do, opts, diff = _case(name, "state", rng, batch=(2, 2), n=11, d=4, dv=3)
    if name != "retention":
        opts[GATE[name]] = _gates(name, rng, opts[GATE[name]].shape, strong=True)
        diff[GATE[name]] = opts[GATE[name]]
    opts["chunk_size"] = 4
    grads = _vjp(name, q, k, v, do, opts)
    args = {"q": q, "k": k, "v": v, **diff}
    gate = GATE[name]
    h = 1e-6

    def loss(**kw):
        a = {**opts, **args, **kw}
        pos = [a.pop("q"), a.pop("k"), a.pop("v")] + ([a.pop(gate)] if gate else [])
        return float(np.sum(FUNCTIONS[name](*pos, **a) * do))

    for key, x in args.items():
        for _ in range(6):
            idx = tuple(int(rng.integers(0, size)) for size in x.shape)
            plus, minus = x.copy(), x.copy()
            plus[idx] += h
            minus[idx] -= h
            fd = (loss(**{key: plus}) - loss(**{key: minus})) / (2 * h)
            assert abs(grads[key][idx] - fd) <= 1e-7 * max(1.0, abs(fd)), (key, idx, fd)


@pytest.mark.parametrize("name", NAMES)
def test_float32_is_cast_back_and_close(name, rng):
    q, k, v, do, opts, diff = _case(name, "state", rng, n=64, d=32, dv=32)
    ref = _vjp(name, q, k, v, do, opts)
    f32 = {key: (x.astype(np.float32) if isinstance(x, np.ndarray) else x)
           for key, x in opts.items()}
    got = _vjp(name, *(x.astype(np.float32) for x in (q, k, v, do)), f32)
    for key, x in got.items():
        assert x.dtype == np.float32 and x.shape == ref[key].shape
        # float32 rounding of sums of <= n = 64 decayed products, each of a few roundings
        # measured <= 8 eps
        assert _rel(x, ref[key]) <= 64 * 8 * np.finfo(np.float32).eps, key


@pytest.mark.parametrize("name", NAMES)
def test_empty_sequence_and_return_state(name, rng):
    q, k, v, do, opts, diff = _case(name, "state", rng, n=9)
    with_state = _vjp(name, q, k, v, do, {**opts, "return_state": True})
    plain = _vjp(name, q, k, v, do, opts)
    for key in plain:
        np.testing.assert_array_equal(with_state[key], plain[key])
    empty = {key: (x[..., :0] if key == "a" else x[..., :0, :] if key == "g" else x)
             for key, x in opts.items()}
    args = {"q": q[..., :0, :], "k": k[..., :0, :], "v": v[..., :0, :], **empty}
    grads = _vjp(name, args["q"], args["k"], args["v"], do[..., :0, :], empty)
    assert sorted(grads) == sorted(plain)
    for key, x in grads.items():
        assert x.shape == args[key].shape and not np.any(x), key


@pytest.mark.parametrize("name", NAMES)
def test_errors_are_the_forwards(name, rng):
    q, k, v, do, opts, _ = _case(name, "plain", rng, n=6)
    gate = GATE[name]

    def both(exc, match, **bad):
        call = {**opts, **bad}
        pos = [q, k, v] + ([call.pop(gate)] if gate else [])
        with pytest.raises(exc, match=match):
            FUNCTIONS[name](*pos, **call)
        with pytest.raises(exc, match=match):
            _vjp(name, q, k, v, do, {**opts, **bad})

    both(ValueError, "causal=False is not defined", causal=False)
    both(ValueError, "method", method="parallel")
    both(ValueError, "chunk_size", chunk_size=0)
    both(ValueError, "scale must be a finite number", scale=float("nan"))
    both(ValueError, "initial_state must have shape", initial_state=np.zeros((3, 4)))
    if gate:
        both(ValueError, f"{gate} must have shape", **{gate: opts[gate][..., :3]})
        both(TypeError, f"{gate} must have a real floating dtype",
             **{gate: opts[gate].astype(np.int64)})
    with pytest.raises(ValueError, match="n == s"):
        _vjp(name, q, k[..., :4, :], v[..., :4, :], do, opts)


# --- backends and jax ---------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend_name",
                         ["strict", "strict_device1", "torch", "jax", "cupy"])
def test_vjp_on_every_backend(name, backend_name, rng):
    backend = get_backend(backend_name)
    q, k, v, do, opts, _ = _case(name, "key_mask", rng, batch=(2,), n=19)
    opts.update(initial_state=rng.standard_normal((2, 16, 8)), chunk_size=8)
    for method in METHODS:
        opts["method"] = method
        assert_grads_on_backend(backend, lambda *a, **o: _vjp(name, *a, o), q, k, v, do,
                                dict(opts))


@pytest.mark.parametrize("name", NAMES)
def test_vjp_equals_jax_vjp_and_traces_under_jit(name, rng):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    jnp = jax.numpy
    q, k, v, do, opts, diff = _case(name, "key_mask", rng, batch=(2,), n=23)
    opts["initial_state"] = diff["initial_state"] = rng.standard_normal((2, 16, 8))
    keys = ["q", "k", "v", *diff]
    fixed = {key: (jnp.asarray(val) if hasattr(val, "shape") else val)
             for key, val in opts.items() if key not in diff}
    gate = GATE[name]

    def f(*args):
        a = dict(zip(keys, args))
        pos = [a.pop("q"), a.pop("k"), a.pop("v")] + ([a.pop(gate)] if gate else [])
        return FUNCTIONS[name](*pos, **fixed, **a)

    values = [q, k, v, *diff.values()]
    for method in METHODS:
        fixed["method"] = method
        _, pull = jax.vjp(f, *map(jnp.asarray, values))
        expected = dict(zip(keys, pull(jnp.asarray(do))))
        grads = _vjp(name, q, k, v, do, {**opts, "method": method})
        assert sorted(grads) == sorted(keys)
        for key in keys:
            assert _rel(grads[key], np.asarray(expected[key])) <= RTOL, (method, key)
        jitted = jax.jit(lambda q, k, v, do, extra: arrayattn.vjp(
            FUNCTIONS[name], q, k, v, do, **{**fixed, **extra}))(
            *map(jnp.asarray, (q, k, v, do)),
            {key: jnp.asarray(x) for key, x in diff.items()})
        for key in keys:
            np.testing.assert_allclose(np.asarray(jitted[key]), grads[key], rtol=1e-12,
                                       atol=1e-12 * np.max(np.abs(grads[key])))
