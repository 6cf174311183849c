"""performer_attention: the same estimator as a dense float64 oracle, exact stabilisation,
bit-for-bit causality, masks, replayed projections, and the statistics of the error."""
from __future__ import annotations

import math

import numpy as np
import pytest

import arrayattn
from arrayattn import RandomFeatures, attention_matrix, performer_attention
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import make_qkv
from oracle import allowed_matrix
from oracle import softmax_attention as exact_oracle
from test_random_features import exponent_bound, oracle_features

KINDS = ["positive", "hyperbolic", "trig", "favor++", "relu"]


def _kind_opts(kind):
    """Extra options per kind: favor++ with a fixed A (the data A* is tested separately)."""
    return {"gerf_a": -0.2} if kind == "favor++" else {}
F64 = float(np.finfo(np.float64).eps)
F32 = float(np.finfo(np.float32).eps)


def oracle_performer(q, k, v, omega, *, kind="positive", scale=None, causal=False,
                     key_mask=None, gerf_a=None):
    """Dense float64 Performer attention from the unstabilised features.

    Returns the output and ``cond = max_i sum_j |K_ij| / |sum_j K_ij|`` (1 for positive
    features), which scales the rounding error of the ratio.
    """
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    sign = -1.0 if scale < 0 else 1.0
    kmat = oracle_features(q, omega, kind, scale, sign, gerf_a) @ np.swapaxes(
        oracle_features(k, omega, kind, scale, 1.0, gerf_a), -1, -2)
    n, s = q.shape[-2], k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    allowed = allowed_matrix(n, s, batch=batch, causal=causal, key_mask=key_mask)
    kmat = np.where(allowed, kmat, 0.0)
    den = kmat.sum(-1, keepdims=True)
    out = np.where(den != 0, (kmat @ v) / np.where(den != 0, den, 1.0), 0.0)
    cond = np.max(np.abs(kmat).sum(-1, keepdims=True) / np.where(den != 0, np.abs(den), 1))
    return out, cond


