"""The explanation of a finding (issue #50): the named deviation a broken kernel matches,
the dimensions the failure needs, the positions in words, and the paths a new user takes
(the kernel's module in the current directory, a convention typo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")

sys.path.insert(0, os.path.dirname(__file__))
from zoo import CLEAN, EXPECTED, GIVEN, MORE, ZOO, broken  # noqa: E402

from arrayattn import cli  # noqa: E402
from arrayattn.testing import check_kernel, compare_grads, compare_lse  # noqa: E402
from arrayattn.testing.check import get_convention  # noqa: E402
from arrayattn.testing.check.explain import DEVIATIONS, explain  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention.*")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
KERNEL = {(conv, bug): fn for conv, fn, bug in ZOO}


def _check(conv, fn, bug, **kw):
    return check_kernel(broken(fn, bug), conv, budget=10, seed=0, dtypes=["float32"], **kw)


#: Zoo bugs whose named deviation the checker must give (the most common mistakes). On the
#: code before issue #50 a finding had no explanation at all.
NAMED = [("flash_attn", "causal_top_left"), ("flash_attn", "scale_twice"),
         ("flash_attn", "gqa_mod"), ("flash_attn", "window_off_by_one"),
         ("flash_attn", "alibi_sign"), ("flash_attn", "lse_log2"),
         ("flash_attn", "empty_row_nan"), ("sdpa", "bottom_right"),
         ("flash_attn", "dk_missing_scale"), ("fla_gla", "gate_late")]


@pytest.mark.parametrize("conv,bug", NAMED, ids=[f"{c}-{b}" for c, b in NAMED])
def test_zoo_bug_gets_its_named_deviation(conv, bug):
    res = _check(conv, KERNEL[conv, bug], bug)
    assert not res.ok
    exp = res.explanation
    assert exp is not None and exp.names[:1] == [EXPECTED[bug]], res.summary()
    assert exp.likely.startswith("likely: ") and " of " in exp.likely
    assert "likely: " in res.summary() and "dimensions: " in res.summary()


@pytest.mark.parametrize("conv,fn,bug,expected", MORE, ids=[m[2] for m in MORE])
def test_more_deviations_are_named(conv, fn, bug, expected):
    res = _check(conv, fn, bug)
    assert not res.ok and res.explanation.names[:1] == [expected], res.summary()


@pytest.mark.parametrize("conv,bug", [("flash_attn", "tile_drops_last_key"),
                                      ("flash_attn", "dv_not_transposed"),
                                      ("fla_gla", "state_missing_last_chunk")])
def test_bug_outside_the_catalogue_names_nothing(conv, bug):
    """No near miss: a bug no entry describes says so."""
    res = _check(conv, KERNEL[conv, bug], bug)
    assert not res.ok and res.explanation.names == [], res.summary()
    assert res.explanation.likely.startswith("no named deviation matches")


@pytest.mark.parametrize("bug,options,expected", GIVEN, ids=[g[0] for g in GIVEN])
def test_explain_names_a_given_case(bug, options, expected):
    """Bugs the search reaches only by random draws (too slow for a test's budget): the
    explanation of a failing case given directly."""
    from arrayattn.testing.check.cases import Case
    case = Case(hq=4, hkv=2, n=3, s=6, d=8, dv=8).with_options(**options)
    exp = explain(broken(CLEAN["flash_attn"], bug), get_convention("flash_attn"), case)
    assert exp is not None and exp.names[:1] == [expected], exp


def test_dimensions_say_what_the_failure_needs():
    res = _check("flash_attn", KERNEL["flash_attn", "causal_top_left"], "causal_top_left")
    dims = res.explanation.dims
    assert "fails for every seed, magnitude" in dims, dims
    assert "needs" in dims and "causal=True" in dims and "n != s" in dims, dims


def test_explain_on_a_passing_case_is_none():
    conv = get_convention("flash_attn")
    from arrayattn.testing.check.cases import Case
    assert explain(CLEAN["flash_attn"], conv, Case(n=4, s=6)) is None


def test_catalogue_entries_are_unique_and_documented():
    names = [d.name for d in DEVIATIONS]
    assert len(names) == len(set(names)) and all(d.sentence for d in DEVIATIONS)


def test_json_carries_the_explanation(tmp_path, monkeypatch, capsys):
    (tmp_path / "kern.py").write_text(
        f"import functools, sys\nsys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import zoo\nbad = functools.partial(zoo.flash_attn_func, bug='scale_twice')\n")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "res.json"
    code = cli.main(["check", "kern:bad", "--convention", "flash_attn", "--budget", "3",
                     "--dtype", "float32", "--repro", str(tmp_path / "r.npz"),
                     "--json", str(out)])
    assert code == 1
    text = capsys.readouterr().out
    assert "likely: the softmax scale applied twice" in text
    failure = json.loads(out.read_text())["failure"]
    assert failure["deviations"][0] == "scale_twice" and failure["likely"].startswith("likely")
    assert failure["dimensions"]


# -- positions in words ------------------------------------------------------------------
def test_positions_are_said_in_words():
    """'query 0, output feature 6', not 'column 6' (the old text)."""
    import arrayattn
    from arrayattn.testing import compare_to_reference
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((2, 6, 4)) for _ in range(4))
    out, lse = arrayattn.softmax_attention(q, k, v, return_lse=True)
    bad = np.array(out)
    bad[1, 2, 3] += 1e-3
    c = compare_to_reference(bad, "softmax", q, k, v)
    assert "at query 2, output feature 3" in c.head_line(c.failing[0])
    lse = np.array(lse)
    lse[0, 4] += 1e-3
    c = compare_lse(lse, "softmax", q, k, v)
    assert "at query 4 (" in c.head_line(c.failing[0])
    g = {name: np.array(x) for name, x in arrayattn.vjp("softmax", q, k, v, do).items()}
    g["k"][0, 5, 1] += 1e-3
    c = compare_grads(g, "softmax", q, k, v, do).items["k"]
    assert "at key 5, feature 1" in c.head_line(c.failing[0])


# -- the paths a new user takes -----------------------------------------------------------
def test_convention_typo_suggests_the_close_name():
    with pytest.raises(ValueError, match="did you mean 'flash_attn'"):
        get_convention("flash-attn")


def test_check_finds_the_kernel_in_the_current_directory(tmp_path):
    """A console script's sys.path starts at its bin directory, not the current one: before
    issue #50 ``arrayattn check mykern:fn`` failed there with ModuleNotFoundError."""
    (tmp_path / "mykern.py").write_text(
        "from torch.nn.functional import scaled_dot_product_attention as fn\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "arrayattn"
    script.write_text("import sys\nfrom arrayattn.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, str(script), "check", "mykern:fn", "--convention",
                           "sdpa", "--budget", "1", "--dtype", "float32", "--no-grads",
                           "--repro", str(tmp_path / "r.npz")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "cannot import" not in proc.stderr, proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_check_kernel_documents_device_and_log():
    doc = check_kernel.__doc__
    assert "device : str" in doc and "log : callable" in doc
