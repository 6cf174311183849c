"""rfa_attention: random Fourier features of normalised q, k, and the gated recurrence,
against a token-by-token float64 oracle of the paper's equations."""
from __future__ import annotations

import math

import numpy as np
import pytest

from arrayattn import RandomFeatures, performer_attention, rfa_attention, softmax_attention
from arrayattn.testing import xp_assert_close, xp_assert_equal

from conftest import make_qkv

F64 = float(np.finfo(np.float64).eps)


def rff(x, omega, sigma):
    """φ(x̂) = m^-1/2 [sin(w x̂), cos(w x̂)], w = ω/σ (float64, plainly)."""
    x = x / np.linalg.norm(x, axis=-1, keepdims=True)
    t = x @ (omega / sigma).T
    return np.concatenate([np.sin(t), np.cos(t)], -1) / math.sqrt(omega.shape[0])


def oracle_gated(q, k, v, omega, sigma, gate, key_mask=None):
    """The recurrence, one token at a time: S_t = g S + (1 - g) φ(k_t) v_t^T.

    Also returns ``cond = max_t den_abs_t / |den_t|`` (den_abs from |φ|), which bounds the
    amplification of rounding by cancellation in the signed trig denominators."""
    fq, fk = rff(q, omega, sigma), rff(k, omega, sigma)
    batch, n = q.shape[:-2], q.shape[-2]
    out = np.zeros((*batch, n, v.shape[-1]))
    cond = 1.0
    for idx in np.ndindex(*batch):
        s_mat = np.zeros((fk.shape[-1], v.shape[-1]))
        z = np.zeros(fk.shape[-1])
        za = np.zeros(fk.shape[-1])
        for t in range(n):
            if key_mask is None or key_mask[idx][t]:
                g = gate[idx][t]
                s_mat = g * s_mat + (1 - g) * np.outer(fk[idx][t], v[idx][t])
                z = g * z + (1 - g) * fk[idx][t]
                za = g * za + (1 - g) * np.abs(fk[idx][t])
            den = fq[idx][t] @ z
            out[idx][t] = 0.0 if den == 0 else (fq[idx][t] @ s_mat) / den
            if den != 0:
                cond = max(cond, (np.abs(fq[idx][t]) @ za) / abs(den))
    return out, cond


class TestRFA:
    def test_equals_trig_performer_on_normalised_inputs(self, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=20, s=24, d=8, dv=3)
        f = RandomFeatures.draw(8, 32, projection="iid", seed=4)
        for causal in (False, True):
            out = rfa_attention(q, k, v, features=f, sigma=0.7, causal=causal)
            qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
            kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
            ref = performer_attention(qn, kn, v, features=f, kind="trig", scale=1 / 0.49,
                                      causal=causal)
            np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)

    def test_approximates_softmax_at_temperature(self, rng):
        # E[φ(q̂)·φ(k̂)] = exp(-‖q̂ - k̂‖²/(2σ²)) ∝ exp(q̂·k̂/σ²): with many features the
        # output approaches softmax attention of the normalised inputs at scale 1/σ².
        q, k, v = make_qkv(rng, batch=(2,), n=32, s=32, d=8, dv=3)
        qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
        kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
        ref = softmax_attention(qn, kn, v, scale=4.0)
        errs = [np.abs(rfa_attention(q, k, v, num_features=m, sigma=0.5, seed=1) - ref).mean()
                for m in (64, 4096)]
        assert errs[1] < errs[0] / 4 and errs[1] < 0.05, errs

    @pytest.mark.parametrize("chunk", [1, 7, 64])
    def test_gated_matches_recurrence(self, backend, rng, chunk):
        q, k, v = make_qkv(rng, batch=(2,), n=45, s=45, d=8, dv=3)
        gate = rng.uniform(0.05, 0.99, size=(2, 45))
        km = rng.random((2, 45)) < 0.8
        f = RandomFeatures.draw(8, 16, projection="iid", seed=2)
        ref, cond = oracle_gated(q, k, v, f.omega, 0.8, gate, km)
        out = rfa_attention(*(backend.asarray(x, "float64") for x in (q, k, v)), features=f,
                            sigma=0.8, causal=True, gate=backend.asarray(gate, "float64"),
                            key_mask=backend.asarray(km), chunk_size=chunk)
        # Rounding of the 2m-term products, the log/exp of the gates and the sums over
        # <= 45 tokens (eps (2m + 2 n + 16) relative to the |terms|), times the
        # cancellation in the signed trig denominators (cond).
        atol = F64 * (2 * 32 + 2 * 45 + 16) * 4 * cond * np.abs(v).max()
        xp_assert_close(out, backend.asarray(ref, "float64"), rtol=0, atol=atol)

    def test_gated_long_sequence_no_overflow(self, rng):
        # g = 0.5 over 4096 tokens: the product of gates is 2^-4096 (0 in float64), yet
        # every factor of the chunked scan is <= 1: finite, and the first rows agree with
        # the short sequence's.
        q, k, v = make_qkv(rng, batch=(1,), n=4096, s=4096, d=8, dv=2)
        gate = np.full((1, 4096), 0.5, dtype=np.float32)
        out = rfa_attention(*(x.astype(np.float32) for x in (q, k, v)), gate=gate,
                            causal=True, num_features=16)
        assert np.isfinite(out).all()
        short = rfa_attention(*(x[:, :100].astype(np.float32) for x in (q, k, v)),
                              gate=gate[:, :100], causal=True, num_features=16)
        xp_assert_equal(out[:, :100], short)

    def test_gated_future_never_changes_past(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=70, s=70, d=8, dv=3)
        gate = rng.uniform(0.1, 0.9, size=(2, 70))
        k2, v2, g2 = k.copy(), v.copy(), gate.copy()
        k2[:, 40:] *= 1e4
        v2[:, 40:] = 1e6
        g2[:, 40:] = 0.999
        run = lambda kk, vv, gg: rfa_attention(  # noqa: E731
            *(backend.asarray(x, "float32") for x in (q, kk, vv)), causal=True,
            gate=backend.asarray(gg, "float32"), num_features=16, chunk_size=16)
        a, b = run(k, v, gate), run(k2, v2, g2)
        xp_assert_equal(a[:, :40, :], b[:, :40, :])

    def test_errors(self, rng):
        q, k, v = make_qkv(rng, batch=(), n=4, s=6, d=4)
        with pytest.raises(ValueError, match="causal=True"):
            rfa_attention(q, k, v, gate=np.full(6, 0.5))
        with pytest.raises(ValueError, match="n = s"):
            rfa_attention(q, k, v, gate=np.full(6, 0.5), causal=True)
        with pytest.raises(ValueError, match="sigma"):
            rfa_attention(q, k, v, sigma=0.0)
        q, k, v = make_qkv(rng, batch=(), n=6, s=6, d=4)
        with pytest.raises(ValueError, match="gate must be"):
            rfa_attention(q, k, v, gate=np.full(5, 0.5), causal=True)
