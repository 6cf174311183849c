"""The kernel checker (issue #41): the zoo of broken kernels is caught and shrunk, the clean
kernels are never flagged, the CLI's exit codes, the repro judged by ``validate``."""
from __future__ import annotations

import os
import sys
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")

sys.path.insert(0, os.path.dirname(__file__))
from zoo import CLEAN, ZOO, broken  # noqa: E402

from arrayattn import cli  # noqa: E402
from arrayattn.testing import check_kernel  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention.*")

#: Each zoo kernel must be found within this budget (the median is far below).
BUDGET = 10


@pytest.mark.parametrize("conv,fn,bug", [z for z in ZOO if not z[0].startswith("jax")],
                         ids=[f"{c}-{b}" for c, _, b in ZOO if not c.startswith("jax")])
def test_zoo_kernel_is_found_and_shrunk(conv, fn, bug):
    res = check_kernel(broken(fn, bug), conv, budget=BUDGET, seed=0)
    assert not res.ok, res.summary()
    assert res.time_to_finding <= BUDGET
    case = res.failure.case
    assert case.n + case.s <= 140 and case.b <= 2 and case.hq <= 4, case.describe()
    assert res.failure.verdict.lines()


def test_threshold_bug_shrinks_to_the_first_failing_length():
    """A kernel wrong only for rows past the first tile of 64 shrinks to n = 65."""
    res = check_kernel(broken(CLEAN["flash_attn"], "tile_drops_last_key"), "flash_attn",
                       budget=BUDGET, seed=0)
    assert res.failure.case.n == 65 and res.failure.case.s == 1


@pytest.mark.parametrize("conv", ["flash_attn", "flash_attn_varlen", "flash_attn_kvcache",
                                  "sdpa", "fla_gla", "fla_gated_delta_rule"])
@pytest.mark.parametrize("seed", [0, 1])
def test_clean_kernels_are_never_flagged(conv, seed):
    res = check_kernel(CLEAN[conv], conv, budget=2, seed=seed)
    assert res.ok, res.summary()


@pytest.mark.parametrize("seed", [0, 5])
def test_torch_sdpa_forward_and_backward_are_not_flagged(seed):
    """torch's own SDPA, gradients included (seed 5 reaches the one-key rows whose dq
    cancels to rounding, once a false finding of the referee)."""
    import torch
    res = check_kernel(torch.nn.functional.scaled_dot_product_attention, "sdpa", budget=6,
                       seed=seed)
    assert res.ok, res.summary()


def test_not_implemented_marks_an_option_unsupported():
    def no_softcap(q, k, v, *args, softcap=0.0, **kw):
        if softcap:
            raise NotImplementedError("softcap")
        return CLEAN["flash_attn"](q, k, v, *args, **kw)
    res = check_kernel(no_softcap, "flash_attn", budget=2, seed=0, dtypes=["float32"],
                       grads=False)
    assert res.ok and any("softcap" in u for u in res.unsupported)


KERNELS = '''
import functools, sys
sys.path.insert(0, {zoo!r})
import zoo
bad = functools.partial(zoo.flash_attn_func, bug="causal_top_left")
good = zoo.flash_attn_func
not_callable = 3
'''


@pytest.fixture()
def kernels(tmp_path, monkeypatch):
    (tmp_path / "my_kernels.py").write_text(KERNELS.format(zoo=os.path.dirname(__file__)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_cli_exit_codes_and_repro(kernels, capsys):
    repro = str(kernels / "repro.npz")
    common = ["--convention", "flash_attn", "--budget", "3", "--dtype", "float32"]
    assert cli.main(["check", "my_kernels:good", *common, "--repro", repro]) == 0
    assert "OK: nothing found" in capsys.readouterr().out
    assert cli.main(["check", "my_kernels:bad", *common, "--repro", repro]) == 1
    out = capsys.readouterr().out
    assert "smallest failing case" in out and "causal=True" in out
    assert cli.main(["validate", repro, "--profile", "flash_attn"]) == 1
    assert "MISMATCH" in capsys.readouterr().out
    for argv in (["check", "no_such_module:f", "--convention", "sdpa"],
                 ["check", "my_kernels:not_callable", "--convention", "sdpa"],
                 ["check", "my_kernels:good", "--convention", "nope"]):
        assert cli.main(argv) == 2
        assert "arrayattn check: error" in capsys.readouterr().err


def test_repro_of_a_gradient_finding_is_judged_by_validate(tmp_path, capsys):
    repro = str(tmp_path / "grad.npz")
    res = check_kernel(broken(CLEAN["flash_attn"], "dk_missing_scale"), "flash_attn",
                       budget=BUDGET, seed=0, dtypes=["float32"], repro=repro)
    assert res.validate.endswith("--profile flash_attn")
    assert cli.main(["validate", repro, "--profile", "flash_attn"]) == 1
    assert "GRADIENTS MISMATCH" in capsys.readouterr().out


def test_repro_of_a_final_state_finding_is_judged_by_validate(tmp_path, capsys):
    repro = str(tmp_path / "state.npz")
    res = check_kernel(broken(CLEAN["fla_gla"], "state_missing_last_chunk"), "fla_gla",
                       budget=BUDGET, seed=0, dtypes=["float32"], repro=repro)
    assert "--variant gla" in res.validate
    argv = res.validate.split()[1:]
    assert cli.main(argv) == 1
    assert "FINAL STATE MISMATCH" in capsys.readouterr().out
