"""RandomFeatures, the feature maps, estimate_kernel and kernel_variance.

Statistical tests use fixed seeds and tolerances derived from the statistics (CLT
bounds of 5 standard errors), never tuned to pass.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import RandomFeatures, estimate_kernel, gerf_parameter, kernel_variance
from arrayattn.testing import xp_assert_close

from conftest import make_qkv

KINDS = ["positive", "hyperbolic", "trig"]
F64 = float(np.finfo(np.float64).eps)
F32 = float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------------------------
# float64 oracle of the same definition, written plainly
# ---------------------------------------------------------------------------------

def oracle_features(x, omega, kind, scale, sign=1.0, gerf_a=None):
    """``φ(x)`` straight from the formulas, in float64 (no stabilisation)."""
    x = np.asarray(x, dtype=np.float64) * math.sqrt(abs(scale)) * sign
    m, d = omega.shape
    proj = x @ omega.T
    h = np.sum(x * x, axis=-1, keepdims=True) / 2
    if kind == "positive":
        return np.exp(proj - h) / math.sqrt(m)
    if kind == "favor++":
        a = gerf_a
        return ((1 - 4 * a) ** (d / 4) * np.exp(a * np.sum(omega ** 2, axis=1)
                                                 + math.sqrt(1 - 4 * a) * proj - h)
                / math.sqrt(m))
    if kind == "relu":
        return np.maximum(proj, 0) / math.sqrt(m)
    if callable(kind):
        return kind(proj) / math.sqrt(m)
    if kind == "hyperbolic":
        return np.concatenate([np.exp(proj - h), np.exp(-proj - h)], -1) / math.sqrt(2 * m)
    return np.concatenate([np.sin(proj), np.cos(proj)], -1) * np.exp(h) / math.sqrt(m)


def oracle_kernel(q, k, omega, kind, scale, gerf_a=None):
    sign = -1.0 if scale < 0 else 1.0
    fq = oracle_features(q, omega, kind, scale, sign, gerf_a)
    fk = oracle_features(k, omega, kind, scale, 1.0, gerf_a)
    return fq @ np.swapaxes(fk, -1, -2)


def exponent_bound(x, omega, scale, gerf_a=None):
    """Largest |exponent| ``B‖ω_f‖‖x̃‖ + ‖x̃‖²/2 (+ |A|‖ω_f‖²)``: rounding of the exponents."""
    xn = np.linalg.norm(x, axis=-1).max() * math.sqrt(abs(scale))
    wn = np.linalg.norm(omega, axis=-1).max()
    if gerf_a is None:
        return wn * xn + xn * xn / 2
    return math.sqrt(1 - 4 * gerf_a) * wn * xn + xn * xn / 2 + abs(gerf_a) * wn * wn


# ---------------------------------------------------------------------------------
# RandomFeatures
# ---------------------------------------------------------------------------------

class TestRandomFeatures:
    def test_shapes_and_reproducible(self):
        a = RandomFeatures.draw(8, 20, seed=3)
        b = RandomFeatures.draw(8, 20, seed=3)
        c = RandomFeatures.draw(8, 20, seed=4)
        assert a.omega.shape == (20, 8) and (a.m, a.d) == (20, 8)
        np.testing.assert_array_equal(a.omega, b.omega)
        assert not np.array_equal(a.omega, c.omega)
        assert "m=20" in repr(a) and "orthogonal" in repr(a)

    def test_immutable(self):
        f = RandomFeatures.draw(4, 4)
        with pytest.raises(ValueError):
            f.omega[0, 0] = 1.0
        with pytest.raises(AttributeError):
            f.seed = 3
        # The cache is not shared with the caller's copy either.
        g = RandomFeatures.from_matrix(f.omega)
        assert g.omega is not f.omega

    @pytest.mark.parametrize("m", [4, 10, 13])
    def test_orthogonal_blocks(self, m):
        d = 4
        f = RandomFeatures.draw(d, m, projection="orthogonal", norms="chi", seed=1)
        u = f.omega / np.linalg.norm(f.omega, axis=1, keepdims=True)
        for b0 in range(0, m, d):
            blk = u[b0:b0 + d]
            np.testing.assert_allclose(blk @ blk.T, np.eye(len(blk)), atol=64 * F64)
        # Different blocks are independent draws, not orthogonal to each other.
        if m > d:
            assert np.abs(u[:d] @ u[d:2 * d].T).max() > 1e-3

    def test_haar_sign_fix(self):
        # Without Q diag(sign(diag R)), LAPACK's QR gives Q_ii < 0 in mean (about -0.2
        # at d = 4, ~20 standard errors away); a Haar matrix has E[Q_ii] = 0.
        d, reps = 4, 500
        diag = np.array([np.diag(RandomFeatures.draw(d, d, norms="fixed", seed=s).omega)
                         for s in range(reps)]) / math.sqrt(d)
        se = diag.std() / math.sqrt(diag.size)
        assert abs(diag.mean()) < 5 * se
        # Uniform directions: E[u u^T] = I/d, checked entrywise within 5 SE.
        u = np.concatenate([RandomFeatures.draw(d, d, norms="fixed", seed=s).omega
                            for s in range(reps)]) / math.sqrt(d)
        outer = u[:, :, None] * u[:, None, :]
        se = outer.std(axis=0) / math.sqrt(len(u))
        assert np.all(np.abs(outer.mean(axis=0) - np.eye(d) / d) < 5 * se + 1e-12)

    @pytest.mark.parametrize("projection", ["iid", "orthogonal"])
    def test_chi_norms(self, projection):
        # ‖ω‖² ~ chi²_d: mean d, variance 2d; over 4096 rows within 5 SE.
        d, m = 6, 4096
        f = RandomFeatures.draw(d, m, projection=projection, norms="chi", seed=2)
        sq = np.sum(f.omega ** 2, axis=1)
        assert abs(sq.mean() - d) < 5 * math.sqrt(2 * d / m)
        assert abs(sq.var() - 2 * d) < 5 * math.sqrt((8 * d * (d + 6) + 8 * d * d) / m) + 0.5

    @pytest.mark.parametrize("projection", ["iid", "orthogonal"])
    def test_fixed_and_quasi_norms(self, projection):
        from scipy.stats import chi
        d, m = 5, 12
        f = RandomFeatures.draw(d, m, projection=projection, norms="fixed", seed=0)
        np.testing.assert_allclose(np.linalg.norm(f.omega, axis=1), math.sqrt(d),
                                   rtol=16 * F64)
        g = RandomFeatures.draw(d, m, projection=projection, norms="quasi", seed=0)
        radii = np.linalg.norm(g.omega, axis=1)
        np.testing.assert_allclose(np.sort(radii), chi.ppf((np.arange(m) + 0.5) / m, d),
                                   rtol=16 * F64)
        assert not np.all(np.diff(radii) > 0)  # randomly permuted, not sorted

    def test_from_matrix_replays(self, backend):
        omega = np.random.default_rng(0).standard_normal((5, 3))
        f = RandomFeatures.from_matrix(backend.asarray(omega, "float64"))
        np.testing.assert_array_equal(f.omega, omega)
        assert (f.projection, f.norms, f.seed) == ("given", "given", None)
        assert RandomFeatures.from_matrix(f) is f

    @pytest.mark.parametrize("bad, exc, msg", [
        (np.ones(3), ValueError, "2-D"),
        (np.ones((0, 3)), ValueError, "non-empty"),
        (np.array([[1.0, np.nan]]), ValueError, "non-finite"),
        (np.ones((3, 2), dtype=complex), TypeError, "real"),
    ])
    def test_from_matrix_errors(self, bad, exc, msg):
        with pytest.raises(exc, match=msg):
            RandomFeatures.from_matrix(bad)

    @pytest.mark.parametrize("kwargs, exc, msg", [
        (dict(projection="haar"), ValueError, "projection"),
        (dict(norms="unit"), ValueError, "norms"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(seed=None), TypeError, "seed"),
    ])
    def test_draw_errors(self, kwargs, exc, msg):
        with pytest.raises(exc, match=msg):
            RandomFeatures.draw(4, 8, **kwargs)
        # an absurd size fails up front (an orthogonal draw would loop ~1e10 QR blocks)
        with pytest.raises(ValueError, match=r"num_features \(m\) = 1000000000000"):
            RandomFeatures.draw(64, 10**12)
        with pytest.raises(ValueError, match="m must be >= 1"):
            RandomFeatures.draw(4, 0)


# ---------------------------------------------------------------------------------
# estimate_kernel: the same definition as the oracle, on every backend
# ---------------------------------------------------------------------------------

class TestEstimateKernel:
    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_matches_oracle(self, backend, rng, kind, dtype):
        q, k, _ = make_qkv(rng, batch=(2,), n=37, s=45, d=8, norm=3.0)
        f = RandomFeatures.draw(8, 20, seed=5)
        scale = 1 / math.sqrt(8)
        ref = oracle_kernel(q, k, f.omega, kind, scale)
        out = estimate_kernel(backend.asarray(q, dtype), backend.asarray(k, dtype), f,
                              kind=kind)
        # Each exponent carries ~ d u A of rounding (A its magnitude), then m terms are
        # summed: relative error <= eps (2 d A + m + 8) of the sum of |terms|.
        eps = F32 if dtype == "float32" else F64
        a = exponent_bound(q, f.omega, scale) + exponent_bound(k, f.omega, scale)
        mag = np.abs(oracle_features(q, f.omega, kind, scale)) @ np.swapaxes(
            np.abs(oracle_features(k, f.omega, kind, scale)), -1, -2)
        tol = eps * (2 * 8 * a + 2 * 20 + 8) * mag
        err = np.abs(backend.to_numpy(out) - ref)
        assert np.all(err <= tol), (err / tol).max()
        assert out.dtype == backend.dtype(dtype)

    @pytest.mark.parametrize("kind", KINDS)
    def test_negative_and_custom_scale(self, rng, kind):
        q, k, _ = make_qkv(rng, batch=(), n=3, s=4, d=4)
        f = RandomFeatures.draw(4, 8, projection="iid", seed=1)
        for scale in (0.3, -0.3, 0.0):
            np.testing.assert_allclose(estimate_kernel(q, k, f, kind=kind, scale=scale),
                                       oracle_kernel(q, k, f.omega, kind, scale),
                                       rtol=1e-12, atol=1e-14)

    @pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
    def test_large_norms_float32(self, kind):
        # ‖x̃‖ = 9 with q ⟂ k: the features span e^{-130}..e^{+30} (far outside float32
        # when taken one by one), the estimate ~1e-20 is representable; computed as
        # (b_q b_k^T) exp(l_q + l_k) it is finite and within the rounding bound.
        d = 16
        e = np.eye(d)
        q, k = e[:1] * 18.0, e[1:2] * 18.0
        f = RandomFeatures.draw(d, 64, seed=0)
        scale = 1 / 4
        est = estimate_kernel(q.astype(np.float32), k.astype(np.float32), f, kind=kind)
        ref = oracle_kernel(q, k, f.omega, kind, scale)
        a = exponent_bound(q, f.omega, scale) + exponent_bound(k, f.omega, scale)
        assert np.isfinite(est).all() and np.all(est > 0)
        np.testing.assert_allclose(est, ref, rtol=F32 * (2 * d * a + 2 * 64 + 8))

    def test_wrong_dimension(self, rng):
        q, k, _ = make_qkv(rng, batch=(), n=3, s=4, d=4)
        with pytest.raises(ValueError, match="d=5"):
            estimate_kernel(q, k, RandomFeatures.draw(5, 8))
        with pytest.raises(ValueError, match="kind"):
            estimate_kernel(q, k, RandomFeatures.draw(4, 8), kind="relu!")


# ---------------------------------------------------------------------------------
# Statistics: unbiasedness, variance, orthogonal < iid
# ---------------------------------------------------------------------------------

def _pairs(d=8, norm=2.0, count=4, seed=11, special=True):
    """A few (q, k) pairs at moderate norm; with ``special`` pair 0 has k = q, pair 1 k = -q
    (there the positive/hyperbolic resp. trig estimates are exact for every ω)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((count, d))
    k = rng.standard_normal((count, d))
    if special:
        k[0] = q[0]
        k[1] = -q[1]
    q = q / np.linalg.norm(q, axis=1, keepdims=True) * norm
    k = k / np.linalg.norm(k, axis=1, keepdims=True) * norm
    return q, k


