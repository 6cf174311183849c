"""The checker's pytest plugin (issue #51 point 1), run by pytester in a child pytest as a
kernel repository would: a test file of a few lines checks a clean and a broken kernel, a
finding is replayed first from Hypothesis' example database in the next run, pytest-xdist,
``-x``, ``-k``, the ini budget, ``--hypothesis-seed``, and loading the plugin changes
nothing for a project that does not use it.

Each would fail on the code before the plugin: no marker, no fixture, no entry point, no
stored case (check_kernel had no ``examples``)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("hypothesis")

pytest_plugins = ["pytester"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
PLUGIN = "arrayattn.testing.pytest_plugin"

#: A kernel repository's test file: <= 10 lines, one clean kernel, one broken one (the
#: softmax scale off by 10 %).
KERNEL_TESTS = '''\
import pytest, torch
sdpa = torch.nn.functional.scaled_dot_product_attention
def broken(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return sdpa(q, k, v, attn_mask, 0.0, is_causal, scale=0.9 * (scale or q.shape[-1] ** -0.5), enable_gqa=enable_gqa)
@pytest.mark.attention_kernel("sdpa", budget=1, dtypes=["float32"])
def test_clean():
    return sdpa
@pytest.mark.attention_kernel("sdpa", budget=1, dtypes=["float32"])
def test_broken():
    return broken
'''

#: An explicit directory database: Hypothesis' own "ci" profile (loaded when $CI is set)
#: has none, and then nothing is stored, as Hypothesis itself would not.
DATABASE_CONFTEST = '''\
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase
settings.register_profile("kernels", database=DirectoryBasedExampleDatabase(".hypothesis/examples"))
settings.load_profile("kernels")
'''


@pytest.fixture(autouse=True)
def _this_worktree(monkeypatch):
    """The child pytest imports this worktree's arrayattn."""
    monkeypatch.setenv("PYTHONPATH", ROOT)


def run(pytester, *args):
    """A child pytest in pytester's directory, the plugin loaded by its entry point when
    installed, else by ``-p`` (with the entry point installed, ``-p`` finds it by its name,
    the module's: no second registration)."""
    return pytester.runpytest_subprocess("-p", PLUGIN, *args, timeout=240)


def _cases(output: str, test: str) -> int:
    """The case count of ``test``'s line in the plugin's terminal summary."""
    m = re.search(rf"::{test}: (?:ok|FOUND): arrayattn check \(\w+\): (\d+) case", output)
    assert m, output
    return int(m.group(1))


def test_kernel_file_of_ten_lines_passes_clean_and_fails_broken(pytester):
    assert len(KERNEL_TESTS.splitlines()) <= 10
    pytester.makepyfile(test_kernels=KERNEL_TESTS)
    res = run(pytester, "-rA")
    res.assert_outcomes(passed=1, failed=1)
    out = res.stdout.str()
    # the failure is the finding's report, the smallest case and its repro file
    assert "arrayattn check (sdpa) FOUND: b=1 h=1 n=1 s=" in out
    assert "MISMATCH" in out
    repro = re.search(r"repro: (\S+\.npz);", out).group(1)
    assert os.path.exists(repro) and ".pytest_cache" in repro
    assert "judge it with: arrayattn validate" in out
    # the passing test reports what it covered (-rA shows its section)
    assert "Captured arrayattn check call" in out
    assert "options covered:" in out and "OK: nothing found within the budget" in out
    assert "arrayattn check: 2 kernel check(s), 1 finding(s)" in out


def test_a_finding_is_replayed_first_in_the_next_run(pytester):
    pytester.makepyfile(test_kernels=KERNEL_TESTS)
    pytester.makeconftest(DATABASE_CONFTEST)
    first = run(pytester, "-k", "broken")
    first.assert_outcomes(failed=1)
    assert "replayed stored case" not in first.stdout.str()
    assert os.listdir(pytester.path / ".hypothesis" / "examples")
    second = run(pytester, "-k", "broken")
    second.assert_outcomes(failed=1)
    out = second.stdout.str()
    assert "replayed stored case fails: b=1 h=1 n=1" in out
    # straight to the stored case, then only the shrink's one-step reductions around it
    assert _cases(out, "test_broken") < _cases(first.stdout.str(), "test_broken")
    # fixed: the stored case is replayed, passes, and is forgotten
    pytester.makepyfile(test_kernels=KERNEL_TESTS.replace("0.9 * ", ""))
    third = run(pytester, "-k", "broken", "-rA")
    third.assert_outcomes(passed=1)
    assert "replayed stored case passes now: b=1 h=1 n=1" in third.stdout.str()
    fourth = run(pytester, "-k", "broken", "-rA")
    fourth.assert_outcomes(passed=1)
    assert "replayed stored case" not in fourth.stdout.str()