def attention_tol(dtype, q, k, v, omega, *, m, cond, causal, scale=None, gerf_a=None):
    """Rounding bound: each kernel term has relative error <= eps (2 d A + 2 m + 8) (A the
    largest exponent, incl. the causal shift ‖ω‖²/2), the ratio over s keys adds s + 4,
    and cancellation in the denominator multiplies by cond."""
    eps = F32 if dtype in ("float32", "float16") else F64
    d, s = q.shape[-1], k.shape[-2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    a = exponent_bound(q, omega, scale, gerf_a) + exponent_bound(k, omega, scale, gerf_a)
    if causal:
        g = 0.0 if gerf_a is None else gerf_a
        a += np.max(np.sum(omega ** 2, axis=1)) * (1 - 4 * g + 2 * abs(g))
    return eps * np.abs(v).max() * cond * (2 * (2 * d * a + 2 * m + 8) + s + 4)


def backend_problem(rng):
    """The one problem shape of the backend tests (JAX compiles once per shape)."""
    q, k, v = make_qkv(rng, batch=(2,), n=37, s=45, d=8, dv=3, norm=3.0)
    km = rng.random((2, 45)) < 0.8
    km[:, 0] = True
    return q, k, v, km


class TestPerformerAttention:
    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("causal", [False, True])
    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_matches_oracle(self, backend, rng, kind, causal, dtype):
        if backend.name == "jax" and dtype == "float32":
            pytest.skip("jax compiles every op per dtype (~1 s each here); float32 on jax "
                        "is covered by test_registry and test_future_key_never_changes_past")
        q, k, v, km = backend_problem(rng)
        f = RandomFeatures.draw(8, 20, seed=3)
        opts = _kind_opts(kind)
        ref, cond = oracle_performer(q, k, v, f.omega, kind=kind, causal=causal, key_mask=km,
                                     **opts)
        out = performer_attention(*(backend.asarray(x, dtype) for x in (q, k, v)),
                                  features=f, kind=kind, causal=causal,
                                  key_mask=backend.asarray(km), **opts)
        tol = attention_tol(dtype, q, k, v, f.omega, m=20, cond=cond, causal=causal, **opts)
        xp_assert_close(out, backend.asarray(ref, dtype), rtol=0, atol=tol)

    @pytest.mark.parametrize("n, s", [(20, 12), (12, 20), (65, 65), (1, 7)])
    @pytest.mark.parametrize("kind", KINDS)
    def test_causal_shapes(self, rng, n, s, kind):
        # End-aligned causality with n != s, chunk boundaries (65 = 64 + 1), one query.
        q, k, v = make_qkv(rng, batch=(2, 1), n=n, s=s, d=4, dv=2, norm=2.0)
        f = RandomFeatures.draw(4, 8, seed=1)
        opts = _kind_opts(kind)
        ref, cond = oracle_performer(q, k, v, f.omega, kind=kind, causal=True, **opts)
        out = performer_attention(q, k, v, features=f, kind=kind, causal=True, **opts)
        np.testing.assert_allclose(out, ref, rtol=0, atol=attention_tol(
            "float64", q, k, v, f.omega, m=8, cond=cond, causal=True, **opts))
        if n > s:
            assert np.all(out[..., : n - s, :] == 0)  # queries before every key

    @pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_sharp_inputs_float32(self, rng, kind, causal):
        # Trained-BERT norms (‖q‖ = ‖k‖ = 8, d = 64): the float32 result equals the
        # float64 estimator to the rounding bound -- no underflow, no overflow.
        q, k, v = make_qkv(rng, batch=(2,), n=128, s=128, d=64, dv=4, norm=8.0)
        f = RandomFeatures.draw(64, 128, seed=0)
        ref, cond = oracle_performer(q, k, v, f.omega, kind=kind, causal=causal)
        out = performer_attention(q.astype(np.float32), k.astype(np.float32),
                                  v.astype(np.float32), features=f, kind=kind,
                                  causal=causal)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=0, atol=attention_tol(
            "float32", q, k, v, f.omega, m=128, cond=cond, causal=causal))

    @pytest.mark.parametrize("kind", ["positive", "hyperbolic"])
    @pytest.mark.parametrize("causal", [False, True])
    def test_no_eps_small_weights_exact(self, rng, kind, causal):
        # Every entry of the implied attention matrix, even weights ~1e-12, equals the
        # float64 estimator to a *relative* bound: nothing floors small kernels (an eps
        # added to the features, as popular implementations do, fails this by orders).
        q, k, _ = make_qkv(rng, batch=(1,), n=24, s=24, d=16, norm=8.0)
        k[:, :12], k[:, 12:] = q[:, :12], -q[:, 12:]  # kernels from e^16 down to e^-16
        f = RandomFeatures.draw(16, 64, seed=2)
        a = attention_matrix(performer_attention, q, k, features=f, kind=kind,
                             causal=causal)
        eye = np.eye(24)
        ref, _ = oracle_performer(q, k, eye, f.omega, kind=kind, causal=causal)
        assert ref[ref > 0].min() < 1e-6  # tiny weights (an eps of 1e-4 would swamp them)
        rel = F64 * (2 * (2 * 16 * (exponent_bound(q, f.omega, 0.25)
                                    + exponent_bound(k, f.omega, 0.25) + 60) + 128 + 8) + 28)
        np.testing.assert_allclose(a, ref, rtol=rel, atol=0)

    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
    def test_future_key_never_changes_past(self, backend, rng, kind):
        # One huge future key (norm 1e4: its raw features are inf/0) and wild values:
        # every past output is unchanged bit for bit, on every backend.  s - n = 8, so
        # key 40 is in the future of queries 0..31.
        q, k, v, _ = backend_problem(rng)
        k2, v2 = k.copy(), v.copy()
        k2[:, 40] *= 1e4 / 3.0
        v2[:, 40:] = 1e6
        k2[:, 43:] = -k2[:, 43:] * 50
        run = lambda kk, vv: performer_attention(  # noqa: E731
            *(backend.asarray(x, "float32") for x in (q, kk, vv)), kind=kind,
            num_features=20, causal=True, **_kind_opts(kind))
        a, b = run(k, v), run(k2, v2)
        xp_assert_equal(a[:, :32, :], b[:, :32, :])
        assert not np.array_equal(backend.to_numpy(a[:, 32:, :]),
                                  backend.to_numpy(b[:, 32:, :]))
        assert np.isfinite(backend.to_numpy(a)).all()

    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("causal", [False, True])
    def test_masked_keys_removed_even_if_huge_or_nan(self, rng, kind, causal):
        q, k, v = make_qkv(rng, batch=(2,), n=30, s=30, d=8, dv=3, norm=3.0)
        km = rng.random((2, 30)) < 0.6
        km[:, 0] = True
        k2, v2 = k.copy(), v.copy()
        k2[~km] = 1e6
        k2[0, ~km[0]] = np.nan
        v2[~km] = np.inf
        opts = _kind_opts(kind)
        a = performer_attention(q, k, v, key_mask=km, kind=kind, causal=causal, **opts)
        b = performer_attention(q, k2, v2, key_mask=km, kind=kind, causal=causal, **opts)
        assert np.isfinite(b).all()
        np.testing.assert_allclose(a, b, rtol=0, atol=0)

    def test_huge_unmasked_key_noncausal_finite(self, rng):
        # The single global key shift keeps a dominant key finite (no overflow).
        q, k, v = make_qkv(rng, batch=(1,), n=10, s=10, d=8, dv=3, norm=3.0)
        k[0, 3] *= 20.0
        for kind in ("positive", "hyperbolic"):
            out = performer_attention(q.astype(np.float32), k.astype(np.float32),
                                      v.astype(np.float32), kind=kind)
            assert np.isfinite(out).all()

    @pytest.mark.parametrize("causal", [False, True])
    def test_empty_rows_are_zero(self, rng, causal):
        q, k, v = make_qkv(rng, batch=(2,), n=6, s=6, d=4, dv=2)
        km = np.ones((2, 6), dtype=bool)
        km[1] = False
        out = performer_attention(q, k, v, key_mask=km, causal=causal)
        assert np.all(out[1] == 0) and np.all(out[0] != 0)

    def test_features_replay_and_uniform_call(self, backend, rng):
        q, k, v = (backend.asarray(x, "float32") for x in backend_problem(rng)[:3])
        drawn = performer_attention(q, k, v, num_features=20, seed=7, projection="iid")
        f = RandomFeatures.draw(8, 20, projection="iid", seed=7)
        xp_assert_equal(performer_attention(q, k, v, features=f), drawn)
        xp_assert_equal(performer_attention(q, k, v, features=f.omega), drawn)
        rec = arrayattn.get_variant("performer_positive")
        xp_assert_equal(rec(q, k, v, omega=f.omega), drawn)
        xp_assert_equal(rec(q, k, v, omega=backend.asarray(f.omega, "float64")), drawn)
        assert "omega=" in rec.notes
        with pytest.raises(ValueError, match="omega or features"):
            rec(q, k, v, omega=f.omega, features=f)

    def test_half_precision(self, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=9, s=9, d=4)
        out = performer_attention(*(x.astype(np.float16) for x in (q, k, v)))
        ref = performer_attention(*(x.astype(np.float16).astype(np.float32)
                                    for x in (q, k, v)))
        assert out.dtype == np.float16
        np.testing.assert_allclose(out, ref.astype(np.float16), rtol=0, atol=4e-3)

    def test_errors(self, rng):
        q, k, v = make_qkv(rng, batch=(), n=3, s=4, d=4)
        with pytest.raises(ValueError, match="d=5"):
            performer_attention(q, k, v, features=RandomFeatures.draw(5, 8))
        with pytest.raises(ValueError, match="kind"):
            performer_attention(q, k, v, kind="softmax")
        with pytest.raises(ValueError, match="num_features"):
            performer_attention(q, k, v, num_features=0)
        with pytest.raises(ValueError, match="norms"):
            performer_attention(q, k, v, norms="none")
        with pytest.raises(ValueError, match="key_mask"):
            performer_attention(q, k, v, key_mask=np.ones(3, dtype=bool))


