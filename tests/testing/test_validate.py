"""``arrayattn.testing.compare_to_reference`` / ``assert_matches_reference`` and the
``arrayattn validate`` command, end to end.

"External" results are computed without arrayattn wherever possible (a plain NumPy port,
torch's scaled_dot_product_attention) so that the tests show what a kernel author sees.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import arrayattn
from arrayattn.cli import main, parse_option, UsageError
from arrayattn.testing import (TOLERANCE_FACTOR, assert_matches_reference,
                               compare_to_reference)
from conftest import make_qkv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain_attention(q, k, v, *, causal=False, key_mask=None, dtype=np.float32):
    """Somebody else's kernel: softmax attention written directly in ``dtype``."""
    q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    logits = q @ np.swapaxes(k, -1, -2) / np.asarray(np.sqrt(q.shape[-1]), dtype)
    n, s = logits.shape[-2:]
    allowed = np.ones((n, s), bool)
    if causal:
        allowed = np.tril(allowed, s - n)
    if key_mask is not None:
        allowed = allowed & key_mask[..., None, :]
    logits = np.where(allowed, logits, -np.inf)
    shift = np.maximum(logits.max(-1, keepdims=True), np.asarray(-1e30, dtype))
    w = np.exp(logits - shift)  # an empty row has w = 0 and returns zeros
    total = w.sum(-1, keepdims=True)
    return ((w / np.where(total > 0, total, 1)) @ v).astype(dtype)


@pytest.fixture
def qkv32(rng):
    q, k, v = make_qkv(rng, batch=(2, 3), n=48, s=48, d=32, dv=16, norm=8.0)
    return tuple(x.astype(np.float32) for x in (q, k, v))


