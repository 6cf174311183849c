"""rfa_features / rfa_attention against plain float64 oracles of the same definitions.

The oracles below compute the features row by row and the attention pair by pair (the
gated weights as explicit products of gates), in float64 from the inputs as the backend
holds them (rounded to float32 first for float32 runs).  Tolerances are rounding bounds
(see ``_atol``): the sin/cos features are signed, so the error of a row is amplified by
the cancellation ``sum_j |w_ij K_ij| (|v_j| + |o_i|) / |den_i|`` of that row, which the
oracle measures.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import (RandomFeatures, rfa_attention, rfa_features, softmax_attention)
from arrayattn.testing import xp_assert_close, xp_assert_equal, xp_assert_kind

from conftest import get_backend, make_qkv

F64 = float(np.finfo(np.float64).eps)
EPS = {"float64": F64, "float32": float(np.finfo(np.float32).eps)}


# ---------------------------------------------------------------------------------
# Oracles (plain loops, float64)
# ---------------------------------------------------------------------------------

def phi(x, omega, sigma):
    """φ(x̂) = m^-1/2 [sin(ω x̂/σ), cos(ω x̂/σ)], one row at a time."""
    m = omega.shape[0]
    out = np.zeros((*x.shape[:-1], 2 * m))
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        norm = math.sqrt(sum(float(a) * float(a) for a in row))
        xh = row / norm if norm > 0 else row
        for f in range(m):
            t = float(np.dot(omega[f], xh)) / sigma
            out[idx + (f,)] = math.sin(t) / math.sqrt(m)
            out[idx + (m + f,)] = math.cos(t) / math.sqrt(m)
    return out


def oracle(q, k, v, omega, sigma, *, causal=False, key_mask=None, gate=None):
    """Dense RFA: o_i = sum_j w_ij K_ij v_j / sum_j w_ij K_ij, K_ij = φ(q̂_i)·φ(k̂_j),
    w_ij = 1 (ungated) or (1 - g_j) prod_{j < l <= i} g_l over unmasked l (gated).

    Returns the output and per-row cancellation ``cond_i = sum_j |w_ij K_ij| (|v_j|_max
    + |o_i|_max) / |den_i|`` (0 for a zero row)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                () if key_mask is None else key_mask.shape[:-1],
                                () if gate is None else gate.shape[:-1])
    n, s, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    q, k, v = (np.broadcast_to(x, (*batch, *x.shape[-2:])) for x in (q, k, v))
    km = np.ones((*batch, s), bool) if key_mask is None else np.broadcast_to(key_mask,
                                                                            (*batch, s))
    if gate is not None:
        gate = np.broadcast_to(gate, (*batch, n))
    fq, fk = phi(q, omega, sigma), phi(k, omega, sigma)
    out = np.zeros((*batch, n, dv))
    cond = np.zeros((*batch, n))
    for b in np.ndindex(*batch):
        for i in range(n):
            num, den, terms = np.zeros(dv), 0.0, []
            for j in range(s):
                if not km[b][j] or (causal and j > i + s - n):
                    continue
                w = 1.0
                if gate is not None:
                    w = 1.0 - gate[b][j]
                    for l in range(j + 1, i + 1):
                        if km[b][l]:
                            w *= gate[b][l]
                kij = w * float(np.dot(fq[b][i], fk[b][j]))
                num = num + kij * v[b][j]
                den += kij
                terms.append((w * float(np.dot(np.abs(fq[b][i]), np.abs(fk[b][j]))),
                              np.abs(v[b][j]).max()))
            if den != 0:
                out[b][i] = num / den
                o = np.abs(out[b][i]).max()
                cond[b][i] = sum(a * (vm + o) for a, vm in terms) / abs(den)
    return out, cond


def _atol(dtype, cond, *, d, m, s, omega, sigma, chunk=64, gated=False):
    """Rounding bound per row.  A feature's argument [x̂, 1]·[ω/σ, a] carries
    ~(1.5 d + 5) u (‖ω‖/σ + 2) from the normalisation and the dot product; a product
    φq·φk adds gamma_2m, the sums over keys gamma_s and the chunks gamma_c; gated weights
    (1 - g_j) e^{E_ij} carry ~n u |E_ij| e^{E_ij} <= n u / e.  Times the row's
    cancellation (oracle's cond), times 2 for second-order terms."""
    wmax = float(np.linalg.norm(omega, axis=-1).max()) / sigma
    kappa = 2 * (1.5 * d + 5) * (wmax + 2) + 2 * m + s + chunk + (s if gated else 0) + 16
    return 2 * EPS[dtype] * kappa * cond