class TestFavorPlusPlusAndGeneralized:
    def test_favorpp_data_parameter(self, rng):
        # Default A = gerf_parameter(q, k, key_mask) per batch element; non-causal only.
        q, k, v = make_qkv(rng, batch=(2,), n=20, s=24, d=8, dv=3, norm=4.0)
        km = rng.random((2, 24)) < 0.7
        km[:, 0] = True
        f = RandomFeatures.draw(8, 32, seed=0)
        out = performer_attention(q, k, v, features=f, kind="favor++", key_mask=km)
        a = arrayattn.gerf_parameter(q, k, key_mask=km)
        for b in range(2):
            ref, cond = oracle_performer(q[b], k[b], v[b], f.omega, kind="favor++",
                                         key_mask=km[b], gerf_a=float(a[b, 0, 0]))
            np.testing.assert_allclose(out[b], ref, rtol=0, atol=attention_tol(
                "float64", q, k, v, f.omega, m=32, cond=cond, causal=False,
                gerf_a=float(a[b, 0, 0])))
        # An array gerf_a per batch element gives the same result.
        np.testing.assert_allclose(
            performer_attention(q, k, v, features=f, kind="favor++", key_mask=km, gerf_a=a),
            out, rtol=1e-13, atol=1e-13)
        with pytest.raises(ValueError, match="causal"):
            performer_attention(q, k, v, kind="favor++", causal=True)

    def test_relu_without_projection_is_linear_attention(self, backend, rng):
        # projection="identity": φ(x) = relu(x̃)/sqrt(d), the constants cancel: exactly the
        # kernel module's linear attention with the relu feature map.
        q, k, v, km = backend_problem(rng)
        q, k, v = (backend.asarray(x, "float64") for x in (q, k, v))
        for causal in (False, True):
            out = performer_attention(q, k, v, kind="relu", projection="identity",
                                      causal=causal, key_mask=backend.asarray(km))
            ref = arrayattn.linear_attention(q, k, v, feature_map="relu", causal=causal,
                                             key_mask=backend.asarray(km))
            xp_assert_close(out, ref, rtol=1e-12, atol=1e-12)

    def test_user_function(self, rng):
        # A caller's elementwise f (array-API) as kind: f(t) = t², with and without
        # projection, causal and not, equals the oracle of the same definition.
        q, k, v = make_qkv(rng, batch=(2,), n=20, s=24, d=8, dv=3, norm=3.0)

        def f(t):
            return t * t
        for feats in (RandomFeatures.draw(8, 16, seed=2),
                      RandomFeatures.draw(8, 8, projection="identity")):
            for causal in (False, True):
                ref, cond = oracle_performer(q, k, v, feats.omega, kind=f, causal=causal)
                out = performer_attention(q, k, v, features=feats, kind=f, causal=causal)
                np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


