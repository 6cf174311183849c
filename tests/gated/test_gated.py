"""Gated and delta-rule linear attention (retention, GLA, Mamba-2 SSD, DeltaNet, gated
DeltaNet) against float64 loop oracles written from the papers' recurrences, on every
backend: chunked == recurrent == oracle, gates at and near 0 and 1, masked keys,
causality bit for bit, decoding steps, and the reductions the maths promises."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import arrayattn
from arrayattn import (delta_attention, gated_attention_step, gated_delta_attention,
                       gla_attention, linear_attention, retention, retention_gammas,
                       ssd_attention)
from arrayattn.testing import xp_assert_close

from conftest import make_qkv

F64 = float(np.finfo(np.float64).eps)
F32 = float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------------
# Oracles: one token at a time, in float64, on explicit matrices (row vectors k_t, v_t;
# S of shape (dk, dv)).  Written from the papers, independent of arrayattn's forms.
# ---------------------------------------------------------------------------------

def oracle_gated(q, k, v, alpha, s0=None):
    """GLA / retention / SSD: ``S_t = diag(alpha_t) S_(t-1) + k_t^T v_t``, ``o_t = q_t S_t``;
    ``alpha (..., n, dk)``."""
    *batch, n, dk = q.shape
    out = np.zeros((*batch, n, v.shape[-1]))
    states = np.zeros((*batch, dk, v.shape[-1]))
    for idx in np.ndindex(*batch):
        s = np.zeros((dk, v.shape[-1])) if s0 is None else s0[idx].copy()
        for t in range(n):
            s = alpha[idx][t][:, None] * s + np.outer(k[idx][t], v[idx][t])
            out[idx][t] = q[idx][t] @ s
        states[idx] = s
    return out, states


def oracle_delta(q, k, v, beta, alpha=None, s0=None):
    """(gated) DeltaNet: ``S_t = alpha_t (I - beta_t k_t^T k_t) S_(t-1) + beta_t k_t^T v_t``."""
    *batch, n, dk = q.shape
    out = np.zeros((*batch, n, v.shape[-1]))
    states = np.zeros((*batch, dk, v.shape[-1]))
    for idx in np.ndindex(*batch):
        s = np.zeros((dk, v.shape[-1])) if s0 is None else s0[idx].copy()
        for t in range(n):
            a = 1.0 if alpha is None else alpha[idx][t]
            kt = k[idx][t]
            s = a * (np.eye(dk) - beta[idx][t] * np.outer(kt, kt)) @ s \
                + beta[idx][t] * np.outer(kt, v[idx][t])
            out[idx][t] = q[idx][t] @ s
        states[idx] = s
    return out, states


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def atol(out, dtype="float64", n=1):
    eps = F64 if dtype == "float64" else F32
    return 64 * n * eps * max(1.0, float(np.abs(out).max()))


# ---------------------------------------------------------------------------------
# The five families against their oracles, both forms, every backend
# ---------------------------------------------------------------------------------

N, D, DV = 37, 8, 5          # n not a multiple of the chunk sizes below


def _inputs(rng, sharp=False):
    return make_qkv(rng, batch=(2, 3), n=N, d=D, dv=DV, norm=6.0 if sharp else None,
                    sharp=sharp)


@pytest.mark.parametrize("method,chunk", [("chunked", 8), ("chunked", 64), ("recurrent", 1)])
class TestAgainstOracles:
    def test_gla(self, backend, rng, method, chunk):
        q, k, v = _inputs(rng)
        g = np.log(rng.uniform(0.5, 1.0, (2, 3, N, D)))
        g[0, 1, 10, :] = -np.inf                 # a gate of 0: an exact restart
        g[1, 0, :, 3] = 0.0                      # a dimension that never forgets
        want, _ = oracle_gated(q, k, v, np.exp(g))
        on = backend.asarray
        out = gla_attention(on(q), on(k), on(v), on(g), method=method, chunk_size=chunk)
        xp_assert_close(out, on(want), rtol=0, atol=atol(want, n=N))

    def test_retention(self, backend, rng, method, chunk):
        q, k, v = _inputs(rng)
        gammas = retention_gammas(3)
        alpha = np.broadcast_to(gammas[:, None, None], (2, 3, N, D))
        want, _ = oracle_gated(q, k, v, alpha)
        on = backend.asarray
        out = retention(on(q), on(k), on(v), method=method, chunk_size=chunk)
        xp_assert_close(out, on(want), rtol=0, atol=atol(want, n=N))

    def test_ssd(self, backend, rng, method, chunk):
        q, k, v = _inputs(rng)
        a = -rng.exponential(0.3, (2, 3, N))
        a[1, 2, 20] = -np.inf
        want, _ = oracle_gated(q, k, v, np.repeat(np.exp(a)[..., None], D, axis=-1))
        on = backend.asarray
        out = ssd_attention(on(q), on(k), on(v), on(a), method=method, chunk_size=chunk)
        xp_assert_close(out, on(want), rtol=0, atol=atol(want, n=N))

    def test_deltanet(self, backend, rng, method, chunk):
        q, k, v = _inputs(rng, sharp=True)
        beta = rng.uniform(0.0, 1.0, (2, 3, N))
        want, _ = oracle_delta(unit(q), unit(k), v, beta)
        on = backend.asarray
        out = delta_attention(on(q), on(k), on(v), on(beta), normalize_qk=True,
                              method=method, chunk_size=chunk)
        xp_assert_close(out, on(want), rtol=0, atol=atol(want, n=N))

    def test_gated_deltanet(self, backend, rng, method, chunk):
        q, k, v = _inputs(rng, sharp=True)
        beta = rng.uniform(0.0, 1.0, (2, 3, N))
        g = np.log(rng.uniform(0.3, 1.0, (2, 3, N)))
        g[0, 0, 5] = -np.inf
        want, _ = oracle_delta(unit(q), unit(k), v, beta, np.exp(g))
        on = backend.asarray
        out = gated_delta_attention(on(q), on(k), on(v), on(beta), on(g), normalize_qk=True,
                                    method=method, chunk_size=chunk, scale=1.0)
        xp_assert_close(out, on(want), rtol=0, atol=atol(want, n=N))


@pytest.mark.parametrize("name", ["gla", "ssd", "deltanet", "gated_deltanet", "retention"])
def test_float32_matches_oracle(backend, rng, name):
    """float32 within a derived bound (n terms of rounding), on sharp inputs."""
    q, k, v = make_qkv(rng, batch=(2,), n=70, d=32, dv=16, norm=8.0, sharp=True)
    rec = arrayattn.get_variant(name)
    want = rec.reference(q, k, v)                    # float64 on the host: the reference
    out = rec(*(backend.asarray(x, "float32") for x in (q, k, v)))
    scale = float(np.abs(want).max())
    xp_assert_close(out, backend.asarray(want, "float32"), rtol=0,
                    atol=256 * 70 * F32 * max(scale, 1.0))


# ---------------------------------------------------------------------------------
# Gates near the edges, masks, states, steps, causality
# ---------------------------------------------------------------------------------

def test_tiny_and_huge_decays_stay_finite(rng):
    """Log gates down to -1e4 (decays that underflow any product) and -1e-12 (a gate
    a hair below 1): chunked == oracle, nothing NaN or inf (no cumulative product)."""
    q, k, v = make_qkv(rng, batch=(2,), n=50, d=4, dv=3)
    g = -np.exp(rng.uniform(np.log(1e-12), np.log(1e4), (2, 50, 4)))
    want, _ = oracle_gated(q, k, v, np.exp(g))
    out = gla_attention(q, k, v, g, chunk_size=16)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=0, atol=atol(want, n=50))
    a = -np.exp(rng.uniform(np.log(1e-12), np.log(1e4), (2, 50)))
    beta = rng.uniform(0, 1, (2, 50))
    want, _ = oracle_delta(unit(q), unit(k), v, beta, np.exp(a))
    out = gated_delta_attention(q, k, v, beta, a, normalize_qk=True, chunk_size=16)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=0, atol=atol(want, n=50))


@pytest.mark.parametrize("name", ["gla", "ssd", "retention", "deltanet", "gated_deltanet"])
def test_masked_tokens_leave_the_state(backend, rng, name):
    """A padded token changes nothing for the others: the outputs at real tokens equal
    those of the sequence with the padding cut out (its k, v may hold NaN)."""
    rec = arrayattn.get_variant(name)
    q, k, v = make_qkv(rng, batch=(2,), n=30, d=6, dv=4)
    keep = np.ones((2, 30), bool)
    keep[:, [3, 4, 17, 29]] = False
    k[~keep], v[~keep] = np.nan, np.inf
    on = backend.asarray
    # the same drawn gates for both calls: draw them for the full length, then cut
    fn, gates = _explicit(rec, q, rng)
    out = backend.to_numpy(fn(on(q), on(k), on(v), *[on(x) for x in gates],
                              key_mask=on(keep)))
    cut = [x[keep].reshape(2, 26, *x.shape[2:]) for x in (q, k, v, *gates)]
    want = fn(*cut)
    np.testing.assert_allclose(out[keep].reshape(2, 26, -1), want, rtol=0, atol=atol(want, n=30))


def _explicit(rec, q, rng):
    """The public function of ``rec`` and gates for ``q``'s tokens."""
    shape = q.shape[:-1]
    if rec.name == "gla":
        return gla_attention, [np.log(rng.uniform(0.6, 1.0, q.shape))]
    if rec.name == "ssd":
        return ssd_attention, [-rng.exponential(0.2, shape)]
    if rec.name == "retention":
        return (lambda q, k, v, **o: retention(q, k, v, gamma=0.9, **o)), []
    if rec.name == "deltanet":
        return (lambda *a, **o: delta_attention(*a, normalize_qk=True, **o)), [
            rng.uniform(0, 1, shape)]
    return (lambda *a, **o: gated_delta_attention(*a, normalize_qk=True, **o)), [
        rng.uniform(0, 1, shape), np.log(rng.uniform(0.5, 1.0, shape))]


