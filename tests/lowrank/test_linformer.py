"""linformer_attention against a float64 oracle of the same definition."""
from __future__ import annotations

import math

import numpy as np
import pytest

import arrayattn
from arrayattn import attention_matrix, linformer_attention, linformer_projection
from arrayattn.testing import xp_assert_close

from conftest import make_qkv
from oracle import softmax_attention as exact_oracle
from tolerances import attention_atol, round_to, working_eps

F64 = float(np.finfo(np.float64).eps)


def linformer_oracle(q, k, v, e, f=None, *, scale=None, key_mask=None):
    """Plain float64 Linformer, one batch element and one query at a time:
    O_i = sum_r softmax_r(scale q_i . (E k)_r) (F v)_r, padded keys/values zeroed first."""
    q, k, v, e = (np.asarray(x, dtype=np.float64) for x in (q, k, v, e))
    f = e if f is None else np.asarray(f, dtype=np.float64)
    n, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if key_mask is not None:
        keep = np.asarray(key_mask, dtype=bool)[..., None]
        k, v = np.where(keep, k, 0.0), np.where(keep, v, 0.0)
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], e.shape[:-2],
                                f.shape[:-2])
    out = np.zeros((*batch, n, v.shape[-1]))
    for idx in np.ndindex(*batch):
        qi, ki, vi, ei, fi = (np.broadcast_to(x, (*batch, *x.shape[-2:]))[idx]
                              for x in (q, k, v, e, f))
        ek, fv = ei @ ki, fi @ vi
        for i in range(n):
            logits = scale * (ek @ qi[i])
            w = np.exp(logits - logits.max())
            out[idx][i] = (w / w.sum()) @ fv
    return out


def _atol(dtype, q, k, v, e, f, scale):
    """Rounding bound: softmax attention on the projected keys/values (``attention_atol``)
    plus the projections' own rounding. ``E k`` and ``F v`` are s-term sums, so each entry
    is off by at most ``s eps max|E| max|k|`` (resp. F, v); the first moves a logit by at
    most ``scale d max|q|`` times that, which changes a softmax weight by a relative
    ``2 dl`` and the output by ``2 dl max|F v|``; the second reaches the output directly
    (the weights sum to 1)."""
    f = e if f is None else f
    eps, s, d = working_eps(dtype), k.shape[-2], q.shape[-1]
    ek, fv = e @ k, f @ v
    dl = abs(scale) * d * np.abs(q).max() * s * eps * np.abs(e).max() * np.abs(k).max()
    return (attention_atol(dtype, q, ek, fv, scale)
            + s * eps * np.abs(f).max() * np.abs(v).max()
            + 2 * dl * np.abs(fv).max())