def _check(out, ref, atol, backend):
    got = backend.to_numpy(out).astype(np.float64)
    assert got.shape == ref.shape
    err = np.abs(got - ref).max(axis=-1)
    bad = err > atol
    assert not bad.any(), (f"{bad.sum()} rows exceed the bound: worst err "
                           f"{err[bad].max():.3g} vs atol {atol[bad].min():.3g}")


def _rounded(dtype, *arrays):
    """The inputs as the backend holds them, back in float64 (for the oracle)."""
    return [np.asarray(a, dtype=dtype).astype(np.float64) for a in arrays]


# ---------------------------------------------------------------------------------

class TestRFAFeatures:
    @pytest.mark.parametrize("dtype", ["float64", "float32"])
    def test_matches_oracle(self, backend, rng, dtype):
        x = rng.standard_normal((2, 5, 6)) * 4
        x[0, 1] = 0.0                                  # a zero row stays at the origin
        f = RandomFeatures.draw(6, 10, projection="iid", seed=3)
        out = rfa_features(backend.asarray(x, dtype), f, sigma=0.6)
        xp_assert_kind(out, backend.asarray(np.zeros((2, 5, 20)), dtype))
        (xr,) = _rounded(dtype, x)
        ref = phi(xr, f.omega, 0.6)
        wmax = np.linalg.norm(f.omega, axis=-1).max() / 0.6
        atol = 2 * EPS[dtype] * (1.5 * 6 + 5) * (wmax + 2) / math.sqrt(10)
        np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=0, atol=atol)

    def test_unbiased_gaussian_kernel_clt(self):
        # E[φ(x̂)·φ(ŷ)] = exp(-‖x̂ - ŷ‖²/(2σ²)).  Each of the m rows gives cos(w·(x̂ - ŷ))
        # with variance ½(1 - e^{-‖δ‖²/σ²})², so the mean over R seeds of the m-row
        # estimate has standard deviation sqrt(var / (m R)); fixed seeds 0..R-1, bound 5
        # standard deviations (P(fail) < 1e-5 per pair).
        rng = np.random.default_rng(7)
        d, m, reps, sigma = 8, 32, 300, 0.7
        x = rng.standard_normal((6, d))
        y = rng.standard_normal((6, d))
        y[0] = x[0] * 3.0                              # δ = 0: the estimate is exactly 1
        y[1] = x[1] + 0.1 * rng.standard_normal(d)
        xh = x / np.linalg.norm(x, axis=-1, keepdims=True)
        yh = y / np.linalg.norm(y, axis=-1, keepdims=True)
        dist2 = np.sum((xh - yh) ** 2, axis=-1)
        est = np.zeros((reps, 6))
        for r in range(reps):
            f = RandomFeatures.draw(d, m, projection="iid", seed=r)
            est[r] = np.sum(rfa_features(x, f, sigma=sigma) * rfa_features(y, f, sigma=sigma),
                            axis=-1)
        target = np.exp(-dist2 / (2 * sigma ** 2))
        sd = np.sqrt(0.5 * (1 - np.exp(-dist2 / sigma ** 2)) ** 2 / (m * reps))
        assert np.all(np.abs(est.mean(0) - target) <= 5 * sd + 1e-14), (est.mean(0), target)
        # The bound discriminates: the other convention (w = ω σ) has mean
        # exp(-σ² ‖δ‖²/2), far outside it for the distant pairs.
        wrong = np.exp(-sigma ** 2 * dist2 / 2)
        assert np.any(np.abs(est.mean(0) - wrong) > 20 * sd)
        # and the empirical variance matches the closed form (within 25 %, R = 300)
        far = dist2 > 0.5
        np.testing.assert_allclose(est.var(0)[far], (sd ** 2 * reps)[far], rtol=0.25)