@pytest.mark.parametrize("name", ["gla", "ssd", "retention", "deltanet", "gated_deltanet"])
@pytest.mark.parametrize("method", ["chunked", "recurrent"])
def test_causal_bit_for_bit(backend, rng, name, method):
    """Changing the last tokens (keys, values, gates) leaves every earlier output bit
    for bit unchanged."""
    fn, gates = _explicit(arrayattn.get_variant(name), *make_qkv(rng, batch=(2,), n=24,
                                                                 d=6, dv=4)[:1], rng)
    q, k, v = make_qkv(rng, batch=(2,), n=24, d=6, dv=4)
    k2, v2, g2 = k.copy(), v.copy(), [x.copy() for x in gates]
    k2[:, 20:], v2[:, 20:] = 7.0, -3.0
    for x in g2:
        x[:, 20:] = x[:, 20:] * 0.5
    on = backend.asarray
    a = backend.to_numpy(fn(on(q), on(k), on(v), *map(on, gates), method=method,
                            chunk_size=8))
    b = backend.to_numpy(fn(on(q), on(k2), on(v2), *map(on, g2), method=method,
                            chunk_size=8))
    np.testing.assert_array_equal(a[:, :20], b[:, :20])
    assert not np.array_equal(a[:, 20:], b[:, 20:])