class TestLinformerAttention:
    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    def test_identity_projection_is_exact(self, backend, rng, dtype):
        q, k, v = (round_to(x, dtype) for x in make_qkv(rng, batch=(2,), n=9, s=13, d=16,
                                                         dv=5, norm=8.0))
        eye = np.eye(13)
        out = linformer_attention(*(backend.asarray(x, dtype) for x in (q, k, v)),
                                  e=backend.asarray(eye, dtype), f=backend.asarray(eye, dtype))
        xp_assert_close(out, backend.asarray(exact_oracle(q, k, v), dtype), rtol=0,
                        atol=attention_atol(dtype, q, k, v))
        # f=None shares E: the same.
        out2 = linformer_attention(*(backend.asarray(x, dtype) for x in (q, k, v)),
                                   e=backend.asarray(eye, dtype))
        xp_assert_close(out2, out, rtol=0, atol=0)

    @pytest.mark.parametrize("dtype", ["float32", "float64"])
    @pytest.mark.parametrize("shared", [True, False])
    def test_matches_oracle(self, backend, rng, dtype, shared):
        q, k, v = (round_to(x, dtype) for x in make_qkv(rng, batch=(2, 3), n=10, s=12, d=32,
                                                         dv=5, norm=6.0))
        e = round_to(rng.standard_normal((3, 4, 12)) / 2.0, dtype)   # per-head E
        f = None if shared else round_to(rng.standard_normal((4, 12)) / 2.0, dtype)
        km = rng.random((2, 1, 12)) < 0.7
        args = [backend.asarray(x, dtype) for x in (q, k, v)]
        out = linformer_attention(*args, e=backend.asarray(e, dtype),
                                  f=None if f is None else backend.asarray(f, dtype),
                                  key_mask=backend.asarray(km), scale=0.3)
        ref = linformer_oracle(q, k, v, e, f, scale=0.3, key_mask=km)
        kz = np.where(km[..., None], k, 0.0)
        vz = np.where(km[..., None], v, 0.0)
        xp_assert_close(out, backend.asarray(ref, dtype), rtol=0,
                        atol=_atol(dtype, q, kz, vz, e, f, 0.3))

    def test_drawn_projection_is_the_documented_one(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=8, s=11, d=8, norm=4.0)
        e = linformer_projection(5, 11, seed=7)
        assert e.shape == (5, 11)
        # N(0, 1/m): the entries' mean square is 1/m (CLT bound on 55 chi-square terms).
        assert abs((e ** 2).mean() * 5 - 1.0) < 4 * math.sqrt(2 / 55)
        args = [backend.asarray(x) for x in (q, k, v)]
        out = linformer_attention(*args, proj_dim=5, seed=7)
        xp_assert_close(out, backend.asarray(linformer_oracle(q, k, v, e)), rtol=0,
                        atol=1e-12)
        other = linformer_attention(*args, proj_dim=5, seed=8)
        assert np.abs(backend.to_numpy(other) - backend.to_numpy(out)).max() > 1e-3

    def test_random_e_rows_sum_to_one(self, backend, rng):
        # A = P F; with F = I the implied matrix is the softmax P itself: rows sum to 1
        # for any E (here random, not orthogonal), also on sharp inputs.
        q, k, _ = make_qkv(rng, batch=(2,), n=7, s=9, d=32, norm=8.0)
        e = rng.standard_normal((9, 9)) / 3.0
        qx, kx = backend.asarray(q), backend.asarray(k)
        a = attention_matrix(linformer_attention, qx, kx, e=backend.asarray(e),
                             f=backend.asarray(np.eye(9)))
        rows = backend.to_numpy(a).sum(axis=-1)
        np.testing.assert_allclose(rows, 1.0, rtol=0, atol=16 * 9 * F64)
        assert (backend.to_numpy(a) >= 0).all()

    def test_shared_gaussian_f_does_not_preserve_constants(self, np_backend, rng):
        # The documented caveat: rows of A = P F sum to P F 1, not 1.
        q, k, _ = make_qkv(rng, batch=(), n=6, s=20, d=8)
        e = linformer_projection(4, 20, seed=0)
        a = attention_matrix(linformer_attention, q, k, e=e)
        rows = a.sum(axis=-1)
        ref = linformer_oracle(q, k, np.ones((20, 1)), e)[..., 0]
        np.testing.assert_allclose(rows, ref, rtol=1e-12)
        assert np.abs(rows - 1.0).max() > 0.1

    def test_key_mask_zeroes_before_projection(self, backend, rng):
        q, k, v = make_qkv(rng, batch=(2,), n=5, s=8, d=4)
        km = np.array([[True] * 6 + [False] * 2, [True] * 8])
        kz = np.where(km[..., None], k, 0.0)
        vz = np.where(km[..., None], v, 0.0)
        a = linformer_attention(*(backend.asarray(x) for x in (q, k, v)), proj_dim=3,
                                key_mask=backend.asarray(km))
        b = linformer_attention(*(backend.asarray(x) for x in (q, kz, vz)), proj_dim=3)
        xp_assert_close(a, b, rtol=0, atol=0)

    def test_not_causal(self, np_backend, rng):
        q, k, v = make_qkv(rng, n=4)
        with pytest.raises(ValueError, match="cannot be causal: every compressed key"):
            linformer_attention(q, k, v, causal=True)

    def test_errors(self, backend, rng):
        q, k, v = (backend.asarray(x) for x in make_qkv(rng, batch=(2,), n=4, s=6, d=3))
        with pytest.raises(ValueError, match=r"e must have shape \(\.\.\., m, s\) with s=6"):
            linformer_attention(q, k, v, e=backend.asarray(np.ones((3, 5))))
        with pytest.raises(ValueError, match="same m"):
            linformer_attention(q, k, v, e=backend.asarray(np.ones((3, 6))),
                                f=backend.asarray(np.ones((2, 6))))
        with pytest.raises(ValueError, match="f was given without e"):
            linformer_attention(q, k, v, f=backend.asarray(np.ones((3, 6))))
        with pytest.raises(ValueError, match="do not broadcast"):
            linformer_attention(q, k, v, e=backend.asarray(np.ones((3, 2, 6))))
        with pytest.raises(ValueError, match="proj_dim must be >= 1"):
            linformer_attention(q, k, v, proj_dim=0)
        if backend.name not in ("numpy", "numpy_readonly", "numpy_reference"):
            with pytest.raises(TypeError, match="different array libraries"):
                linformer_attention(q, k, v, e=np.ones((3, 6)))

    def test_record_accepts_host_projections(self, backend, rng):
        # The uniform call (used by `arrayattn validate`) takes e/f read from an .npz.
        q, k, v = make_qkv(rng, batch=(2,), n=5, s=7, d=4)
        e, f = rng.standard_normal((3, 7)), rng.standard_normal((3, 7))
        rec = arrayattn.get_variant("linformer")
        out = rec(*(backend.asarray(x) for x in (q, k, v)), e=e, f=f)
        xp_assert_close(out, backend.asarray(linformer_oracle(q, k, v, e, f)), rtol=0,
                        atol=1e-12)
