"""The conformance report (issue #51 point 4): ``arrayattn conformance FILE.md`` runs the
checker on the kernels of this machine and writes one Markdown table (the subcommand did
not exist before)."""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

from arrayattn import cli  # noqa: E402
from arrayattn.testing.check.conformance import (KERNELS, Kernel, Unavailable,  # noqa: E402
                                                 conformance, table)

SDPA = torch.nn.functional.scaled_dot_product_attention


def _broken(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
    """SDPA with the softmax scale off by 10 %."""
    return SDPA(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                scale=0.9 * (scale or q.shape[-1] ** -0.5), enable_gqa=enable_gqa)


def _gone():
    raise Unavailable("needs a GPU")


def test_table_of_a_clean_a_broken_and_an_unavailable_kernel(tmp_path):
    rows = conformance([Kernel("clean", "sdpa", lambda: SDPA),
                        Kernel("broken", "sdpa", lambda: _broken),
                        Kernel("gone", "sdpa", _gone)],
                       budget=1, repro_dir=str(tmp_path))
    text = table(rows, relative_to=str(tmp_path))
    lines = text.splitlines()
    assert lines[0].startswith("| kernel | convention | options covered | dtypes | cases")
    assert len(lines) == 5 and all(len(re.findall(r"(?<!\\)\|", line)) == 11 for line in lines)
    clean, broken, gone = lines[2:]
    assert "| ok |" in clean and "is_causal=True" in clean
    assert re.search(r"\| \d+(-\d+)?; b=\d+ h=\d+ ", clean), clean   # sizes covered
    assert "| FOUND |" in broken and "b=1 h=1 n=1" in broken and "out at " in broken
    assert "`broken.npz`" in broken and (tmp_path / "broken.npz").exists()
    assert "n/a: needs a GPU" in gone


def test_command_writes_the_table(tmp_path, capsys):
    report = tmp_path / "conformance.md"
    assert cli.main(["conformance", str(report), "--budget", "1", "--kernel", "MATH"]) == 0
    text = report.read_text()
    assert "budget 1 s per kernel" in text
    assert "| torch SDPA, MATH backend | sdpa |" in text and "| ok |" in text
    assert not (tmp_path / "conformance_repro").exists()     # no finding, no folder
    assert cli.main(["conformance", str(report), "--kernel", "nothing-like-this"]) == 2
    assert "no such kernel" in capsys.readouterr().err
    assert cli.main(["conformance", str(tmp_path), "--budget", "1"]) == 2


def test_every_backend_and_implementation_is_listed():
    names = " ".join(k.name for k in KERNELS)
    for backend in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        assert backend in names
    assert "flex_attention (eager)" in names and "torch.compile" in names
    assert "implementation='xla'" in names and "sdpa_attention_forward" in names
