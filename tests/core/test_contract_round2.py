"""Second contract round (#25), points 3 and 5: the referee refuses tolerances that would
pass anything and never passes a non-finite output where the reference is finite; the
command line fails early and clearly; a newcomer's first steps work.

Each fault is a row of a table, run over every registered variant and every installed
backend where it applies.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import arrayattn
from arrayattn import cli
from arrayattn.testing.grads import assert_grads_match, compare_grads
from arrayattn.testing.outputs import compare_lse
from arrayattn.testing import (assert_matches_reference, compare_to_reference,
                               xp_assert_close)
from conftest import BACKEND_NAMES, get_backend, make_qkv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------------------
# Point 3: tolerances
# ---------------------------------------------------------------------------------------

#: (argument, value, exception): every one would pass anything, or is not a number.
BAD_TOLERANCES = [
    ("rtol", math.inf, ValueError),
    ("rtol", -math.inf, ValueError),
    ("rtol", math.nan, ValueError),
    ("rtol", -1e-9, ValueError),
    ("rtol", np.float32("inf"), ValueError),
    ("rtol", "1e-3", TypeError),
    ("rtol", True, TypeError),
    ("rtol", [1e-3], TypeError),
    ("atol", math.inf, ValueError),
    ("atol", math.nan, ValueError),
    ("atol", -1.0, ValueError),
    ("atol", None, TypeError),
    ("atol", "0", TypeError),
]


def _softmax_call(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=6, d=4)
    do = rng.standard_normal(v.shape)
    out = arrayattn.softmax_attention(q, k, v)
    grads = arrayattn.vjp("softmax", q, k, v, do)
    lse = arrayattn.softmax_attention(q, k, v, return_lse=True)[1]
    return q, k, v, do, out, grads, lse


#: Every public referee, called on correct data with one tolerance keyword.
REFEREES = {
    "assert_matches_reference":
        lambda c, kw: assert_matches_reference(c[4], "softmax", *c[:3], **kw),
    "compare_to_reference": lambda c, kw: compare_to_reference(c[4], "softmax", *c[:3], **kw),
    "compare_grads": lambda c, kw: compare_grads(c[5], "softmax", *c[:4], **kw),
    "assert_grads_match": lambda c, kw: assert_grads_match(c[5], "softmax", *c[:4], **kw),
    "compare_lse": lambda c, kw: compare_lse(c[6], "softmax", *c[:3], **kw),
    "xp_assert_close": lambda c, kw: xp_assert_close(c[4], c[4], **kw),
}


@pytest.mark.parametrize("referee", sorted(REFEREES))
def test_bad_tolerances_are_refused_naming_the_argument(referee, rng):
    call = _softmax_call(rng)
    for name, value, exc in BAD_TOLERANCES:
        with pytest.raises(exc, match=rf"^{name} must be"):
            REFEREES[referee](call, {name: value})
    REFEREES[referee](call, {"rtol": 0.5, "atol": 0.0})    # valid ones still work
    REFEREES[referee](call, {"rtol": 0, "atol": 1e-3})


def test_bad_factor_is_refused(rng):
    q, k, v, do, _, grads, _ = _softmax_call(rng)
    for value in (math.inf, math.nan, -2.0):
        with pytest.raises(ValueError, match="^factor must be"):
            compare_grads(grads, "softmax", q, k, v, do, rule="same-dtype", factor=value)


#: How an output goes wrong: one entry, a row, everything.
CORRUPTIONS = {
    "nan entry": lambda o: _set(o, (0, 1, 0), np.nan),
    "inf entry": lambda o: _set(o, (1, 2, 1), np.inf),
    "-inf entry": lambda o: _set(o, (0, 0, 0), -np.inf),
    "nan row": lambda o: _set(o, (1, 3), np.nan),
    "all nan": lambda o: np.full_like(o, np.nan),
}

#: The loosest tolerances a caller may give: still no pass for a non-finite value.
LOOSE = [{}, {"rtol": 1e300}, {"atol": 1e300}, {"rtol": 1e300, "atol": 1e300}]


def _set(o, idx, value):
    o = np.array(o, dtype=np.float64, copy=True)
    o[idx] = value
    return o


def _variant_call(rec, rng):
    q, k, v = make_qkv(rng, batch=(2,), n=96, d=16, dv=5)   # every default option fits
    return q, k, v, np.asarray(rec(q, k, v), dtype=np.float64)


@pytest.mark.parametrize("name", [r.name for r in arrayattn.variants()])
def test_non_finite_output_never_passes_where_the_reference_is_finite(name, rng):
    """Every variant: a NaN or inf where the reference is finite is a MISMATCH under any
    tolerance; the message says the error is non-finite."""
    rec = arrayattn.get_variant(name)
    q, k, v, out = _variant_call(rec, rng)
    assert compare_to_reference(out, name, q, k, v, rtol=1e300).ok
    for label, corrupt in CORRUPTIONS.items():
        bad = corrupt(out)
        for kw in LOOSE:
            c = compare_to_reference(bad, name, q, k, v, **kw)
            assert not c.ok, (label, kw)
            assert "non-finite error" in c.verdict(), (label, kw)
            with pytest.raises(AssertionError, match="non-finite"):
                assert_matches_reference(bad, name, q, k, v, **kw)


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
def test_non_finite_output_never_passes_on_any_backend(backend_name, rng):
    b = get_backend(backend_name)
    q, k, v = make_qkv(rng, batch=(2,), n=8, d=4)
    out = arrayattn.softmax_attention(q, k, v)
    for label, corrupt in CORRUPTIONS.items():
        bad = b.asarray(corrupt(out))
        args = [b.asarray(x) for x in (q, k, v)]
        for kw in LOOSE:
            assert not compare_to_reference(bad, "softmax", *args, **kw).ok, (label, kw)
        grads = {"q": bad[..., :4], "v": b.asarray(np.zeros_like(v))}
        gc = compare_grads(grads, "softmax", *args, b.asarray(np.ones_like(v)), rtol=1e300)
        assert not gc.items["q"].ok and gc.items["v"].ok, label


# ---------------------------------------------------------------------------------------
# Point 3: report --json / --plot paths, refused before the run
# ---------------------------------------------------------------------------------------

def _no_run(monkeypatch):
    import arrayattn.report.run as report

    def boom(*args, **kwargs):
        raise AssertionError("the report ran before the path was checked")
    monkeypatch.setattr(report, "run_report", boom)
    monkeypatch.setattr(report, "run_sweeps", boom)


def _denied(path, *args, **kwargs):
    raise PermissionError(13, "Permission denied", path)


#: (flag, how to make the bad path, whether open() is denied, message)
BAD_PATHS = [
    ("--json", lambda tmp: str(tmp), False, "is a directory"),
    ("--json", lambda tmp: str(tmp / "missing" / "r.json"), False, "does not exist"),
    ("--json", lambda tmp: str(_file(tmp) / "r.json"), False, "does not exist"),
    ("--json", lambda tmp: str(tmp / "r.json"), True, "cannot write there (Permission denied)"),
    ("--plot", lambda tmp: str(tmp / "missing" / "r.png"), False, "does not exist"),
    ("--plot", lambda tmp: str(tmp / "r.png"), True, "cannot write there (Permission denied)"),
]


def _file(tmp):
    f = tmp / "a_file"
    f.write_text("x")
    return f


@pytest.mark.parametrize("case", range(len(BAD_PATHS)))
def test_report_refuses_an_unwritable_path_before_the_run(case, tmp_path, monkeypatch,
                                                          capsys):
    flag, make, denied, message = BAD_PATHS[case]
    _no_run(monkeypatch)
    path = make(tmp_path)
    if denied:
        monkeypatch.setattr(cli, "open", _denied, raising=False)
    assert cli.main(["report", "--quiet", flag, path]) == 2
    err = capsys.readouterr().err
    assert f"arrayattn report: error: {flag} {path}" in err and message in err
    assert "variant(s); batch=" not in err        # nothing started


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may write into a read-only directory")
def test_report_refuses_a_read_only_directory(tmp_path, monkeypatch, capsys):
    _no_run(monkeypatch)
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert cli.main(["report", "--quiet", "--json", str(ro / "r.json")]) == 2
    finally:
        ro.chmod(0o700)
    assert "cannot write there" in capsys.readouterr().err


def test_the_path_check_leaves_no_file_behind(tmp_path):
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("keep")
    cli._check_writable("--json", str(new))
    cli._check_writable("--json", str(old))
    assert not new.exists() and old.read_text() == "keep"


# ---------------------------------------------------------------------------------------
# Point 5: a newcomer's frictions
# ---------------------------------------------------------------------------------------

LAZY = {"testing": "assert_matches_reference", "report": "run_report", "cli": "main"}


def test_submodules_load_on_first_attribute_access():
    code = ("import sys, arrayattn\n"
            f"lazy = {sorted(LAZY)!r}\n"
            "assert not [m for m in lazy if 'arrayattn.' + m in sys.modules], 'eager'\n"
            f"for mod, attr in {sorted(LAZY.items())!r}:\n"
            "    assert callable(getattr(getattr(arrayattn, mod), attr)), mod\n"
            "    assert mod in dir(arrayattn)\n"
            "try:\n"
            "    arrayattn.no_such_thing\n"
            "except AttributeError as exc:\n"
            "    assert 'no_such_thing' in str(exc)\n"
            "else:\n"
            "    raise SystemExit('no AttributeError')\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr


def test_readme_shows_the_plain_import():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = readme[readme.index("## Example (NumPy)"):readme.index("## Example (PyTorch")]
    assert "arrayattn.testing.assert_matches_reference(" in block
    assert "from arrayattn.testing" not in block and "import arrayattn.testing" not in block


DOCS_FACTS = [
    ("README.md", "pip install torch --index-url https://download.pytorch.org/whl/cpu"),
    ("docs/index.rst", "pip install torch --index-url https://download.pytorch.org/whl/cpu"),
    ("README.md", 'pip install ".[docs]" && python -m sphinx -W -b html docs'),
    ("docs/index.rst", "python -m sphinx -W -b html docs docs/_build/html"),
    ("docs/validating.rst", 'pp.softmax_kernel.__kwdefaults__["eps"] = 0.0'),
    ("docs/validating.rst", "partial(attn.causal_linear_fn, eps=0.0)"),
]


@pytest.mark.parametrize("page, text", DOCS_FACTS)
def test_docs_say_it(page, text):
    assert text in open(os.path.join(ROOT, page), encoding="utf-8").read()


def test_torch_snippets_save_detached_tensors():
    """Every ``np.savez`` of a torch snippet in the docs detaches what it saves (a
    parameter or an output of a module requires grad; NumPy refuses it)."""
    text = open(os.path.join(ROOT, "docs", "validating.rst"), encoding="utf-8").read()
    calls = re.findall(r"np\.savez\(\"(?:sdpa|perf|nys|hf|fla)\.npz\",(.*?)\)\n(?!\s*#\s)",
                       text, flags=re.S)
    assert len(calls) == 5
    for args in calls:     # (an optional mask in brackets needs no grad)
        args = re.sub(r"\[.*?\]", "", args.replace("#", " "), flags=re.S)
        for name, expr in re.findall(r"(\w+)=([^,]+)", args):
            assert ".detach()" in expr, (name, expr)


def _save(tmp, name, **arrays):
    path = tmp / f"{name}.npz"
    np.savez(path, **arrays)
    return str(path)


def _swap(x):
    return np.swapaxes(x, 1, 2)


def _validate_cases(rng):
    """(name, arrays, extra argv, expected exit code, text in stdout+stderr, text absent)."""
    q, k, v = (rng.standard_normal((2, 3, 16, 8)).astype(np.float32) for _ in range(3))
    out = arrayattn.softmax_attention(q, k, v, causal=True)
    q4, k4, v4 = (rng.standard_normal((2, 4, 4, 8)).astype(np.float32) for _ in range(3))
    out4 = arrayattn.softmax_attention(q4, k4, v4, causal=True)
    upcast = out.astype(np.float64)
    up_ok = compare_to_reference(upcast, "softmax", q, k, v, causal=True).ok
    wrong = out + np.float32(1e-2)
    return [
        ("float64 out of float32 inputs", dict(q=q, k=k, v=v, out=upcast), [],
         0 if up_ok else 1, "note: out is float64 but the inputs are float32", "hint:"),
        ("float64 all through", dict(q=q.astype(np.float64), k=k.astype(np.float64),
                                     v=v.astype(np.float64),
                                     out=arrayattn.softmax_attention(
                                         *(x.astype(np.float64) for x in (q, k, v)),
                                         causal=True)), [], 0, "MATCH", "note: out is"),
        ("all four bnhd, no --layout", dict(q=_swap(q), k=_swap(k), v=_swap(v),
                                            out=_swap(out)), [], 1,
         "the output matches with axes 1 and 2 swapped in q, k, v and out: pass --layout "
         "bnhd", "note: out is"),
        ("all four bhnd, --layout bnhd", dict(q=q, k=k, v=v, out=out),
         ["--layout", "bnhd"], 1, "pass --layout bhnd", "note: out is"),
        ("out alone bnhd", dict(q=q, k=k, v=v, out=_swap(out)), [], 2,
         "hint: out matches with its axes 1 and 2 swapped", "pass --layout"),
        ("out alone bnhd, n = heads", dict(q=q4, k=k4, v=v4, out=_swap(out4)), [], 1,
         "hint: out matches with its axes 1 and 2 swapped", "pass --layout"),
        ("plainly wrong", dict(q=q, k=k, v=v, out=wrong), [], 1, "MISMATCH", "hint:"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_validate_notes_and_layout_hints(case, rng, tmp_path, capsys):
    name, arrays, argv, code, present, absent = _validate_cases(rng)[case]
    path = _save(tmp_path, "f", **arrays)
    assert cli.main(["validate", path, "--variant", "softmax", "--option", "causal=true",
                     *argv]) == code, name
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert present in text, (name, text)
    assert absent not in text, (name, text)


#: (argv, the usage line that must be printed)
MISTYPED = [
    (["validate", "x.npz", "--variant", "softmax", "--bogus"], "usage: arrayattn validate"),
    (["validate", "x.npz", "--rtoll", "1e-3"], "usage: arrayattn validate"),
    (["report", "--nn", "3"], "usage: arrayattn report"),
    (["report", "--quiet", "extra"], "usage: arrayattn report"),
    (["--bogus", "report"], "usage: arrayattn [-h]"),
]


@pytest.mark.parametrize("argv, usage", MISTYPED)
def test_a_mistyped_flag_prints_its_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments" in err


# ---------------------------------------------------------------------------------------
# Point 5: a quiet test run
# ---------------------------------------------------------------------------------------

def _root_conftest():
    spec = importlib.util.spec_from_file_location("arrayattn_root_conftest",
                                                  os.path.join(ROOT, "conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Report:
    def __init__(self, path, line, reason):
        self.longrepr = (path, line, "Skipped: " + reason)


class _Terminal:
    def __init__(self, reports):
        self.stats = {"skipped": reports}
        self.lines = []

    def write_sep(self, sep, title):
        self.lines.append(title)

    def write_line(self, line):
        self.lines.append(line)


class _Config:
    def __init__(self, chars):
        self.option = type("Option", (), {"reportchars": chars})()


CUPY = "cupy backend unavailable: ModuleNotFoundError: No module named 'cupy'"

#: (skips as (file, line, reason, count), -r chars, expected lines)
SKIP_TABLES = [
    ([(f"tests/test_{i}.py", 10 * i, CUPY, 7) for i in range(40)]
     + [("tests/test_a.py", 5, f"{v} takes no key_mask", 3) for v in ("lsh", "luna", "ssd")]
     + [("tests/testing/test_ports.py", 9, "fla (fla-core) is not installed", 2)],
     "fExX",
     ["291 skipped (pytest -rs lists each)", f"SKIPPED [280] {CUPY}",
      "SKIPPED [2] fla (fla-core) is not installed",
      "SKIPPED [9] by design, 3 reasons (an option the variant does not take, a dtype the "
      "backend lacks, a path another test covers)"]),
    ([("tests/test_a.py", 1, CUPY, 3)], "fExX", ["3 skipped (pytest -rs lists each)",
                                                 f"SKIPPED [3] {CUPY}"]),
    ([("tests/test_a.py", 1, CUPY, 3)], "s", []),        # -rs: pytest lists them itself
    ([("tests/test_a.py", 1, CUPY, 3)], "a", []),
    ([], "fExX", []),
]


@pytest.mark.parametrize("case", range(len(SKIP_TABLES)))
def test_skips_are_summarised_one_line_per_reason(case):
    skips, chars, expected = SKIP_TABLES[case]
    reports = [_Report(f, line, why) for f, line, why, n in skips for _ in range(n)]
    term = _Terminal(reports)
    _root_conftest().pytest_terminal_summary(term, 0, _Config(chars))
    assert term.lines == expected


def test_pytest_addopts_leave_skips_out_of_the_short_summary():
    text = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    addopts = re.search(r'^addopts = "(.*)"$', text, flags=re.M).group(1)
    chars = re.search(r"-r(\w+)", addopts).group(1)
    assert "f" in chars and "E" in chars and not set("saA") & set(chars)


#: normalize_qk on rows that used to divide inf by inf: (argument, row, value).  (An
#: infinite *query* row is not here: its row is NaN as it should be, but the chunked
#: form's ``q k^T`` still multiplies inf by 0 inside the matmul, which NumPy reports.)
BAD_ROWS = [("k", 3, np.inf), ("k", 3, -np.inf), ("k", 6, np.nan), ("q", 2, np.nan),
            ("k", 5, 0.0), ("q", 1, 0.0)]


@pytest.mark.parametrize("backend_name", BACKEND_NAMES)
@pytest.mark.parametrize("fn", ["deltanet", "gated_deltanet"])
def test_normalize_qk_emits_no_runtime_warning(fn, backend_name, rng):
    b = get_backend(backend_name)
    q, k, v = make_qkv(rng, batch=(2,), n=8, d=4)
    beta = rng.uniform(0.1, 0.9, (2, 8))
    g = -rng.uniform(0.0, 0.5, (2, 8))
    call = (lambda q, k, method: arrayattn.delta_attention(
        q, k, b.asarray(v), b.asarray(beta), normalize_qk=True, method=method)) \
        if fn == "deltanet" else (lambda q, k, method: arrayattn.gated_delta_attention(
            q, k, b.asarray(v), b.asarray(beta), b.asarray(g), normalize_qk=True,
            method=method))
    for method in ("chunked", "recurrent"):
        clean = b.to_numpy(call(b.asarray(q), b.asarray(k), method))
        for name, row, value in BAD_ROWS:
            x = {"q": q.copy(), "k": k.copy()}
            x[name][0, row] = value
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)
                out = b.to_numpy(call(b.asarray(x["q"]), b.asarray(x["k"]), method))
            assert np.array_equal(out[0, :row], clean[0, :row]), (method, name, row, value)
            assert np.array_equal(out[1], clean[1]), (method, name, row, value)
            if value == 0.0 and name == "q":
                assert np.all(out[0, row] == 0.0)
            elif value != 0.0:
                assert not np.isfinite(out[0, row]).any() if name == "q" else \
                    not np.isfinite(out[0, row:]).all()


def test_normalize_qk_rescales_a_row_whose_squared_norm_overflows(rng):
    q, k, v = make_qkv(rng, batch=(2,), n=8, d=4)
    beta = rng.uniform(0.1, 0.9, (2, 8))
    ref = arrayattn.delta_attention(q, k, v, beta, normalize_qk=True)
    big = k.astype(np.float32)
    big[0, 2] *= np.float32(1e30)              # |k|^2 overflows float32, |k| does not
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # NumPy's own norm overflows
        out = arrayattn.delta_attention(*(x.astype(np.float32) for x in (q,)), big,
                                        v.astype(np.float32), beta.astype(np.float32),
                                        normalize_qk=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5)
