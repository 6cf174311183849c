"""The command line on malformed input: every case a clear message and exit code 2, never
a traceback (issue #15's probe)."""
from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from arrayattn.cli import main


@pytest.fixture
def npz(tmp_path, rng):
    q, k, v = (rng.standard_normal((2, 8, 4)) for _ in range(3))
    path = tmp_path / "mine.npz"
    np.savez(path, q=q, k=k, v=v, out=q)
    return str(path)


@pytest.fixture
def huge(tmp_path, rng):
    """An .npz whose ``out`` header claims 1e15 elements."""
    path = tmp_path / "huge.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (10**15,)})
    with zipfile.ZipFile(path, "w") as z:
        for name in "qkv":
            buf = io.BytesIO()
            np.save(buf, rng.standard_normal((2, 8, 4)))
            z.writestr(name + ".npy", buf.getvalue())
        z.writestr("out.npy", header.getvalue())
    return str(path)


@pytest.mark.parametrize("extra, message", [
    (["--rtol", "-1"], "--rtol must be a finite number >= 0"),
    (["--rtol", "nan"], "--rtol must be a finite number >= 0"),
    (["--option", "key_mask=true"], "key_mask is an array"),
    (["--option", "num_features=1e12"], "larger than any attention computation"),
])
def test_validate_usage_errors(npz, capsys, extra, message):
    assert main(["validate", npz, "--variant", "softmax", *extra]) == 2
    assert message in capsys.readouterr().err


def test_validate_huge_header_refused_before_loading(huge, capsys):
    assert main(["validate", huge, "--variant", "softmax"]) == 2
    assert "claims shape (1000000000000000,)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed must be a non-negative integer"),
    (["--variants", ","], "names no variant"),
    (["--json", "/nonexistent-dir/r.json"], "does not exist"),
])
def test_report_usage_errors(argv, message, capsys):
    assert main(["report", "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_report_json_onto_a_directory(tmp_path, capsys):
    assert main(["report", "--quiet", "--json", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_validate_hints_top_left_alignment(tmp_path, rng, capsys):
    """SDPA's is_causal with n != s aligns top-left: the mismatch verdict says so."""
    from arrayattn import softmax_attention
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 9, 4)), \
        rng.standard_normal((2, 9, 3))
    out = softmax_attention(q, k, v, mask=np.arange(9)[None, :] <= np.arange(6)[:, None])
    path = tmp_path / "sdpa.npz"
    np.savez(path, q=q, k=k, v=v, out=out)
    assert main(["validate", str(path), "--variant", "softmax", "--option", "causal=true"]) == 1
    text = capsys.readouterr().out
    assert "MISMATCH" in text and "top-left causal alignment" in text
    assert "by error / tolerance" in text


def test_validate_takes_a_seed_stored_as_a_0d_integer_array(tmp_path, rng, capsys):
    """``np.savez(..., seed=3)`` stores the seed as a 0-d integer array; validate takes it
    as ``--option seed=3`` (it refused it before: issue #39 point 7), and the seed is
    used: another seed's output is a mismatch."""
    import arrayattn
    q, k, v = (rng.standard_normal((1, 2, 16, 8)) for _ in range(3))
    out = arrayattn.get_variant("performer_positive")(q, k, v, seed=3)
    for seed, code in ((np.array(3), 0), (np.array(3, dtype=np.uint8), 0),
                       (np.array(4), 1)):
        path = tmp_path / f"seed{seed.dtype}{int(seed)}.npz"
        np.savez(path, q=q, k=k, v=v, out=out, seed=seed)
        assert main(["validate", str(path), "--variant", "performer_positive"]) == code
    assert "MATCH" in capsys.readouterr().out