class TestCompareToReference:
    def test_plain_port_passes(self, qkv32):
        q, k, v = qkv32
        c = compare_to_reference(plain_attention(q, k, v), "softmax", q, k, v)
        assert c.ok, c.table()
        assert c.heads == [(i, j) for i in range(2) for j in range(3)]
        assert c.verdict().startswith("MATCH: softmax, 6 head(s), float32 output")

    @pytest.mark.parametrize("head", [(0, 0), (1, 2)])
    def test_one_head_off_by_1e3_fails_naming_it(self, qkv32, head):
        q, k, v = qkv32
        out = plain_attention(q, k, v)
        out[head + (5, 3)] += 1e-3
        c = compare_to_reference(out, "softmax", q, k, v)
        assert [c.heads[i] for i in c.failing] == [head]
        with pytest.raises(AssertionError, match=rf"head \({head[0]}, {head[1]}\): max abs "
                           r"error 0\.001 at query 5, output feature 3"):
            assert_matches_reference(out, "softmax", q, k, v)

    def test_tolerance_boundary(self, qkv32):
        """Half the tolerance passes, twice the tolerance fails: the bound is what it says."""
        q, k, v = qkv32
        ref = plain_attention(q, k, v, dtype=np.float64)
        tol = compare_to_reference(ref.astype(np.float32), "softmax", q, k, v).tolerance
        for mult, ok in ((0.5, True), (2.0, False)):
            out = ref.copy()
            out[0, 1, 7, 2] += mult * tol[1]
            c = compare_to_reference(out.astype(np.float32), "softmax", q, k, v)
            assert c.ok is ok, c.table()

    def test_tolerance_derivation(self, qkv32):
        """tau = F max(own error, eps_out |R|); rounding-level."""
        q, k, v = qkv32
        c = compare_to_reference(plain_attention(q, k, v), "softmax", q, k, v)
        scale = np.abs(plain_attention(q, k, v, dtype=np.float64)).reshape(6, -1).max(1)
        np.testing.assert_allclose(c.tolerance, TOLERANCE_FACTOR * np.maximum(
            c.own_error, 2.0 ** -23 * scale), rtol=1e-6)
        assert np.all(c.own_error > 0) and np.all(c.own_error < 1e-5 * scale)
        # float32 tolerances are ~1e-6 relative: a 1e-4 error anywhere is caught
        assert np.all(c.tolerance < 1e-5 * scale)

    @pytest.mark.parametrize("n", [256, 512])
    def test_other_correct_orders_stay_within_the_own_error(self, n):
        """The factor F = 8 is not tight: correct float32 implementations that sum in
        other orders (blockwise online softmax, a plain port, torch's SDPA) stay within
        2 e_h on diffuse and sharp attention, so they never come near the tolerance."""
        from arrayattn.report.run import Workload, make_inputs
        for case in ("gaussian", "sharp"):
            q, k, v = (x.astype(np.float32) for x in
                       make_inputs(Workload(n=n, heads=2, d=64), case))
            outs = [np.asarray(arrayattn.softmax_attention(q, k, v, block_size=96)),
                    plain_attention(q, k, v)]
            try:
                import torch
                outs.append(torch.nn.functional.scaled_dot_product_attention(
                    *(torch.from_numpy(x) for x in (q, k, v))).numpy())
            except ImportError:
                pass
            for out in outs:
                c = compare_to_reference(out, "softmax", q, k, v)
                assert np.all(c.max_abs <= 2.0 * c.own_error), (case, c.table())

    def test_float64_and_float16(self, qkv32):
        q, k, v = (x.astype(np.float64) for x in qkv32)
        out64 = plain_attention(q, k, v, dtype=np.float64)
        assert_matches_reference(out64, "softmax", q, k, v)
        c64 = compare_to_reference(out64, "softmax", q, k, v)
        assert np.all(c64.tolerance < 1e-12 * np.abs(out64).max())
        bad = out64.copy()
        bad[1, 1] += 1e-9
        with pytest.raises(AssertionError, match=r"head \(1, 1\)"):
            assert_matches_reference(bad, "softmax", q, k, v)
        # float16 inputs and output: rounding-level differences pass (the tolerance is
        # F = 8 roundings of the head's largest entry), a 2% error does not
        q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
        out16 = plain_attention(q16, k16, v16, dtype=np.float32).astype(np.float16)
        assert_matches_reference(out16, "softmax", q16, k16, v16)
        c16 = compare_to_reference(out16, "softmax", q16, k16, v16)
        assert np.all(c16.tolerance <= TOLERANCE_FACTOR * 2.0 ** -10 * 1.01 * np.abs(
            out64).reshape(6, -1).max(1))
        out16[0, 2, 0, 0] += np.float16(0.02 * np.abs(out64[0, 2]).max())
        with pytest.raises(AssertionError, match=r"head \(0, 2\)"):
            assert_matches_reference(out16, "softmax", q16, k16, v16)

    def test_nan_fails(self, qkv32):
        q, k, v = qkv32
        out = plain_attention(q, k, v)
        out[1, 0, 3, 3] = np.nan
        c = compare_to_reference(out, "softmax", q, k, v)
        assert [c.heads[i] for i in c.failing] == [(1, 0)] and c.max_abs[3] == np.inf

    def test_options_and_masks(self, qkv32, rng):
        q, k, v = qkv32
        km = rng.random((2, 3, 48)) < 0.7
        out = plain_attention(q, k, v, causal=True, key_mask=km)
        assert_matches_reference(out, "softmax", q, k, v, causal=True, key_mask=km)
        with pytest.raises(AssertionError, match="MISMATCH"):
            assert_matches_reference(out, "softmax", q, k, v, causal=True)

    def test_rtol_override(self, qkv32):
        q, k, v = qkv32
        out = plain_attention(q, k, v)
        out[0, 0, 0, 0] += 1e-3
        assert not compare_to_reference(out, "softmax", q, k, v).ok
        assert compare_to_reference(out, "softmax", q, k, v, rtol=1e-2).ok

    def test_shape_mismatch(self, qkv32):
        q, k, v = qkv32
        with pytest.raises(ValueError, match=r"out has shape \(2, 3, 48, 15\) but softmax "
                           r"gives \(2, 3, 48, 16\)"):
            compare_to_reference(plain_attention(q, k, v)[..., :15], "softmax", q, k, v)
        with pytest.raises(TypeError, match="floating dtype"):
            compare_to_reference(np.zeros((48, 16), np.int32), "softmax", q, k, v)

    def test_other_libraries(self, qkv32):
        """torch's own SDPA kernel validates against the reference (torch arrays in)."""
        torch = pytest.importorskip("torch")
        q, k, v = (torch.from_numpy(x) for x in qkv32)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_matches_reference(out, "softmax", q, k, v, causal=True)

    @pytest.mark.parametrize("rec", arrayattn.variants(), ids=lambda r: r.name)
    def test_every_variant_float32_run_passes_and_detects_a_head(self, rec, rng):
        """For every registered variant: arrayattn's own float32 output (a correct
        float32 implementation) passes; the same with one head off by 1e-3 fails."""
        q, k, v = make_qkv(rng, batch=(1, 2), n=64, s=64, d=16, dv=8, norm=3.0)
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
        out = np.asarray(rec(q, k, v))
        assert_matches_reference(out, rec.name, q, k, v)
        out = out.copy()
        out[0, 1] += np.float32(1e-3)
        with pytest.raises(AssertionError, match=r"head \(0, 1\)"):
            assert_matches_reference(out, rec.name, q, k, v)


