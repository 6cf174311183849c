"""arrayattn.pinv: Moore–Penrose conditions, convergence of the iterative method, errors.

Tolerances (relative, Frobenius norm), with p = max(rows, cols), kappa = sigma_max /
sigma_min over the nonzero singular values and eps of the working dtype:

* ``"svd"``: ``p eps kappa`` -- the first-order sensitivity of the pseudo-inverse to a
  relative perturbation eps of A (Wedin 1973) times the p-term rounding of the products;
* ``"iterative"``: ``p eps kappa^2`` -- each step rounds ``AZ`` to ``eps ||A|| ||Z|| =
  eps kappa`` and the next product with ``A`` or ``Z`` multiplies that by ``kappa`` again
  (the known kappa^2 forward error of Schulz-type iterations, Söderström & Stewart 1974),
  run for ``iters_needed`` steps: ``log_3.25`` of what the smallest singular value needs
  to reach ``r = 1/2`` plus 4 cubic steps (``r: 1/2 -> 0.11 -> 1e-3 -> 7e-10 -> 4e-28``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import pinv
from arrayattn.testing import xp_assert_kind

from conftest import get_backend, skip_jax_compile

F64 = float(np.finfo(np.float64).eps)


def _haar(rng, p):
    qm, r = np.linalg.qr(rng.standard_normal((p, p)))
    return qm * np.sign(np.diag(r))


def _with_singular_values(rng, p, q, sig):
    """``U diag(sig) V^T`` with Haar-random ``U (p, r)``, ``V (q, r)``."""
    u = _haar(rng, p)[:, : len(sig)]
    v = _haar(rng, q)[:, : len(sig)]
    return (u * sig) @ v.T


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _cases(rng):
    """name -> float64 matrix; every kind the issue asks for."""
    return {
        "gaussian": rng.standard_normal((16, 16)),
        "rank_deficient": _with_singular_values(rng, 16, 16, np.logspace(0, -2, 10)),
        "cond_1e6": _with_singular_values(rng, 16, 16, np.logspace(0, -6, 16)),
        "softmax_sharp": _softmax(3.0 * rng.standard_normal((16, 16))),
        "tall": rng.standard_normal((12, 7)),
        "wide_rank_deficient": _with_singular_values(rng, 7, 12, np.logspace(0, -3, 5)),
    }


def _kappa(a):
    s = np.linalg.svd(a, compute_uv=False)
    s = s[s > s[0] * 1e-12]
    return s[0] / s[-1], s[-1]


def iters_needed(a, sigma_min, final_r=4):
    """Steps for the direction of ``sigma_min`` to reach r = 1/2, plus 4 cubic steps."""
    norm_prod = np.abs(a).sum(-2).max() * np.abs(a).sum(-1).max()
    return max(0, math.ceil(math.log(0.5 * norm_prod / sigma_min**2) / math.log(3.25))) + final_r


def _mp_errors(a, z):
    """Relative Frobenius errors of the four Moore–Penrose conditions."""
    nf = np.linalg.norm
    az, za = a @ z, z @ a
    return {
        "AZA = A": nf(az @ a - a) / nf(a),
        "ZAZ = Z": nf(za @ z - z) / nf(z),
        "(AZ)^T = AZ": nf(az - az.T) / nf(az),
        "(ZA)^T = ZA": nf(za - za.T) / nf(za),
    }


def _tol(method, a, kappa, eps):
    p = max(a.shape)
    return p * eps * kappa * (kappa if method == "iterative" else 1.0)


CASE_NAMES = list(_cases(np.random.default_rng(0)))


class TestPinv:
    @pytest.mark.parametrize("method", ["svd", "iterative"])
    @pytest.mark.parametrize("case", CASE_NAMES)
    def test_moore_penrose_conditions(self, backend, method, case):
        if case != "gaussian":
            skip_jax_compile(backend, "the 'gaussian' case")
        a = _cases(np.random.default_rng(7))[case]
        kappa, smin = _kappa(a)
        iters = iters_needed(a, smin)
        z = pinv(backend.asarray(a), method=method, iters=iters)
        assert z.shape == a.shape[::-1]
        zn = backend.to_numpy(z)
        tol = _tol(method, a, kappa, F64)
        for cond, err in _mp_errors(a, zn).items():
            assert err <= tol, f"{case}/{method}: {cond} error {err:.3g} > tol {tol:.3g}"
        # ... and it is *the* pseudo-inverse (unique), to the forward-error bound.
        ref = np.linalg.pinv(a, rcond=1e-12)
        assert np.linalg.norm(zn - ref) <= tol * np.linalg.norm(ref)

    @pytest.mark.parametrize("method", ["svd", "iterative"])
    def test_float32_softmax_and_batch(self, backend, rng, method):
        skip_jax_compile(backend, "test_moore_penrose_conditions and test_nystrom (float32)")
        # A batch of real landmark-like softmax matrices in float32, per matrix.
        a = _softmax(2.0 * rng.standard_normal((3, 8, 8)))
        a32 = a.astype(np.float32).astype(np.float64)
        z = pinv(backend.asarray(a32, "float32"), method=method, iters=40)
        assert z.dtype == backend.dtype("float32")
        eps = float(np.finfo(np.float32).eps)
        for i in range(3):
            kappa, _ = _kappa(a32[i])
            tol = _tol(method, a32[i], kappa, eps)
            for cond, err in _mp_errors(a32[i], backend.to_numpy(z)[i].astype(float)).items():
                assert err <= tol, f"matrix {i}: {cond} error {err:.3g} > {tol:.3g}"

    def test_residual_monotone_and_reaches_svd(self, backend, rng):
        skip_jax_compile(backend, "test_moore_penrose_conditions")
        # R -> (3R^3 + R^4)/4 per singular direction: ||I - AZ||_F never increases
        # (beyond rounding) and the iterate reaches the SVD answer.
        a = _with_singular_values(rng, 12, 12, np.logspace(0, -3, 12))
        kappa, smin = _kappa(a)
        total = iters_needed(a, smin)
        res = []
        for it in range(total + 1):
            _, r = pinv(backend.asarray(a), method="iterative", iters=it, return_residual=True)
            res.append(float(backend.to_numpy(r)))
        floor = 12 * F64 * kappa**2
        for i in range(total):
            assert res[i + 1] <= res[i] + floor, (i, res)
        assert res[0] > 0.9                       # it really started far away
        assert res[-1] <= floor
        z_it = backend.to_numpy(pinv(backend.asarray(a), method="iterative", iters=total))
        z_svd = backend.to_numpy(pinv(backend.asarray(a), method="svd"))
        assert np.linalg.norm(z_it - z_svd) <= floor * np.linalg.norm(z_svd)

    def test_residual_follows_the_cubic_map(self, np_backend, rng):
        # For symmetric positive definite A the residual eigenvalues follow r -> (3r^3+r^4)/4.
        u = _haar(rng, 6)
        sig = np.array([1.0, 0.8, 0.5, 0.3, 0.2, 0.1])
        a = (u * sig) @ u.T
        alpha = 1.0 / (np.abs(a).sum(0).max() * np.abs(a).sum(1).max())
        r = 1.0 - alpha * sig**2
        for it in range(5):
            _, res = pinv(a, method="iterative", iters=it, return_residual=True)
            assert abs(float(res) - np.linalg.norm(r)) <= 1e-12
            r = 0.75 * r**3 + 0.25 * r**4

    def test_per_matrix_init_never_slower_than_global(self, np_backend, rng):
        # An algorithmic property (backends agree on pinv by the tests above).
        backend = np_backend
        # A batch of heads, one of which attends sharply to one landmark (column sum
        # ~16 instead of ~1): its ||A||_1 shrinks the global Z0 of every head ~16x, which
        # costs the mild heads about log_3.25(16) ~ 2.4 extra iterations.
        heads = [_softmax(0.5 * rng.standard_normal((16, 16))) for _ in range(3)]
        sharp = 2.0 * rng.standard_normal((16, 16))
        sharp[:, 0] += 6.0
        heads.append(_softmax(sharp))
        a = np.stack(heads)
        x = backend.asarray(a)

        limit, target = 45, 1e-8
        res = {init: np.stack([backend.to_numpy(pinv(x, method="iterative", iters=it,
                                                     init=init, return_residual=True)[1])
                               for it in range(limit + 1)])
               for init in ("per_matrix", "global")}            # (iters, heads)
        first = {init: np.argmax(r <= target, axis=0) for init, r in res.items()}
        assert (res["per_matrix"][-1] <= target).all() and (res["global"][-1] <= target).all()
        assert (first["per_matrix"] <= first["global"]).all(), first
        assert (first["per_matrix"][:3] + 2 <= first["global"][:3]).all(), first  # mild heads
        # At every iteration count the per-matrix residual is no larger (to rounding).
        assert (res["per_matrix"] <= res["global"] + 1e-10).all()

    def test_global_init_is_one_scale_for_the_batch(self, np_backend, rng):
        # With init="global", Z0 = A^T / (max_b ||A_b||_1 * max_b ||A_b||_inf).
        a = rng.standard_normal((3, 5, 5))
        a[2] *= 10
        z0 = pinv(a, method="iterative", iters=0, init="global")
        c = np.abs(a).sum(-2).max() * np.abs(a).sum(-1).max()
        np.testing.assert_allclose(z0, np.swapaxes(a, -1, -2) / c, rtol=1e-15)
        z0 = pinv(a, method="iterative", iters=0)
        for b in range(3):
            cb = np.abs(a[b]).sum(0).max() * np.abs(a[b]).sum(1).max()
            np.testing.assert_allclose(z0[b], a[b].T / cb, rtol=1e-15)

    @pytest.mark.parametrize("method", ["svd", "iterative"])
    def test_zero_matrix(self, backend, method):
        skip_jax_compile(backend, "test_moore_penrose_conditions")
        z, r = pinv(backend.asarray(np.zeros((2, 4, 4))), method=method, return_residual=True)
        assert (backend.to_numpy(z) == 0).all()
        np.testing.assert_allclose(backend.to_numpy(r), 2.0)   # sqrt(4 - rank 0)

    def test_rtol_cutoff(self, np_backend):
        a = np.diag([1.0, 1e-3, 1e-9])
        np.testing.assert_allclose(pinv(a, rtol=1e-6), np.diag([1.0, 1e3, 0.0]))
        np.testing.assert_allclose(pinv(a), np.diag([1.0, 1e3, 1e9]))

    def test_half_precision_computed_in_float32(self):
        b = get_backend("torch")
        import torch
        a = np.array([[2.0, 1.0], [1.0, 3.0]])
        z = pinv(b.asarray(a, "float16"), method="iterative", iters=8)
        assert z.dtype == torch.float16
        np.testing.assert_allclose(b.to_numpy(z).astype(float), np.linalg.inv(a), rtol=1e-3)

    def test_output_kind(self, backend, rng):
        skip_jax_compile(backend, "test_moore_penrose_conditions")
        a = backend.asarray(rng.standard_normal((2, 3, 4)), "float32")
        for method in ("svd", "iterative"):
            z, r = pinv(a, method=method, return_residual=True)
            xp_assert_kind(z, backend.xp.zeros((2, 4, 3), dtype=a.dtype, device=backend.device))
            xp_assert_kind(r, backend.xp.zeros((2,), dtype=a.dtype, device=backend.device))

    def test_errors(self, np_backend):
        a = np.eye(3)
        with pytest.raises(ValueError, match="method"):
            pinv(a, method="qr")
        with pytest.raises(ValueError, match="init"):
            pinv(a, method="iterative", init="max")
        with pytest.raises(ValueError, match="init applies to method='iterative'"):
            pinv(a, init="global")
        with pytest.raises(ValueError, match="rtol applies to method='svd'"):
            pinv(a, method="iterative", rtol=1e-3)
        with pytest.raises(ValueError, match="rtol"):
            pinv(a, rtol=-1.0)
        with pytest.raises(ValueError, match="iters"):
            pinv(a, method="iterative", iters=-1)
        with pytest.raises(ValueError, match=r"at least 2 dimensions.*\(3,\)"):
            pinv(np.ones(3))
        with pytest.raises(TypeError, match="floating"):
            pinv(np.eye(3, dtype=np.int64))

    def test_no_linalg_extension(self):
        b = get_backend("strict")
        import array_api_strict as xps
        a = b.asarray(np.eye(3))
        xps.set_array_api_strict_flags(enabled_extensions=())
        try:
            with pytest.raises(ValueError, match="linalg.*method='iterative'"):
                pinv(a)
            z = pinv(a, method="iterative", iters=3)   # matmul only: still works
        finally:
            xps.reset_array_api_strict_flags()
        np.testing.assert_allclose(b.to_numpy(z), np.eye(3), atol=1e-15)


class TestPinvGradients:
    # Generic matrices: a row-stochastic A ties every row sum in ||A||_inf = max_i sum_j,
    # a kink of the norm that finite differences cannot see through (inside Nyström the
    # tie is harmless: the row sums are identically 1, so their derivative is 0).
    def test_torch_gradcheck_iterative(self, rng):
        get_backend("torch")
        import torch
        a = torch.tensor(rng.random((2, 4, 4)) + np.eye(4), requires_grad=True)
        assert torch.autograd.gradcheck(lambda x: pinv(x, method="iterative", iters=5), (a,))

    def test_jax_grad_iterative(self, rng):
        get_backend("jax")
        import jax
        import jax.numpy as jnp
        a = rng.random((4, 4)) + np.eye(4)
        w = rng.standard_normal((4, 4))

        def loss(x):
            return jnp.sum(pinv(x, method="iterative", iters=5) * w)

        g = np.asarray(jax.grad(loss)(jnp.asarray(a)))
        # The same iteration written plainly in NumPy, central differences (error O(h^2)).
        def plain(x):
            z = x.T / (np.abs(x).sum(0).max() * np.abs(x).sum(1).max())
            eye = np.eye(4)
            for _ in range(5):
                az = x @ z
                z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
            return np.sum(z * w)
        h, fd = 1e-6, np.zeros_like(a)
        for idx in np.ndindex(*a.shape):
            e = np.zeros_like(a)
            e[idx] = h
            fd[idx] = (plain(a + e) - plain(a - e)) / (2 * h)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-6)