class TestRFAAttention:
    @pytest.mark.parametrize("dtype", ["float64", "float32"])
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("case", ["gaussian", "sharp"])
    def test_matches_oracle(self, backend, rng, dtype, causal, case):
        # sharp: queries aimed at keys, norms 8, σ = 0.4 (scale 1/σ² = 6.25 on unit
        # vectors): peaked attention, where the signed estimate cancels most.
        d, m, sigma = 16, 24, (1.0 if case == "gaussian" else 0.4)
        q, k, v = make_qkv(rng, batch=(2,), n=20, s=27, d=d, dv=3,
                           norm=None if case == "gaussian" else 8.0, sharp=case == "sharp")
        km = rng.random((2, 27)) < 0.8
        f = RandomFeatures.draw(d, m, projection="iid", seed=5)
        out = rfa_attention(*(backend.asarray(x, dtype) for x in (q, k, v)), features=f,
                            sigma=sigma, causal=causal, key_mask=backend.asarray(km),
                            chunk_size=8)
        xp_assert_kind(out, backend.asarray(np.zeros((2, 20, 3)), dtype))
        qr, kr, vr = _rounded(dtype, q, k, v)
        ref, cond = oracle(qr, kr, vr, f.omega, sigma, causal=causal, key_mask=km)
        _check(out, ref, _atol(dtype, cond, d=d, m=m, s=27, omega=f.omega, sigma=sigma,
                               chunk=8)[..., None].max(-1), backend)

    @pytest.mark.parametrize("dtype", ["float64", "float32"])
    @pytest.mark.parametrize("chunk", [7, 64])
    def test_gated_chunked_recurrent_oracle(self, backend, rng, dtype, chunk):
        # n = 45 is not a multiple of 7; gates include the endpoints 0 (restart) and 1
        # (skip), and masked keys.
        d, m, n, sigma = 8, 16, 45, 0.8
        q, k, v = make_qkv(rng, batch=(2,), n=n, s=n, d=d, dv=3)
        gate = rng.uniform(0.05, 0.99, size=(2, n))
        gate[0, 11], gate[1, 30], gate[0, 20] = 0.0, 0.0, 1.0
        km = rng.random((2, n)) < 0.8
        f = RandomFeatures.draw(d, m, projection="iid", seed=2)
        args = [backend.asarray(x, dtype) for x in (q, k, v)]
        opts = dict(features=f, sigma=sigma, causal=True, gate=backend.asarray(gate, dtype),
                    key_mask=backend.asarray(km), chunk_size=chunk)
        chunked = rfa_attention(*args, **opts)
        # (the recurrent form does not depend on the chunk size: run it once)
        recurrent = rfa_attention(*args, method="recurrent", **opts) if chunk == 7 else None
        qr, kr, vr, gr = _rounded(dtype, q, k, v, gate)
        ref, cond = oracle(qr, kr, vr, f.omega, sigma, causal=True, key_mask=km, gate=gr)
        atol = _atol(dtype, cond, d=d, m=m, s=n, omega=f.omega, sigma=sigma, chunk=chunk,
                     gated=True)
        _check(chunked, ref, atol, backend)
        if recurrent is not None:
            _check(recurrent, ref, atol, backend)
            xp_assert_kind(chunked, recurrent)

    def test_equals_gaussian_kernel_softmax_in_the_limit(self, rng):
        # E[φ(q̂)·φ(k̂)] ∝ exp(q̂·k̂/σ²): with many features the output approaches softmax
        # attention of the normalised inputs at scale 1/σ², and the error falls with m.
        q, k, v = make_qkv(rng, batch=(2,), n=32, s=32, d=8, dv=3)
        qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
        kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
        ref = softmax_attention(qn, kn, v, scale=4.0)
        errs = [np.abs(rfa_attention(q, k, v, num_features=m, sigma=0.5, seed=1) - ref).mean()
                for m in (64, 4096)]
        assert errs[1] < errs[0] / 4 and errs[1] < 0.05, errs

    def test_gated_rows_sum_to_one(self, backend, rng):
        # Constant values come back unchanged wherever the denominator is non-zero.
        q, k, _ = make_qkv(rng, batch=(3,), n=50, s=50, d=8)
        gate = backend.asarray(rng.uniform(0.2, 0.95, size=(3, 50)))
        out = rfa_attention(backend.asarray(q), backend.asarray(k),
                            backend.asarray(np.full((3, 50, 2), 2.5)), causal=True,
                            gate=gate, chunk_size=16)
        xp_assert_close(out, backend.asarray(np.full((3, 50, 2), 2.5)), rtol=64 * 50 * F64)

    @pytest.mark.parametrize("gated", [False, True])
    def test_future_never_changes_past(self, backend, rng, gated):
        # Changing keys, values (and gates) at positions >= 40 leaves rows < 40 bit for
        # bit unchanged, in every causal form; chunk 16 puts 40 inside a chunk.
        q, k, v = make_qkv(rng, batch=(2,), n=70, s=70, d=8, dv=3)
        gate = rng.uniform(0.1, 0.9, size=(2, 70))
        k2, v2, g2 = k.copy(), v.copy(), gate.copy()
        k2[:, 40:] *= 1e4
        v2[:, 40:] = 1e6
        g2[:, 40:] = 0.999
        methods = ["chunked", "recurrent"] + ([] if gated else ["cumsum"])
        for method in methods:
            def run(kk, vv, gg):
                return rfa_attention(*(backend.asarray(x, "float32") for x in (q, kk, vv)),
                                     causal=True, num_features=16, chunk_size=16,
                                     method=method,
                                     gate=backend.asarray(gg, "float32") if gated else None)
            a, b = run(k, v, gate), run(k2, v2, g2)
            xp_assert_equal(a[:, :40, :], b[:, :40, :])

    def test_gated_long_sequence_no_overflow(self, rng):
        # g = 0.5 over 4096 tokens: the product of all gates is 2^-4096 (0 in float64),
        # yet every factor of the chunked scan is <= 1: finite, and the first rows equal
        # the short sequence's.
        q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(1,), n=4096, s=4096,
                                                            d=8, dv=2))
        gate = np.full((1, 4096), 0.5, dtype=np.float32)
        out = rfa_attention(q, k, v, gate=gate, causal=True, num_features=16)
        assert np.isfinite(out).all()
        short = rfa_attention(q[:, :100], k[:, :100], v[:, :100], gate=gate[:, :100],
                              causal=True, num_features=16)
        np.testing.assert_allclose(out[:, :100], short, rtol=0, atol=1e-5)

    def test_gate_semantics(self, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=30, s=30, d=8, dv=3)
        gate = rng.uniform(0.3, 0.95, size=(2, 30))
        f = RandomFeatures.draw(8, 16, projection="iid", seed=1)
        run = lambda qq, kk, vv, gg, **o: rfa_attention(  # noqa: E731
            qq, kk, vv, gate=gg, causal=True, features=f, chunk_size=8, **o)
        full = run(q, k, v, gate)
        # g_t = 0 restarts: rows >= t equal the run on the suffix from t.
        g0 = gate.copy()
        g0[:, 12] = 0.0
        np.testing.assert_allclose(run(q, k, v, g0)[:, 12:],
                                   run(q[:, 12:], k[:, 12:], v[:, 12:], g0[:, 12:]),
                                   rtol=0, atol=1e-11)
        # A masked key is skipped: rows at real positions equal the run with the masked
        # tokens deleted.
        km = np.ones((2, 30), bool)
        km[:, [3, 17, 18]] = False
        keep = np.flatnonzero(km[0])
        np.testing.assert_allclose(
            run(q, k, v, gate, key_mask=km)[:, keep],
            run(q[:, keep], k[:, keep], v[:, keep], gate[:, keep]), rtol=0, atol=1e-11)
        # Broadcasting: (..., 1) and a float are one gate for every position; a gate
        # (n,) is shared by the batch.
        const = np.full((2, 30), 0.7)
        ref = run(q, k, v, const)
        np.testing.assert_allclose(run(q, k, v, np.full((2, 1), 0.7)), ref, rtol=0,
                                   atol=1e-14)
        np.testing.assert_allclose(run(q, k, v, 0.7), ref, rtol=0, atol=1e-14)
        np.testing.assert_allclose(run(q, k, v, gate[0]), run(q, k, v, gate[[0, 0]]),
                                   rtol=0, atol=1e-14)
        assert not np.allclose(full, ref)

    def test_padding_may_hold_nan(self, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=12, s=12, d=8, dv=3)
        km = np.ones((2, 12), bool)
        km[:, -3:] = False
        k2, v2 = k.copy(), v.copy()
        k2[:, -3:], v2[:, -3:] = np.nan, np.inf
        for opts in ({}, {"causal": True}, {"causal": True, "gate": np.full((2, 12), 0.8)}):
            a = rfa_attention(q, k, v, key_mask=km, **opts)
            b = rfa_attention(q, k2, v2, key_mask=km, **opts)
            xp_assert_equal(a, b)

    @pytest.mark.parametrize("method", ["chunked", "recurrent"])
    def test_out_of_range_gate_poisons_from_its_position(self, backend, rng, method):
        q, k, v = make_qkv(rng, batch=(1,), n=20, s=20, d=8, dv=2)
        gate = rng.uniform(0.2, 0.9, size=(1, 20))
        for bad in (1.5, -0.1, np.nan):
            g = gate.copy()
            g[0, 10] = bad
            out = backend.to_numpy(rfa_attention(
                *(backend.asarray(x) for x in (q, k, v)), causal=True,
                gate=backend.asarray(g), chunk_size=7, method=method))
            assert np.isfinite(out[:, :10]).all() and np.isnan(out[:, 10:]).all()

    def test_seeds_reproduce_on_every_backend(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=24, s=24, d=8, dv=3)
        ref = rfa_attention(q, k, v, num_features=32, seed=11)
        xs = [backend.asarray(x) for x in (q, k, v)]
        for opts in ({}, {"causal": True}, {"causal": True, "gate": 0.8}):
            ref = rfa_attention(q, k, v, num_features=32, seed=11, **opts)
            out = rfa_attention(*xs, num_features=32, seed=11, **opts)
            np.testing.assert_allclose(backend.to_numpy(out), ref, rtol=0, atol=1e-12)
            again = rfa_attention(*xs, num_features=32, seed=11, **opts)
            xp_assert_equal(out, again)
            f = RandomFeatures.from_matrix(RandomFeatures.draw(8, 32, projection="iid",
                                                               seed=11).omega)
            xp_assert_equal(rfa_attention(*xs, features=f, **opts), out)
            other = rfa_attention(*xs, num_features=32, seed=12, **opts)
            assert np.abs(backend.to_numpy(other) - ref).max() > 1e-3

    def test_errors(self, rng):
        q, k, v = make_qkv(rng, batch=(), n=4, s=6, d=4)
        with pytest.raises(ValueError, match="causal=True"):
            rfa_attention(q, k, v, gate=np.full(6, 0.5))
        with pytest.raises(ValueError, match="n = s"):
            rfa_attention(q, k, v, gate=np.full(6, 0.5), causal=True)
        with pytest.raises(ValueError, match="sigma"):
            rfa_attention(q, k, v, sigma=0.0)
        with pytest.raises(ValueError, match="sigma"):
            rfa_attention(q, k, v, sigma=float("inf"))
        q, k, v = make_qkv(rng, batch=(2,), n=6, s=6, d=4)
        with pytest.raises(ValueError, match=r"gate must have shape \(\.\.\., n\)"):
            rfa_attention(q, k, v, gate=np.full((2, 5), 0.5), causal=True)
        with pytest.raises(ValueError, match="gate"):
            rfa_attention(q, k, v, gate=np.full((3, 6), 0.5), causal=True)   # batch
        with pytest.raises(ValueError, match=r"\[0, 1\]"):
            rfa_attention(q, k, v, gate=1.5, causal=True)
        with pytest.raises(TypeError, match="gate"):
            rfa_attention(q, k, v, gate=np.ones((2, 6), dtype=np.int64), causal=True)
        with pytest.raises(ValueError, match="method"):
            rfa_attention(q, k, v, gate=0.5, causal=True, method="cumsum")
        with pytest.raises(ValueError, match="d=4"):
            rfa_attention(q, k, v, features=np.ones((3, 5)))
        torch = get_backend("torch")
        with pytest.raises((TypeError, ValueError), match="gate"):
            rfa_attention(q, k, v, gate=torch.asarray(np.full((2, 6), 0.5)), causal=True)