@pytest.mark.parametrize("name", ["gla", "ssd", "retention", "deltanet", "gated_deltanet"])
def test_state_and_steps_continue_the_sequence(backend, rng, name):
    """Two calls chained by the state, then decoding steps, equal one call."""
    fn, gates = _explicit(arrayattn.get_variant(name), *make_qkv(rng, batch=(2,), n=20,
                                                                 d=6, dv=4)[:1], rng)
    q, k, v = make_qkv(rng, batch=(2,), n=20, d=6, dv=4)
    on = backend.asarray
    full = backend.to_numpy(fn(on(q), on(k), on(v), *map(on, gates)))
    first = [x[:, :12] for x in (q, k, v, *gates)]
    middle = [x[:, 12:17] for x in (q, k, v, *gates)]
    _, s = fn(*map(on, first), return_state=True)
    out, s = fn(*map(on, middle), initial_state=s, return_state=True)
    tol = atol(full, n=20)
    np.testing.assert_allclose(backend.to_numpy(out), full[:, 12:17], rtol=0, atol=tol)
    for t in range(17, 20):
        kw = {}
        if name in ("gla", "ssd"):
            kw["g_t"] = on(gates[0][:, t])
        elif name == "retention":
            kw["g_t"] = on(np.full(2, np.log(0.9)))
        elif name == "deltanet":
            kw["beta_t"] = on(gates[0][:, t])
        else:
            kw["beta_t"], kw["g_t"] = on(gates[0][:, t]), on(gates[1][:, t])
        o, s = gated_attention_step(on(q[:, t]), on(k[:, t]), on(v[:, t]), s,
                                    normalize_qk=name in ("deltanet", "gated_deltanet"), **kw)
        np.testing.assert_allclose(backend.to_numpy(o), full[:, t], rtol=0, atol=tol)