def _estimates(q, k, *, reps, m, kind="positive", projection="iid", norms="chi",
               gerf_a=None):
    """``(reps, pairs)`` diagonal kernel estimates over seeds 0..reps-1, and the largest
    rounding error bound of an estimate (eps (2 d A + 2 m + 8) times the sum of |terms|)."""
    d = q.shape[1]
    out = np.empty((reps, len(q)))
    slack = np.zeros(len(q))
    for s in range(reps):
        f = RandomFeatures.draw(d, m, projection=projection, norms=norms, seed=s)
        out[s] = np.diagonal(estimate_kernel(q, k, f, kind=kind, gerf_a=gerf_a))
        a = exponent_bound(q, f.omega, 1 / math.sqrt(d), gerf_a) + exponent_bound(
            k, f.omega, 1 / math.sqrt(d), gerf_a)
        mag = np.sum(np.abs(oracle_features(q, f.omega, kind, 1 / math.sqrt(d), 1.0, gerf_a))
                     * np.abs(oracle_features(k, f.omega, kind, 1 / math.sqrt(d), 1.0, gerf_a)),
                     axis=1)
        slack = np.maximum(slack, F64 * (2 * d * a + 2 * m + 8) * mag)
    return out, slack


class TestStatistics:
    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("projection", ["iid", "orthogonal"])
    def test_unbiased(self, kind, projection):
        q, k = _pairs()
        est, slack = _estimates(q, k, reps=1500, m=8, kind=kind, projection=projection)
        truth = np.exp(np.sum(q * k, axis=1) / math.sqrt(8))
        se = est.std(axis=0, ddof=1) / math.sqrt(len(est))
        # (pairs 0/1 make some estimates exact for every ω: se ~ 0, hence the rounding
        # slack of one estimate.)
        assert np.all(np.abs(est.mean(axis=0) - truth) <= 5 * se + slack), (
            (est.mean(axis=0) - truth) / se)

    @pytest.mark.parametrize("kind", KINDS)
    def test_variance_matches_lemma_2(self, kind):
        q, k = _pairs(norm=1.5)
        reps, m = 3000, 4
        est, slack = _estimates(q, k, reps=reps, m=m, kind=kind, projection="iid")
        var = np.diagonal(kernel_variance(q, k, num_features=m, kind=kind))
        # Sampling error of a sample variance: sqrt((mu4 - sigma^4) / R); rounding of
        # the estimates adds at most slack^2 (and the formula's own rounding).
        c = est - est.mean(axis=0)
        se = np.sqrt(((c ** 4).mean(axis=0) - c.var(axis=0) ** 2) / reps)
        assert np.all(np.abs(c.var(axis=0, ddof=1) - var) <= 5 * se + slack ** 2
                      + 1e-12 * np.exp(2 * np.sum(q * k, axis=1) / math.sqrt(8))), (
            (c.var(axis=0, ddof=1) - var) / se)

    def test_variance_formula_small_case(self):
        # Positive, x = y: Var = (e^{‖2x‖²} - 1) e^{2‖x‖²} / m.
        x = np.array([[0.3, -0.4]])
        v = kernel_variance(x, x, num_features=3, scale=1.0)
        assert np.isclose(v[0, 0], np.expm1(1.0) * np.exp(0.5) / 3, rtol=1e-14)

    @pytest.mark.parametrize("kind", KINDS)
    def test_orthogonal_beats_iid(self, kind):
        # At m = d, the MSE of orthogonal rows (empirical, R seeds) is below the exact
        # iid variance (Lemma 2, tested above) by more than 5 standard errors (the ratio
        # MSE / Var_iid averaged over the pairs, per seed).
        d = m = 16
        q, k = _pairs(d=d, norm=1.5, count=4, special=False)
        truth = np.exp(np.sum(q * k, axis=1) / math.sqrt(d))
        reps = 800
        est, _ = _estimates(q, k, reps=reps, m=m, kind=kind, projection="orthogonal")
        sq = (est - truth) ** 2
        var_iid = np.diagonal(kernel_variance(q, k, num_features=m, kind=kind))
        ratio = (sq / var_iid).mean(axis=1)
        se = ratio.std(ddof=1) / math.sqrt(reps)
        assert ratio.mean() < 1 - 5 * se, (ratio.mean(), se)

    def test_fixed_norms_are_biased(self):
        # Every row of length sqrt(d): E[exp(ω·u)] = 0F1-type function != exp(‖u‖²/2).
        # Aligned q = k at norm 3, d = 8: a large, detectable bias.
        q, k = _pairs(norm=3.0)
        est, _ = _estimates(q[:1], k[:1], reps=1500, m=8, projection="orthogonal",
                            norms="fixed")
        truth = math.exp(9 / math.sqrt(8))
        se = est.std(ddof=1) / math.sqrt(len(est))
        assert abs(est.mean() - truth) > 5 * se