def test_parse_option():
    assert parse_option("num_features=256") == ("num_features", 256)
    assert parse_option("scale=1e-1") == ("scale", 0.1)
    assert parse_option("causal=False") == ("causal", False)
    assert parse_option("pinv=iterative") == ("pinv", "iterative")
    for bad in ("causal", "=3", "2x=1"):
        with pytest.raises(UsageError, match="key=value"):
            parse_option(bad)


class TestValidateCommand:
    @pytest.fixture
    def files(self, tmp_path, qkv32):
        q, k, v = qkv32
        out = plain_attention(q, k, v, causal=True)
        bad = out.copy()
        bad[1, 2, 10, 4] += 1e-3
        paths = {}
        for name, arrays in {
            "ok": dict(q=q, k=k, v=v, out=out),
            "bad": dict(q=q, k=k, v=v, out=bad),
            "missing": dict(q=q, k=k),
            "short_out": dict(q=q, k=k, v=v, out=out[..., :5, :]),
            "vector_q": dict(q=q[0, 0, 0], k=k, v=v, out=out),
            "int_out": dict(q=q, k=k, v=v, out=out.astype(np.int32)),
            "d_mismatch": dict(q=q, k=k[..., :7], v=v, out=out),
        }.items():
            paths[name] = str(tmp_path / f"{name}.npz")
            np.savez(paths[name], **arrays)
        paths["npy"] = str(tmp_path / "single.npy")
        np.save(paths["npy"], q)
        paths["text"] = str(tmp_path / "text.npz")
        with open(paths["text"], "w") as fh:
            fh.write("q k v out\n")
        paths["truncated"] = str(tmp_path / "truncated.npz")
        with open(paths["ok"], "rb") as src, open(paths["truncated"], "wb") as dst:
            dst.write(src.read()[:200])
        return paths

    def run(self, capsys, *argv):
        code = main(["validate", *argv])
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    def test_correct_result_passes(self, files, capsys):
        code, out, err = self.run(capsys, files["ok"], "--variant", "softmax",
                                  "--option", "causal=true")
        assert code == 0, out + err
        assert out.strip().splitlines()[-1].startswith("MATCH: softmax, 6 head(s), float32")
        assert out.count(" ok") == 6

    def test_one_head_off_fails_naming_it(self, files, capsys):
        code, out, err = self.run(capsys, files["bad"], "--variant", "softmax",
                                  "--option", "causal=true")
        assert code == 1
        verdict = out.strip().splitlines()[-1]
        assert verdict.startswith("MISMATCH: softmax, 1 of 6 head(s) over tolerance")
        assert "head (1, 2): max abs error 0.001 at query 10, output feature 4" in verdict
        fails = [ln for ln in out.splitlines() if ln.endswith("FAIL")]
        assert len(fails) == 1 and fails[0].startswith("(1, 2)")

    def test_wrong_option_is_a_mismatch(self, files, capsys):
        code, out, _ = self.run(capsys, files["ok"], "--variant", "softmax")
        assert code == 1 and "6 of 6 head(s)" in out

    def test_extra_arrays_become_options(self, tmp_path, qkv32, rng, capsys):
        q, k, v = qkv32
        km = rng.random((2, 3, 48)) < 0.6
        path = str(tmp_path / "masked.npz")
        np.savez(path, q=q, k=k, v=v, out=plain_attention(q, k, v, key_mask=km), key_mask=km)
        code, out, _ = self.run(capsys, path, "--variant", "softmax_blockwise")
        assert code == 0 and "options {'key_mask': 'array(2, 3, 48)'}" in out
        code, _, err = self.run(capsys, path, "--variant", "softmax", "--option",
                                "key_mask=none")
        assert code == 2 and "key_mask given both" in err

    @pytest.mark.parametrize("name, message", [
        ("missing", r"lacks array\(s\) v, out; it holds k, q"),
        ("short_out", r"out has shape \(2, 3, 5, 16\) but softmax gives \(2, 3, 48, 16\)"),
        ("vector_q", r"q must have shape \(\.\.\., tokens, features\); got \(32,\)"),
        ("int_out", "out must be a floating array; got dtype int32"),
        ("d_mismatch", r"k"),
        ("npy", r"single \.npy array, not an \.npz archive"),
        ("text", r"not an \.npz file \(no zip signature"),
        ("truncated", r"not a readable \.npz file|cannot be read"),
    ])
    def test_malformed_files(self, files, capsys, name, message):
        code, out, err = self.run(capsys, files[name], "--variant", "softmax")
        assert code == 2, (out, err)
        assert out == ""
        assert err.startswith("arrayattn validate: error: ")
        assert len(err.strip().splitlines()) == 1  # one clear line, no traceback
        import re
        assert re.search(message, err), err

    def test_usage_errors(self, files, capsys, tmp_path):
        code, _, err = self.run(capsys, files["ok"], "--variant", "no_such")
        assert code == 2 and "no variant named 'no_such'; registered: softmax" in err
        code, _, err = self.run(capsys, str(tmp_path / "absent.npz"), "--variant", "softmax")
        assert code == 2 and "cannot open" in err
        code, _, err = self.run(capsys, files["ok"], "--variant", "softmax", "--option", "x")
        assert code == 2 and "key=value" in err
        code, _, err = self.run(capsys, files["ok"], "--variant", "softmax", "--option",
                                "no_such_option=1")
        assert code == 2 and "no_such_option" in err and len(err.strip().splitlines()) == 1
        code, _, err = self.run(capsys, files["ok"], "--variant", "softmax", "--option",
                                "block_size=-3")
        assert code == 2 and "block_size" in err
        code, _, err = self.run(capsys, files["ok"])  # neither --variant nor --profile
        assert code == 2 and "--variant" in err and "--profile" in err
        with pytest.raises(SystemExit) as exc:  # argparse: unknown layout / profile
            main(["validate", files["ok"], "--variant", "softmax", "--layout", "nhbd"])
        assert exc.value.code == 2
        with pytest.raises(SystemExit) as exc:
            main(["validate", files["ok"], "--profile", "no_such_port"])
        assert exc.value.code == 2
        code, _, err = self.run(capsys, files["ok"], "--profile", "sdpa", "--option",
                                "causal=true")  # a profile takes the port's own options
        assert code == 2 and "is_causal" in err and "causal" in err

    def test_subprocess_exit_codes(self, files):
        """``python -m arrayattn validate`` as a user runs it."""
        for name, expected in (("ok", 0), ("bad", 1), ("missing", 2)):
            res = subprocess.run(
                [sys.executable, "-m", "arrayattn", "validate", files[name], "--variant",
                 "softmax", "--option", "causal=true"],
                cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert res.returncode == expected, res.stdout + res.stderr
            if expected < 2:
                assert res.stdout.strip().splitlines()[-1].startswith(
                    ("MATCH", "MISMATCH")[expected])


def _registered(name):
    return name in {r.name for r in arrayattn.variants()}


class TestPeerRandomMatrices:
    """A peer's own implementation with its own random matrix, saved in the .npz file:
    the reference replays the matrix, so the same rounding-level tolerance applies.
    (Active once the family's variant is registered.)"""

    def save(self, tmp_path, name, **arrays):
        path = str(tmp_path / f"{name}.npz")
        np.savez(path, **arrays)
        return path

    def check(self, tmp_path, capsys, variant, out, head, **arrays):
        good = self.save(tmp_path, "good", out=out, **arrays)
        assert main(["validate", good, "--variant", variant]) == 0, capsys.readouterr().out
        bad_out = out.copy()
        bad_out[head] += np.float32(1e-3)
        bad = self.save(tmp_path, "bad", out=bad_out, **arrays)
        capsys.readouterr()
        assert main(["validate", bad, "--variant", variant]) == 1
        verdict = capsys.readouterr().out.strip().splitlines()[-1]
        assert "1 of 6 head(s)" in verdict and f"head {head}:" in verdict

    def test_performer_with_peer_omega(self, tmp_path, capsys, rng):
        """FAVOR+ positive features written from the paper in float32: phi(x) =
        m^-1/2 exp(omega x~ - |x~|^2/2), x~ = d^-1/4 x; iid Gaussian omega of the peer's."""
        if not _registered("performer_positive"):
            pytest.skip("performer_positive is not registered in this branch")
        b, h, n, d, m = 2, 3, 64, 16, 32
        q, k, v = (0.5 * rng.standard_normal((b, h, n, d)).astype(np.float32)
                   for _ in range(3))
        omega = rng.standard_normal((m, d)).astype(np.float32)

        def phi(x):
            x = x * np.float32(d ** -0.25)
            return (np.exp(x @ omega.T - (x * x).sum(-1, keepdims=True) / 2)
                    / np.float32(np.sqrt(m)))
        pq, pk = phi(q), phi(k)
        out = (pq @ (np.swapaxes(pk, -1, -2) @ v)) / (pq @ pk.sum(-2)[..., None])
        self.check(tmp_path, capsys, "performer_positive", out.astype(np.float32), (1, 0),
                   q=q, k=k, v=v, omega=omega)

    def test_linformer_with_peer_projections(self, tmp_path, capsys, rng):
        """Linformer written from the paper in float32: softmax(q (E k)^T / sqrt(d)) (F v)
        with the peer's own E, F (m, s)."""
        if not _registered("linformer"):
            pytest.skip("linformer is not registered in this branch")
        b, h, n, d, m = 2, 3, 64, 16, 8
        q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3))
        e, f = (rng.standard_normal((m, n)).astype(np.float32) / np.float32(np.sqrt(m))
                for _ in range(2))
        logits = q @ np.swapaxes(e @ k, -1, -2) / np.float32(np.sqrt(d))
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out = (w / w.sum(-1, keepdims=True)) @ (f @ v)
        self.check(tmp_path, capsys, "linformer", out.astype(np.float32), (0, 2),
                   q=q, k=k, v=v, e=e, f=f)


