"""The checker never breaks on a kernel (issue #48 point 4, issue #50 points 2.3, 2.4): a
kernel that raises is a finding with its summary, JSON and an inputs-only repro; a
shape-only NotImplementedError marks the shape unsupported; a finding that passes on
re-run is FLAKY; the printed validate command works as printed; the same seed gives the
same cases whatever is imported; validate prints option values; a repro file is judged
by ``arrayattn validate FILE`` alone."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

sys.path.insert(0, os.path.dirname(__file__))
from zoo import CLEAN, broken  # noqa: E402

import arrayattn  # noqa: E402
from arrayattn import cli  # noqa: E402
from arrayattn.testing import check_kernel  # noqa: E402
from arrayattn.testing.check import search as search_mod  # noqa: E402
from arrayattn.testing.check.cases import Case  # noqa: E402
from arrayattn.testing.check.conventions import get_convention  # noqa: E402
from arrayattn.testing.check.draws import local_constants_off  # noqa: E402
from arrayattn.testing.check.judge import Verdict  # noqa: E402
from arrayattn.testing.check.unsupported import Unsupported, isolate_unsupported  # noqa: E402

warnings.filterwarnings("ignore", message=".*flex_attention.*")

SDPA = torch.nn.functional.scaled_dot_product_attention
FAST = dict(budget=2, seed=0, dtypes=["float32"], grads=False)


def raise_on_causal(q, k, v, *args, causal=False, **kw):
    """flash_attn_func that raises RuntimeError on every causal call."""
    if causal:
        raise RuntimeError("no causal kernel compiled")
    return CLEAN["flash_attn"](q, k, v, *args, causal=causal, **kw)


# -- 1. a kernel that raises ------------------------------------------------------------
def test_raising_kernel_is_a_finding_with_an_inputs_repro(tmp_path, capsys):
    """Old code: write_repro ran the kernel again and its RuntimeError escaped
    check_kernel (no KernelCheck, no summary)."""
    repro = str(tmp_path / "raised.npz")
    res = check_kernel(raise_on_causal, "flash_attn", repro=repro, **FAST)
    assert not res.ok and not res.flaky
    assert "RuntimeError: no causal kernel compiled" in res.failure.verdict.error
    text = res.summary()
    assert "FOUND" in text and "no causal kernel compiled" in text and repro in text
    with np.load(repro) as f:
        assert {"q", "k", "v", "do", "__meta__"} <= set(f.files) and "out" not in f.files
        meta = json.loads(str(f["__meta__"]))
    assert "no causal kernel compiled" in meta["error"] and meta["profile"] == "flash_attn"
    assert cli.main(["validate", repro]) == 1
    out = capsys.readouterr().out
    assert "KERNEL RAISED" in out and "no causal kernel compiled" in out


KERNELS = '''
import sys
sys.path.insert(0, {zoo!r})
import torch
import zoo

def raising(q, k, v, *args, causal=False, **kw):
    if causal:
        raise RuntimeError("no causal kernel compiled")
    return zoo.flash_attn_func(q, k, v, *args, causal=causal, **kw)

SEEN = set()

def compiled_once(q, k, v, *args, **kw):
    """Wrong on the first call of each shape (a stale compile cache), right afterwards."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kw)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    if key in SEEN:
        return out
    SEEN.add(key)
    return out * 1.01