def test_beta_one_overwrites_the_memory(rng):
    """DeltaNet with unit keys and beta = 1: reading the memory at k_t right after
    writing returns exactly v_t (the delta rule's overwrite)."""
    q, k, v = make_qkv(rng, batch=(2,), n=12, d=8, dv=3)
    k = unit(k)
    out = delta_attention(k, k, v, np.ones((2, 12)))      # queries = keys
    np.testing.assert_allclose(out, v, rtol=0, atol=64 * F64)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), chunk=st.integers(1, 17), seed=st.integers(0, 2**16))
def test_reductions(n, chunk, seed):
    """gate = 1 is unnormalised causal linear attention (identity map); beta = 0 leaves
    the initial state in place; gated DeltaNet with g = 0 is DeltaNet."""
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, batch=(2,), n=n, d=4, dv=3)
    ones = np.zeros((2, n, 4))
    plain = np.tril(q @ k.swapaxes(-1, -2)) @ v
    out = gla_attention(q, k, v, ones, chunk_size=chunk)
    np.testing.assert_allclose(out, plain, rtol=0, atol=atol(plain, n=n))
    s0 = rng.standard_normal((2, 4, 3))
    out, s = delta_attention(q, k, v, np.zeros((2, n)), initial_state=s0, chunk_size=chunk,
                             return_state=True)
    np.testing.assert_allclose(s, s0, rtol=0, atol=0)
    np.testing.assert_allclose(out, q @ s0, rtol=0, atol=atol(out, n=4))
    beta = rng.uniform(0, 1, (2, n))
    a = gated_delta_attention(q, k, v, beta, np.zeros((2, n)), normalize_qk=True,
                              chunk_size=chunk)
    b = delta_attention(q, k, v, beta, normalize_qk=True, chunk_size=chunk)
    np.testing.assert_allclose(a, b, rtol=0, atol=atol(b, n=n))


def test_retention_is_linear_attention_without_denominator(rng):
    """gamma = 1: the numerator of causal linear attention with the identity map."""
    q, k, v = make_qkv(rng, batch=(2,), n=16, d=4, dv=3)
    out = retention(q, k, v, gamma=1.0)
    num = linear_attention(q, k, np.concatenate([v, np.ones((2, 16, 1))], -1),
                           feature_map=lambda x: x, causal=True, eps=0.0)
    ident = np.tril(q @ k.swapaxes(-1, -2)) @ v
    np.testing.assert_allclose(out, ident, rtol=0, atol=atol(ident, n=16))
    assert num.shape == (2, 16, 4)


def test_float16_computed_in_float32(rng):
    q, k, v = (x.astype(np.float16) for x in make_qkv(rng, batch=(2,), n=20, d=8))
    g = np.log(rng.uniform(0.8, 1.0, (2, 20, 8))).astype(np.float16)
    out = gla_attention(q, k, v, g)
    assert out.dtype == np.float16
    want, _ = oracle_gated(*(x.astype(np.float64) for x in (q, k, v)),
                           np.exp(g.astype(np.float64)))
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-3,
                               atol=2e-3 * np.abs(want).max())