def top_left_attention(q, k, v, dtype=np.float32):
    """SDPA's ``is_causal`` (query i sees keys j <= i, top-left), written in NumPy."""
    q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    logits = q @ np.swapaxes(k, -1, -2) / np.asarray(np.sqrt(q.shape[-1]), dtype)
    n, s = logits.shape[-2:]
    logits = np.where(np.tril(np.ones((n, s), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return ((w / w.sum(-1, keepdims=True)) @ v).astype(dtype)


class TestLayoutAndProfiles:
    """``layout=`` and ``profile=`` without any port installed (NumPy stand-ins)."""

    def test_bnhd_layout_equals_bhnd(self, qkv32):
        q, k, v = qkv32
        out = plain_attention(q, k, v, causal=True)
        t = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2)))
        a = compare_to_reference(out, "softmax", q, k, v, causal=True)
        b = compare_to_reference(t(out), "softmax", t(q), t(k), t(v), causal=True,
                                 layout="bnhd")
        assert a.ok and b.ok and a.heads == b.heads
        np.testing.assert_array_equal(a.max_abs, b.max_abs)
        bad = t(out)
        bad[1, 10, 2, 4] += 1e-3   # batch 1, token 10, head 2
        c = compare_to_reference(bad, "softmax", t(q), t(k), t(v), causal=True, layout="bnhd")
        assert [c.heads[i] for i in c.failing] == [(1, 2)] and c.worst[c.failing[0]] == (10, 4)

    def test_bnhd_key_mask_is_batch_by_tokens(self, rng):
        q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 3), n=24, d=8))
        km = rng.random((2, 24)) < 0.7
        out = plain_attention(q, k, v, key_mask=km[:, None, :])
        t = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2)))
        assert_matches_reference(t(out), "softmax", t(q), t(k), t(v), key_mask=km,
                                 layout="bnhd")

    def test_bad_layout(self, qkv32):
        q, k, v = qkv32
        with pytest.raises(ValueError, match="layout"):
            compare_to_reference(q, "softmax", q, k, v, layout="nhbd")

    @pytest.mark.parametrize("n, s", [(24, 40), (40, 24)])
    def test_sdpa_profile_top_left(self, rng, n, s):
        q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 3), n=n, s=s, d=16,
                                                           norm=6.0, sharp=True))
        out = top_left_attention(q, k, v)
        assert compare_to_reference(out, None, q, k, v, profile="sdpa", is_causal=True).ok
        c = compare_to_reference(out, "softmax", q, k, v, causal=True)  # end-aligned
        assert not c.ok and c.rel.max() > 0.1

    def test_sdpa_profile_gqa_and_scale(self, rng):
        q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 6), n=32, d=16))
        kk, vv = k[:, ::3], v[:, ::3]                       # 2 key/value heads
        out = plain_attention(q * np.float32(0.7 * 4.0), np.repeat(kk, 3, axis=1),
                              np.repeat(vv, 3, axis=1))      # scale 0.7 = 0.7*4 / sqrt(16)
        assert_matches_reference(out, None, q, kk, vv, profile="sdpa", enable_gqa=True,
                                 scale=0.7, rtol=None)
        with pytest.raises(AssertionError):  # wrong grouping (tile, not repeat) is caught
            assert_matches_reference(plain_attention(q, np.tile(kk, (1, 3, 1, 1)),
                                                     np.tile(vv, (1, 3, 1, 1))),
                                     None, q, kk, vv, profile="sdpa", enable_gqa=True)

    def test_profile_errors(self, qkv32):
        q, k, v = qkv32
        with pytest.raises(ValueError, match="profile must be one of"):
            compare_to_reference(q, None, q, k, v, profile="nope")
        with pytest.raises(ValueError, match="unknown option"):
            compare_to_reference(q, None, q, k, v, profile="sdpa", causal=True)
        with pytest.raises(ValueError, match="validates 'softmax'"):
            compare_to_reference(q, "linear_elu", q, k, v, profile="sdpa")
        with pytest.raises(ValueError, match="variant is required"):
            compare_to_reference(q, None, q, k, v)
        with pytest.raises(ValueError, match="projection_matrix"):
            compare_to_reference(q, None, q, k, v, profile="performer_pytorch")

    def test_lucidrains_front_padding_profile(self, rng):
        """The profile pads zero tokens in front (the port's F.pad) and keeps the last n."""
        q, k, v = make_qkv(rng, batch=(2, 2), n=30, d=8)
        z = np.zeros((2, 2, 2, 8))
        padded = [np.concatenate([z, x], axis=-2) for x in (q, k, v)]
        out = arrayattn.nystrom_attention(*padded, num_landmarks=8, pinv_init="global")
        out = out[..., 2:, :]
        assert_matches_reference(out, None, q, k, v, profile="lucidrains_nystrom",
                                 num_landmarks=8)
        assert not compare_to_reference(out, "nystrom_iterative", q, k, v,
                                        num_landmarks=8, pinv_init="global").ok

    def test_verdict_reports_float64_error_and_baseline(self, qkv32):
        """A float32 kernel 1e4 x rounding off (fla-like) is named as such, not hidden."""
        q, k, v = qkv32
        out = plain_attention(q, k, v)
        c = compare_to_reference(out, "softmax", q, k, v)
        assert c.ok and "error vs float64" in c.verdict()
        assert np.all(c.own_rel > 0) and np.all(c.own_rel < 1e-5)
        sloppy = out * np.float32(1 + 1e-3)
        c = compare_to_reference(sloppy, "softmax", q, k, v)
        text = c.precision()
        assert not c.ok and "this output 0.001" in text and "plain float32" in text
        ratio = float(text.split("(")[-1].split("x")[0])
        assert ratio > 100