'''


@pytest.fixture()
def kernels(tmp_path, monkeypatch):
    (tmp_path / "robust_kernels.py").write_text(KERNELS.format(zoo=os.path.dirname(__file__)))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("robust_kernels", None)
    return tmp_path


def test_raising_kernel_through_the_cli(kernels, capsys):
    """Old code: a traceback out of cli.main, no summary, no JSON (--repro has a default)."""
    repro, js = str(kernels / "r.npz"), str(kernels / "r.json")
    code = cli.main(["check", "robust_kernels:raising", "--convention", "flash_attn",
                     "--budget", "2", "--dtype", "float32", "--no-grads", "--repro", repro,
                     "--json", js])
    captured = capsys.readouterr()
    assert code == 1 and "Traceback" not in captured.err
    assert "FOUND" in captured.out and "no causal kernel compiled" in captured.out
    report = json.load(open(js))
    assert report["status"] == "FOUND" and not report["flaky"]
    assert "no causal kernel compiled" in report["failure"]["lines"][0]
    assert report["repro"] == repro and os.path.exists(repro)


def test_repro_that_cannot_be_written_is_a_note_not_a_crash(tmp_path):
    res = check_kernel(raise_on_causal, "flash_attn", repro=str(tmp_path / "no" / "r.npz"),
                       **FAST)
    assert not res.ok and res.repro is None
    assert "could not be written" in res.summary()


# -- 2. NotImplementedError of a shape ----------------------------------------------------
def test_isolation_of_each_shape_property():
    """Each property alone on the plainest case; old code had no shape step (an option
    took the blame, or RuntimeError on the plainest case)."""
    conv = get_convention("sdpa")
    case = Case(b=2, hq=4, hkv=2, n=7, s=65, d=64, dv=8).with_options(is_causal=True)
    for raises, label in ((lambda c: c.b > 1, "b > 1"),
                          (lambda c: c.hq != c.hkv, "hq != hkv (GQA)"),
                          (lambda c: c.n < c.s, "n < s"),
                          (lambda c: c.d == 64, "d=64"),
                          (lambda c: c.dv != c.d, "dv != d")):
        what = isolate_unsupported(case, conv, raises)
        assert str(what) == label and what.kind == "shape"
        assert what.matches(case) and not what.matches(Case())
    assert isolate_unsupported(case, conv, lambda c: True) is None   # the plainest too
    opt = isolate_unsupported(case, conv, lambda c: c.opts.get("is_causal", False))
    assert opt == Unsupported("option", ("is_causal", True), "is_causal=True")
    both = Case().with_options(is_causal=True, scale=0.3)
    combo = isolate_unsupported(both, conv, lambda c: len(c.active()) == 2)
    assert combo.kind == "options" and combo.matches(both)
    assert not combo.matches(Case().with_options(is_causal=True))


def test_shape_only_not_implemented_marks_the_shape_and_the_search_goes_on():
    """torch's CPU flash backend needs dv == d; kernels built for some head dims only."""
    def dv_equals_d(q, k, v, *args, **kw):
        if v.shape[-1] != q.shape[-1]:
            raise NotImplementedError("dv != d")
        return SDPA(q, k, v, *args, **kw)

    def some_dims(q, k, v, *args, **kw):
        if q.shape[-1] not in (16, 32):
            raise NotImplementedError("head dim")
        return SDPA(q, k, v, *args, **kw)

    res = check_kernel(dv_equals_d, "sdpa", **FAST)
    assert res.ok and res.unsupported == ["dv != d"], res.summary()
    assert "unsupported (NotImplementedError): dv != d" in res.summary()
    res = check_kernel(some_dims, "sdpa", **FAST)
    # every head dim the search reaches but 16 and 32 (the reach adds 40 ... 256)
    assert res.ok and {"d=8", "d=64"} <= set(res.unsupported), res.summary()
    assert not {"d=16", "d=32"} & set(res.unsupported)
    assert res.cases > 30


def test_not_implemented_everywhere_is_a_finding_not_a_crash():
    """Old code: RuntimeError("the kernel raises NotImplementedError on the plainest case")."""
    def nothing(*args, **kw):
        raise NotImplementedError

    res = check_kernel(nothing, "sdpa", **FAST)
    assert not res.ok and not res.flaky
    assert "plainest case" in res.failure.verdict.error


# -- 3. a flaky kernel --------------------------------------------------------------------
def test_flaky_kernel_is_reported_with_both_results(tmp_path, capsys):
    """Old code re-evaluated the case after the search and showed that verdict (ok):
    FOUND with no failing line."""
    seen = set()

    def compiled_once(q, k, v, *args, **kw):
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
        out = SDPA(q, k, v, *args, **kw)
        if key in seen:
            return out
        seen.add(key)
        return out * 1.01

    repro = str(tmp_path / "flaky.npz")
    res = check_kernel(compiled_once, "sdpa", repro=repro, **FAST)
    assert not res.ok and res.flaky and repr(res).startswith("<KernelCheck FLAKY")
    assert not res.failure.verdict.ok and res.failure.verdict.lines()
    assert res.rerun.verdict.ok
    text = res.summary()
    assert "FLAKY" in text and "failed once" in text and "out: MISMATCH" in text
    assert "passed on re-run" in text
    assert cli.main(["validate", repro]) == 1       # the file holds the failing output
    assert "MISMATCH" in capsys.readouterr().out


def test_flaky_kernel_through_the_cli(kernels, capsys):
    js = str(kernels / "f.json")
    code = cli.main(["check", "robust_kernels:compiled_once", "--convention", "sdpa",
                     "--budget", "2", "--dtype", "float32", "--no-grads", "--repro",
                     str(kernels / "f.npz"), "--json", js])
    out = capsys.readouterr().out
    assert code == 1 and "FLAKY" in out and "passed on re-run" in out
    report = json.load(open(js))
    assert report["flaky"] and report["status"] == "FLAKY"
    assert report["failure"]["lines"] and not report["rerun"]["fails"]


def test_hypothesis_giving_up_on_a_flaky_condition_is_not_a_crash():
    import hypothesis

    gave_up = search_mod._hypothesis_gave_up
    assert gave_up(hypothesis.errors.Flaky("unreliable"), hypothesis)
    assert gave_up(hypothesis.errors.Unsatisfiable("no"), hypothesis)
    assert not gave_up(ValueError("a bug of the checker"), hypothesis)
    assert not gave_up(hypothesis.errors.InvalidArgument("settings"), hypothesis)


# -- 4. the validate command as printed --------------------------------------------------
class WindowAdapter:
    """A custom convention with arrayattn's ``window=(left, right)`` (a tuple option)."""

    options = ("window",)
    layout = "bhnd"

    def call(self, fn, q, k, v, window=None):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return fn(q, k, v, window_size=window or (-1, -1)).transpose(1, 2)


def test_printed_validate_command_works_as_printed(tmp_path, capsys):
    """Old code printed --option window=(3, 0) unquoted, and validate refused the text."""
    assert cli.parse_option("window=(3, 0)") == ("window", (3, 0))
    assert cli.parse_option("window=3,0") == ("window", (3, 0))
    assert cli.parse_option("window=[none, 0]") == ("window", (None, 0))
    assert cli.parse_option("name=a,b") == ("name", "a,b")
    repro = str(tmp_path / "dir with space" / "w.npz")
    os.makedirs(os.path.dirname(repro))
    res = check_kernel(broken(CLEAN["flash_attn"], "window_off_by_one"), WindowAdapter(),
                       repro=repro, **FAST)
    assert not res.ok and "window=" in res.validate, res.summary()
    argv = shlex.split(res.validate)
    assert argv[:2] == ["arrayattn", "validate"] and argv[2] == repro
    assert cli.main(argv[1:]) == 1
    assert "MISMATCH" in capsys.readouterr().out


# -- 5. the same seed, the same cases --------------------------------------------------
RECORD = '''
import json, sys
if sys.argv[1] == "with":
    sys.path.insert(0, {tmp!r})
    import many_integers  # noqa: F401  (a local module: its literals join Hypothesis's draws)