class TestPerformerStatistics:
    def test_error_falls_like_inverse_sqrt_m(self, rng):
        # Mean absolute attention error over 8 seeds at m = 16 .. 1024 on moderate-norm
        # inputs: log-log slope close to -1/2 (the noise term dominates the O(1/m) bias).
        q, k, v = make_qkv(rng, batch=(2,), n=64, s=64, d=16, norm=2.0)
        exact = exact_oracle(q, k, v)
        ms = [16, 64, 256, 1024]
        errs = [np.mean([np.abs(performer_attention(q, k, v, num_features=m, seed=s,
                                                    projection="iid") - exact).mean()
                         for s in range(8)]) for m in ms]
        slope = np.polyfit(np.log(ms), np.log(errs), 1)[0]
        assert -0.65 < slope < -0.35, (slope, errs)

    def test_hyperbolic_and_orthogonal_help(self, rng):
        # At equal m, hyperbolic beats positive, and orthogonal rows beat iid ones, on
        # moderate norms (mean over seeds; each gap is > 3 of its standard errors).
        q, k, v = make_qkv(rng, batch=(2,), n=64, s=64, d=16, norm=2.0)
        exact = exact_oracle(q, k, v)

        def err(**kw):
            return np.array([np.abs(performer_attention(q, k, v, num_features=64, seed=s,
                                                        **kw) - exact).mean()
                             for s in range(16)])
        pos = err(projection="orthogonal")
        hyp_iid = err(projection="iid", kind="hyperbolic")
        hyp = err(projection="orthogonal", kind="hyperbolic")
        for worse, better in ((pos, hyp), (hyp_iid, hyp)):
            gap = worse - better
            assert gap.mean() > 3 * gap.std(ddof=1) / math.sqrt(len(gap)), (worse, better)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["positive", "favor++"])
def test_torch_gradcheck(rng, causal, kind):
    # Gradients flow through the array-API code (no in-place updates on torch tensors);
    # the stabilising shifts cancel, so their (max) subgradients do not matter.
    from conftest import get_backend
    get_backend("torch")
    import torch

    q, k, v = (torch.tensor(x, requires_grad=True)
               for x in make_qkv(rng, batch=(2,), n=5, s=7, d=3, dv=2, norm=2.0))
    km = torch.tensor(rng.random((2, 7)) < 0.8)
    f = RandomFeatures.draw(3, 6, seed=1)
    opts = {"gerf_a": -0.1} if kind == "favor++" else {}
    assert torch.autograd.gradcheck(
        lambda a, b, c: performer_attention(a, b, c, features=f, kind=kind, causal=causal,
                                            key_mask=km, **opts), (q, k, v))