class TestValidateLayoutProfileCLI:
    def run(self, capsys, *argv):
        code = main(["validate", *argv])
        cap = capsys.readouterr()
        return code, cap.out, cap.err

    def test_layout_bnhd(self, capsys, tmp_path, qkv32):
        q, k, v = qkv32
        out = plain_attention(q, k, v, causal=True)
        t = (lambda x: np.ascontiguousarray(np.swapaxes(x, 1, 2)))
        path = str(tmp_path / "bnhd.npz")
        np.savez(path, q=t(q), k=t(k), v=t(v), out=t(out))
        code, stdout, err = self.run(capsys, path, "--variant", "softmax", "--option",
                                     "causal=true", "--layout", "bnhd")
        assert code == 0, stdout + err
        code, *_ = self.run(capsys, path, "--variant", "softmax", "--option", "causal=true")
        assert code == 1  # read as bhnd: tokens taken for heads, a different problem

    def test_profile_sdpa_top_left(self, capsys, tmp_path, rng):
        q, k, v = (x.astype(np.float32) for x in make_qkv(rng, batch=(2, 2), n=16, s=32, d=8))
        path = str(tmp_path / "sdpa.npz")
        np.savez(path, q=q, k=k, v=v, out=top_left_attention(q, k, v))
        code, stdout, err = self.run(capsys, path, "--profile", "sdpa", "--option",
                                     "is_causal=true")
        assert code == 0, stdout + err
        assert "profile sdpa" in stdout and "error vs float64" in stdout.splitlines()[-1]
        code, stdout, _ = self.run(capsys, path, "--variant", "softmax", "--option",
                                   "causal=true")
        assert code == 1 and stdout.splitlines()[-1].startswith("MISMATCH")