from arrayattn.testing.check import search as S
from arrayattn.testing.check.judge import Verdict
from arrayattn.testing import check_kernel
seen = []

def evaluate(self, case):
    seen.append(case.describe())
    if len(seen) >= {count}:
        raise S.OutOfTime
    return S.Outcome(case, Verdict([]))

S.Search.evaluate = evaluate
check_kernel(lambda *a, **k: None, "flash_attn", budget=60, seed=3, dtypes=["float32"])
print(json.dumps(seen))
'''


def test_same_seed_same_cases_whatever_is_imported(tmp_path):
    """Old code: the draws changed from the ~77th case on once a module of integers was
    imported (Hypothesis's constants from the local source)."""
    count = 220
    (tmp_path / "many_integers.py").write_text(
        "X = [" + ", ".join(str(i) for i in range(3, 160, 4)) + "]\n"
        "Y = " + " + ".join(str(i) for i in range(1000, 60000, 977)) + "\n")
    script = tmp_path / "record.py"
    script.write_text(RECORD.format(tmp=str(tmp_path), count=count))
    root = os.path.dirname(os.path.dirname(arrayattn.__file__))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = [json.loads(subprocess.run([sys.executable, str(script), mode], cwd=tmp_path,
                                      env=env, capture_output=True, text=True,
                                      check=True).stdout) for mode in ("without", "with")]
    assert len(runs[0]) >= count and len(runs[1]) >= count
    assert runs[0][:count] == runs[1][:count]


def test_cli_and_api_draw_the_same_cases(monkeypatch, tmp_path, capsys):
    seen = []

    def evaluate(self, case):
        seen.append(case.describe())
        if len(seen) % 150 == 0:
            raise search_mod.OutOfTime
        return search_mod.Outcome(case, Verdict([]))

    monkeypatch.setattr(search_mod.Search, "evaluate", evaluate)
    check_kernel(SDPA, "sdpa", budget=60, seed=7, dtypes=["float32"])
    api = list(seen)
    seen.clear()
    cli.main(["check", "torch.nn.functional:scaled_dot_product_attention", "--convention",
              "sdpa", "--seed", "7", "--dtype", "float32", "--repro",
              str(tmp_path / "x.npz")])
    capsys.readouterr()
    assert len(api) >= 150 and seen[:150] == api[:150]


def test_local_constants_are_off_only_within_the_search():
    from hypothesis.internal.conjecture import providers

    original = providers._get_local_constants
    with local_constants_off() as active:
        assert active and providers._get_local_constants is not original
        assert len(providers._get_local_constants().set_for_type("integer")) == 0
        with local_constants_off():
            pass
        assert providers._get_local_constants is not original
    assert providers._get_local_constants is original
    check_kernel(SDPA, "sdpa", budget=0.5, seed=0, dtypes=["float32"], grads=False)
    assert providers._get_local_constants is original


# -- 6. validate prints values ---------------------------------------------------------
def test_validate_prints_option_values(tmp_path, capsys):
    """Old code: options {'causal': 'array()', 'window_size': 'array(2,)', ...}."""
    repro = str(tmp_path / "c.npz")
    res = check_kernel(broken(CLEAN["flash_attn"], "causal_top_left"), "flash_attn",
                       repro=repro, **FAST)
    assert not res.ok
    assert cli.main(["validate", repro]) == 1
    out = capsys.readouterr().out
    assert "'causal': True" in out and "'window_size': (-1, -1)" in out
    assert "array()" not in out and "array(2,)" not in out


# -- 7. a repro file judged alone --------------------------------------------------------
@pytest.mark.parametrize("conv,bug", [
    ("flash_attn", "scale_twice"), ("flash_attn_varlen", "varlen_off_by_one"),
    ("flash_attn_kvcache", "partial_page_ignored"), ("sdpa", "bottom_right"),
    ("fla_gla", "state_missing_last_chunk"), ("fla_simple_gla", "init_ignored"),
    ("fla_delta_rule", "beta_on_v_only"), ("fla_gated_delta_rule", "gate_late")])
def test_repro_is_judged_by_validate_alone(conv, bug, tmp_path, capsys):
    """Old code: validate FILE without --profile/--variant/--option exited 2."""
    repro = str(tmp_path / "alone.npz")
    res = check_kernel(broken(CLEAN[conv], bug), conv, budget=10, seed=0,
                       dtypes=["float32"], repro=repro)
    assert not res.ok, res.summary()
    assert cli.main(["validate", repro]) == 1, capsys.readouterr()
    assert "MISMATCH" in capsys.readouterr().out


def test_flags_still_override_the_file():
    meta = {"variant": "gla", "profile": None, "layout": None,
            "options": ["scale=0.25", "causal=true"]}
    assert cli.with_meta(meta, None, None, None, []) == (
        "gla", None, None, ["scale=0.25", "causal=true"])
    assert cli.with_meta(meta, "gla", None, "bnhd", ["scale=0.5"]) == (
        "gla", None, "bnhd", ["causal=true", "scale=0.5"])
    assert cli.with_meta(meta, "softmax", None, None, []) == ("softmax", None, None, [])
    assert cli.with_meta({}, None, "sdpa", None, ["x=1"]) == (None, "sdpa", None, ["x=1"])


def test_validate_without_flags_or_meta_says_what_is_missing(tmp_path, capsys):
    path = str(tmp_path / "plain.npz")
    x = np.zeros((1, 2, 4, 8))
    np.savez(path, q=x, k=x, v=x, out=x)
    assert cli.main(["validate", path]) == 2
    assert "holds no __meta__" in capsys.readouterr().err


def test_shown_value():
    assert cli.shown_value(np.asarray(0.5)) == 0.5
    assert cli.shown_value(np.arange(3)) == (0, 1, 2)
    assert cli.shown_value(np.zeros((2, 3))) == "array(2, 3)"
    assert cli.shown_value(np.zeros(9)) == "array(9,)"