# ---------------------------------------------------------------------------------
# FAVOR++ (GERF with the optimal A*) and the generalized kernels
# ---------------------------------------------------------------------------------

def _square(t):
    return t * t


class TestFavorPlusPlus:
    def test_gerf_parameter_from_all_pairs(self, rng):
        # rho from every pair, plainly; masked keys excluded.
        q, k, _ = make_qkv(rng, batch=(2,), n=5, s=7, d=6)
        km = rng.random((2, 7)) < 0.6
        km[:, 0] = True
        scale = 0.3
        got = gerf_parameter(q, k, scale=scale, key_mask=km)
        for b in range(2):
            pairs = [np.sum((q[b, i] + k[b, j]) ** 2) * scale
                     for i in range(5) for j in range(7) if km[b, j]]
            rho = np.mean(pairs) / 6
            want = (1 - 2 * rho - math.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16
            assert math.isclose(float(got[b, 0, 0]), want, rel_tol=1e-12)

    def test_optimal_a_minimises_mean_log_second_moment(self, rng):
        # The mean over pairs of log E[f(ω,q)² f(ω,k)²] is minimal at A* (grid check).
        q, k, _ = make_qkv(rng, batch=(), n=6, s=6, d=8, norm=5.0)
        a_star = float(gerf_parameter(q, k)[0, 0])
        qt, kt = q / 8 ** 0.25, k / 8 ** 0.25

        def mean_log_m2(a):
            u2 = np.sum((qt[:, None] + kt[None]) ** 2, -1)
            n2 = np.sum(qt ** 2, -1)[:, None] + np.sum(kt ** 2, -1)[None]
            return np.mean(8 * np.log(1 - 4 * a) - 4 * np.log(1 - 8 * a)
                           + 2 * (1 - 4 * a) / (1 - 8 * a) * u2 - n2)
        best = mean_log_m2(a_star)
        for delta in (-0.05, -0.01, -1e-3, 1e-3, 0.01, 0.05):
            assert mean_log_m2(a_star + delta) > best
        assert a_star < 0

    @pytest.mark.parametrize("projection", ["iid", "orthogonal"])
    @pytest.mark.parametrize("gerf_a", [-0.2, 0.05])
    def test_unbiased(self, projection, gerf_a):
        q, k = _pairs()
        est, slack = _estimates(q, k, reps=1500, m=8, kind="favor++", projection=projection,
                                gerf_a=gerf_a)
        truth = np.exp(np.sum(q * k, axis=1) / math.sqrt(8))
        se = est.std(axis=0, ddof=1) / math.sqrt(len(est))
        assert np.all(np.abs(est.mean(axis=0) - truth) <= 5 * se + slack), (
            (est.mean(axis=0) - truth) / se)

    def test_variance_matches_closed_form(self):
        q, k = _pairs(norm=1.5, special=False)
        reps, m, a = 3000, 4, -0.15
        est, _ = _estimates(q, k, reps=reps, m=m, kind="favor++", gerf_a=a)
        var = np.diagonal(kernel_variance(q, k, num_features=m, kind="favor++", gerf_a=a))
        c = est - est.mean(axis=0)
        se = np.sqrt(((c ** 4).mean(axis=0) - c.var(axis=0) ** 2) / reps)
        assert np.all(np.abs(c.var(axis=0, ddof=1) - var) < 5 * se), (
            (c.var(axis=0, ddof=1) - var) / se)
        # gerf_a = 0 is FAVOR+.
        np.testing.assert_allclose(
            kernel_variance(q, k, num_features=m, kind="favor++", gerf_a=0.0),
            kernel_variance(q, k, num_features=m), rtol=1e-12)

    def test_lower_error_than_favor_plus_at_large_norms(self):
        # ‖q‖ = ‖k‖ = 8, d = 32: the closed-form variance is lower for every pair, by ~4
        # orders of magnitude in geometric mean (exact), and the typical error |log(K̂/K)| is lower, paired over the same ω
        # (200 seeds, > 5 standard errors).  FAVOR+'s own variance is too heavy-tailed
        # to be estimated by sampling, hence the log error.
        d, m, reps = 32, 256, 200
        rng = np.random.default_rng(1)
        q, k = rng.standard_normal((2, 16, d))
        q = q / np.linalg.norm(q, axis=1, keepdims=True) * 8
        k = k / np.linalg.norm(k, axis=1, keepdims=True) * 8
        a = float(gerf_parameter(q[None], k[None])[0, 0, 0])
        v_pos = np.diagonal(kernel_variance(q, k, num_features=m))
        v_fpp = np.diagonal(kernel_variance(q, k, num_features=m, kind="favor++", gerf_a=a))
        assert np.all(v_fpp < v_pos / 100)
        assert np.exp(np.mean(np.log(v_pos / v_fpp))) > 1e4
        truth = np.exp(np.sum(q * k, axis=1) / math.sqrt(d))
        gap = []
        for s in range(reps):
            f = RandomFeatures.draw(d, m, seed=s)
            lp = np.abs(np.log(np.diagonal(estimate_kernel(q, k, f)) / truth))
            lf = np.abs(np.log(np.diagonal(estimate_kernel(q, k, f, kind="favor++",
                                                           gerf_a=a)) / truth))
            gap.append(np.mean(lp - lf))
        gap = np.array(gap)
        assert gap.mean() > 5 * gap.std(ddof=1) / math.sqrt(reps), (gap.mean(), gap.std())

    def test_gerf_a_errors(self, rng):
        q, k, _ = make_qkv(rng, batch=(), n=3, s=4, d=4)
        f = RandomFeatures.draw(4, 8)
        with pytest.raises(ValueError, match="1/8"):
            estimate_kernel(q, k, f, kind="favor++", gerf_a=0.2)
        with pytest.raises(ValueError, match="only used with kind='favor\\+\\+'"):
            estimate_kernel(q, k, f, gerf_a=-0.1)


class TestGeneralizedKernels:
    @pytest.mark.parametrize("kind", ["relu", _square])
    def test_matches_oracle(self, backend, rng, kind):
        q, k, _ = make_qkv(rng, batch=(2,), n=37, s=45, d=8, norm=3.0)
        f = RandomFeatures.draw(8, 20, seed=5)
        ref = oracle_kernel(q, k, f.omega, kind, 1 / math.sqrt(8))
        out = estimate_kernel(backend.asarray(q, "float64"), backend.asarray(k, "float64"), f,
                              kind=kind)
        xp_assert_close(out, backend.asarray(ref, "float64"), rtol=1e-13,
                        atol=1e-13 * np.abs(ref).max())

    def test_identity_projection(self):
        f = RandomFeatures.draw(5, 5, projection="identity")
        np.testing.assert_array_equal(f.omega, np.eye(5))
        assert f.projection == "identity"
        with pytest.raises(ValueError, match="m = d"):
            RandomFeatures.draw(5, 6, projection="identity")