def test_xdist_runs_the_checks_on_two_workers(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(test_kernels=KERNEL_TESTS)
    res = run(pytester, "-n", "2")
    res.assert_outcomes(passed=1, failed=1)
    out = res.stdout.str()
    assert "2 workers" in out or "gw1" in out
    # the workers' user properties reach the controller's summary
    assert "arrayattn check: 2 kernel check(s), 1 finding(s)" in out
    assert "arrayattn check (sdpa) FOUND" in out


def test_x_stops_after_the_first_finding_and_k_selects_by_convention(pytester):
    pytester.makepyfile(test_kernels=KERNEL_TESTS.replace("def test_clean", "def test_a_broken")
                        .replace("return sdpa\n", "return broken\n"))
    res = run(pytester, "-x")
    res.assert_outcomes(failed=1)
    # the convention is a keyword of a marked test (no test name contains it)
    res = run(pytester, "--collect-only", "-q", "-k", "sdpa")
    assert "2 tests collected" in res.stdout.str()


def test_ini_budget_is_the_default_and_a_bad_one_is_a_usage_error(pytester):
    pytester.makepyfile(test_kernels='''\
import pytest, torch
@pytest.mark.attention_kernel("sdpa", dtypes=["float32"], grads=False)
def test_clean():
    return torch.nn.functional.scaled_dot_product_attention
''')
    pytester.makeini("[pytest]\nattention_check_budget = 1.5\n")
    res = run(pytester, "-rA")
    res.assert_outcomes(passed=1)
    seconds = float(re.search(r"case\(s\) in ([\d.]+) s", res.stdout.str()).group(1))
    assert 1.0 <= seconds < 5.0       # the ini's 1.5 s, not the default 10 s
    pytester.makeini("[pytest]\nattention_check_budget = soon\n")
    res = run(pytester)
    assert "attention_check_budget = 'soon': give seconds" in res.stdout.str() + \
        res.stderr.str()


def test_fixture_returns_the_check_and_fails_with_the_report(pytester):
    pytester.makepyfile(test_kernels='''\
import torch
def test_clean(check_attention):
    res = check_attention(torch.nn.functional.scaled_dot_product_attention, "sdpa",
                          budget=1, dtypes=["float32"], grads=False)
    assert res.ok and res.cases > 0
def test_unknown_keyword(check_attention):
    check_attention(torch.nn.functional.scaled_dot_product_attention, "sdpa", budgte=1)
def test_broken(check_attention):
    check_attention(lambda q, k, v, **kw: v, "sdpa", budget=1, grads=False)
''')
    res = run(pytester)
    res.assert_outcomes(passed=1, failed=2)
    out = res.stdout.str()
    assert "unknown keyword(s) budgte" in out
    assert "arrayattn check (sdpa) FOUND" in out


def test_marker_misuse_is_reported(pytester):
    pytester.makepyfile(test_kernels='''\
import pytest
@pytest.mark.attention_kernel("sdpa", budget=1)
def test_returns_nothing():
    pass
@pytest.mark.attention_kernel("sdpa", budgte=1)
def test_bad_keyword():
    return lambda q, k, v, **kw: v
@pytest.mark.attention_kernel("no_such_convention", budget=1)
def test_bad_convention():
    return lambda q, k, v, **kw: v
''')
    res = run(pytester)
    res.assert_outcomes(failed=3)
    out = res.stdout.str()
    assert "returns the kernel to check (a callable); test_returns_nothing returned NoneType" \
        in out
    assert "unknown keyword(s) budgte" in out
    assert "unknown convention 'no_such_convention'" in out


def test_a_project_without_checks_sees_nothing_and_no_torch_is_imported(pytester):
    pytester.makepyfile(test_plain="def test_one():\n    assert 1\n")
    res = run(pytester, "-rA")
    res.assert_outcomes(passed=1)
    # pytest's header names the installed plugin ("plugins: arrayattn-0.1.0"); nothing else
    said = [line for line in res.stdout.lines if not line.startswith("plugins:")]
    assert not any("arrayattn" in line for line in said), said
    code = (f"import sys, {PLUGIN}; "
            "print(sorted(m for m in ('torch', 'hypothesis', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_hypothesis_seed_is_the_checks_seed():
    from arrayattn.testing.pytest_plugin import _seed

    class Config:
        def __init__(self, seed):
            self.seed = seed

        def getoption(self, name, default=None):
            assert name == "hypothesis_seed"
            return self.seed

    assert _seed(Config(None), None) == 0
    assert _seed(Config("42"), None) == 42
    assert _seed(Config("42"), 7) == 7           # the marker's seed wins
    text = _seed(Config("abc"), None)
    assert text == _seed(Config("abc"), None) and text != _seed(Config("abd"), None)


def test_entry_point_is_declared_in_pyproject():
    try:
        import tomllib
    except ImportError:                       # Python 3.10
        tomli = pytest.importorskip("tomli")
        tomllib = tomli
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert project["entry-points"]["pytest11"] == {PLUGIN: PLUGIN}
    import importlib
    module = importlib.import_module(PLUGIN)
    assert callable(module.pytest_pyfunc_call) and callable(module.check_attention)


def test_stored_cases_round_trip_and_stale_entries_are_dropped():
    """The database's JSON: cases come back equal (tuples of options included); an entry
    that is no case any more is deleted; a case with an option the convention no longer
    has is not replayed."""
    from hypothesis.database import InMemoryExampleDatabase
    from arrayattn.testing.check import database as store, get_convention
    from arrayattn.testing.check.cases import Case

    db, conv = InMemoryExampleDatabase(), get_convention("jax_dot_product_attention")
    key = store.database_key("test_k.py::test_x", conv.name)
    case = Case(n=3, s=9, options=(("local_window_size", (2, 0)),), magnitude=30.0)
    store.store_case(db, key, case)
    assert store.stored_cases(db, key, conv) == [case]
    db.save(key, b"not json")
    db.save(key, store.case_to_json(Case(options=(("no_such_option", True),))).encode())
    assert store.stored_cases(db, key, conv) == [case]
    assert b"not json" not in set(db.fetch(key))
    store.forget_cases(db, key)
    assert not list(db.fetch(key))


def test_installed_entry_point_loads_the_plugin_and_p_does_not_register_it_twice(
        pytester, tmp_path, monkeypatch):
    """A distribution declaring pyproject's entry point (a dist-info on the path, as pip
    installs it): the marker works without ``-p``, and with ``-p`` (or pytest_plugins)
    too, the entry point being named by its module."""
    site = tmp_path / "site"
    info = site / "arrayattn_entry-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: arrayattn-entry\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(f"[pytest11]\n{PLUGIN} = {PLUGIN}\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, str(site)]))
    pytester.makepyfile(test_kernels='''\
import pytest, torch
@pytest.mark.attention_kernel("sdpa", budget=0.5, dtypes=["float32"], grads=False)
def test_clean():
    return torch.nn.functional.scaled_dot_product_attention
''')
    for plugin in ((), ("-p", PLUGIN)):
        res = pytester.runpytest_subprocess(*plugin, "-W", "error::pytest.PytestUnknownMarkWarning",
                                            timeout=240)
        res.assert_outcomes(passed=1)
        assert "arrayattn check: 1 kernel check(s), 0 finding(s)" in res.stdout.str()


def test_check_kernel_tries_examples_first():
    """check_kernel(examples=...): a stored case that still fails is where the search
    starts and shrinks from (``replayed``); one that passes is passed over."""
    import torch
    from arrayattn.testing import check_kernel
    from arrayattn.testing.check.cases import Case

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def causal_ignored(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
        return sdpa(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa)

    stored = Case(n=9, s=9, options=(("is_causal", True),))
    log = []
    res = check_kernel(causal_ignored, "sdpa", budget=2, dtypes=["float32"], grads=False,
                       examples=[Case(n=3, s=4), stored], log=log.append)
    assert res.replayed == stored and not res.ok
    assert log[0].startswith("replayed stored case passes now: b=1 h=2 n=3 s=4")
    assert log[1].startswith("replayed stored case fails: b=1 h=2 n=9 s=9")
    assert res.failure.case.opts["is_causal"] and res.failure.case.n <= 2
    assert check_kernel(sdpa, "sdpa", budget=0.5, dtypes=["float32"], grads=False,
                        examples=[stored]).replayed is None