def test_errors(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=6, d=4)
    g = np.zeros((2, 6, 4))
    with pytest.raises(ValueError, match="causal=False is not defined"):
        gla_attention(q, k, v, g, causal=False)
    with pytest.raises(ValueError, match="n == s"):
        gla_attention(q, k[:, :5], v[:, :5], g)
    with pytest.raises(ValueError, match=r"g must have shape \(\.\.\., n, dk\)"):
        gla_attention(q, k, v, g[..., :3])
    with pytest.raises(ValueError, match=r"a must have shape \(\.\.\., n\)"):
        ssd_attention(q, k, v, g)
    with pytest.raises(TypeError, match="beta must have a real floating dtype"):
        delta_attention(q, k, v, np.ones((2, 6), int))
    with pytest.raises(ValueError, match="initial_state must have shape"):
        gla_attention(q, k, v, g, initial_state=np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="gamma must be decays"):
        retention(q, k, v, gamma=1.5)
    with pytest.raises(ValueError, match="method must be one of"):
        gla_attention(q, k, v, g, method="cumsum")
    # a positive log gate (a growing state) gives NaN from that token on, not a silent
    # wrong answer
    bad = g.copy()
    bad[0, 3, 0] = 0.5
    out = gla_attention(q, k, v, bad)
    assert np.isnan(out[0, 3:]).any() and np.isfinite(out[0, :3]).all()
    assert np.isfinite(out[1]).all()


def test_empty_sequence(rng):
    q = np.zeros((2, 0, 4))
    out, s = gla_attention(q, q, q, q, return_state=True)
    assert out.shape == (2, 0, 4) and s.shape == (2, 4, 4) and not s.any()


def _fla_naive(path: str):
    """One of fla's ``naive.py`` files (torch + einops only), loaded on its own: fla's
    package ``__init__`` imports Triton, which a CPU machine may not have."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla (fla-core) is not installed")
    pytest.importorskip("einops")
    file = os.path.join(list(spec.submodule_search_locations)[0], "ops", *path.split("/"))
    s = importlib.util.spec_from_file_location("_fla_" + path.replace("/", "_")[:-3], file)
    mod = importlib.util.module_from_spec(s)
    s.loader.exec_module(mod)
    return mod


def test_fla_naive_references(rng):
    """fla 0.6.0's own torch references -- ``naive_recurrent_gla``, ``naive_retention``,
    ``delta_rule_recurrence``, ``naive_recurrent_gated_delta_rule`` -- in their layouts
    ((B, T, H, K) for GLA and gated DeltaNet, (B, H, T, K) for the others) and with
    their scale ``K**-0.5``, against arrayattn on the same float32 inputs.  fla computes
    in float32: the bound is float32 rounding over ``n`` steps."""
    torch = pytest.importorskip("torch")
    n, d = 48, 16
    q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 3), n=n, d=d,
                                                      norm=4.0, sharp=True))
    g = np.log(rng.uniform(0.7, 1.0, (2, 3, n, d))).astype(np.float32)
    gt = np.log(rng.uniform(0.7, 1.0, (2, 3, n))).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (2, 3, n)).astype(np.float32)
    scale = d ** -0.5
    kn = unit(k.astype(np.float64)).astype(np.float32)
    T = lambda x: torch.asarray(np.ascontiguousarray(np.swapaxes(x, 1, 2)))  # noqa: E731
    H = lambda x: torch.asarray(x)  # noqa: E731

    def close(ours, theirs):
        theirs = np.asarray(theirs, dtype=np.float64)
        bound = 64 * n * F32 * max(1.0, float(np.abs(theirs).max()))
        np.testing.assert_allclose(np.asarray(ours, dtype=np.float64), theirs, rtol=0,
                                   atol=bound)
        return float(np.abs(np.asarray(ours, dtype=np.float64) - theirs).max())

    errors = {}
    gla = _fla_naive("gla/naive.py").naive_recurrent_gla(T(q), T(k), T(v), T(g))[0]
    errors["gla"] = close(gla_attention(q, k, v, g, scale=scale),
                          np.swapaxes(gla.numpy(), 1, 2))
    ret = _fla_naive("retention/naive.py").naive_retention(H(q), H(k), H(v))
    errors["retention"] = close(retention(q, k, v, scale=scale), ret.numpy())
    dr = _fla_naive("delta_rule/naive.py").delta_rule_recurrence(H(q), H(kn), H(v), H(beta))[0]
    errors["deltanet"] = close(delta_attention(q, kn, v, beta, scale=scale), dr.numpy())
    gdr = _fla_naive("gated_delta_rule/naive.py").naive_recurrent_gated_delta_rule(
        T(q), T(kn), T(v), T(beta), T(gt))[0]
    errors["gated_deltanet"] = close(gated_delta_attention(q, kn, v, beta, gt, scale=scale),
                                     np.swapaxes(gdr.numpy(), 1, 2))
    print("fla naive vs arrayattn, max abs difference:", errors)