def test_a_file_of_gradients_alone_is_judged_without_out(tmp_path, capsys):
    """q, k, v, do and gradients, no out: the gradients' verdict only (exit 0 / 1); without
    do, out stays required."""
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.standard_normal((2, 24, 8), dtype=np.float32) for _ in range(4))
    g = arrayattn.vjp("softmax", q, k, v, do, causal=True)
    path = str(tmp_path / "grads.npz")
    np.savez(path, q=q, k=k, v=v, do=do, dq=g["q"], dk=g["k"], dv=g["v"])
    assert main(["validate", path, "--variant", "softmax", "--option", "causal=true"]) == 0
    out = capsys.readouterr().out
    assert "GRADIENTS MATCH" in out and "\nMATCH" not in out
    g["k"][1, 3, 2] += 1e-3
    np.savez(path, q=q, k=k, v=v, do=do, dq=g["q"], dk=g["k"], dv=g["v"])
    assert main(["validate", path, "--variant", "softmax", "--option", "causal=true"]) == 1
    assert "GRADIENTS MISMATCH: softmax: dk" in capsys.readouterr().out
    np.savez(path, q=q, k=k, v=v)
    assert main(["validate", path, "--variant", "softmax"]) == 2
    assert "lacks array(s) out" in capsys.readouterr().err
