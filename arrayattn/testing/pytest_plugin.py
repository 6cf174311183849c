"""The pytest plugin of arrayattn's kernel checker (the ``pytest11`` entry point
``arrayattn.testing.pytest_plugin``): a kernel repository's test suite runs :func:`~arrayattn.testing.check_kernel`
with a marker or a fixture.

A test marked ``attention_kernel`` returns the kernel; the plugin runs the search on it::

    import pytest, mypkg

    @pytest.mark.attention_kernel("flash_attn", budget=30)
    def test_flash_fwd():
        return mypkg.flash_fwd

or, inside any test, the ``check_attention`` fixture runs it and returns the
:class:`~arrayattn.testing.KernelCheck`::

    def test_flash_fwd(check_attention):
        check_attention(mypkg.flash_fwd, "flash_attn", budget=30, skip=["softcap"])

The marker and the fixture take the keywords of :func:`~arrayattn.testing.check_kernel`
(``budget``, ``seed``, ``dtypes``, ``grads``, ``skip``, ``device``).  Habits honoured:

- the budget: the marker's, else the ini option ``attention_check_budget`` (seconds,
  default 10; ``-o attention_check_budget=300`` for a long run);
- the seed: the marker's, else ``--hypothesis-seed``, else 0 (the same seed, the same cases);
- Hypothesis' example database (``settings().database``, ``.hypothesis/examples`` by
  default; none: nothing stored): a finding is stored under the test's node id and the
  convention, tried first in the next run and shrunk again from there if it still fails,
  forgotten once it passes;
- a failure is the finding's report (:meth:`KernelCheck.summary`) with its repro file (in
  the pytest cache directory, ``.pytest_cache/d/arrayattn_check``, else a temporary one);
- a passing test adds a report section (shown by ``-rA``/``-rP``) and a user property
  ``arrayattn_check`` (JUnit XML) saying what it covered; the terminal summary counts the
  checks;
- ``-x``, ``-k`` (the convention's name is a keyword of a marked test) and pytest-xdist
  work as for any test.

Loading the plugin imports neither torch, JAX nor Hypothesis, and adds nothing to a run
that marks no test and asks for no ``check_attention``.
"""
from __future__ import annotations

import os
import re
import tempfile

import pytest

__all__ = ["pytest_addoption", "pytest_configure", "pytest_collection_modifyitems",
           "pytest_pyfunc_call", "check_attention", "run_check", "pytest_terminal_summary",
           "MARKER", "INI_BUDGET", "DEFAULT_BUDGET"]

MARKER = "attention_kernel"
INI_BUDGET = "attention_check_budget"
DEFAULT_BUDGET = 10.0
_KEYWORDS = ("budget", "seed", "dtypes", "grads", "skip", "device")
_SUMMARY_KEY = "arrayattn_check"


def pytest_addoption(parser):
    parser.addini(INI_BUDGET, f"arrayattn: the default budget (seconds) of a check of the "
                  f"{MARKER} marker or the check_attention fixture (default "
                  f"{DEFAULT_BUDGET:g})", default=str(DEFAULT_BUDGET))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{MARKER}(convention, *, budget=None, seed=None, dtypes=None, grads=True, "
        "skip=(), device='cpu'): the test returns an attention kernel; arrayattn's checker "
        "searches for a case where it disagrees with the reference (arrayattn.testing."
        "check_kernel)")


def pytest_collection_modifyitems(items):
    """The convention's name is a keyword of a marked test (``-k flash_attn``)."""
    for item in items:
        mark = item.get_closest_marker(MARKER)
        if mark is not None and mark.args and isinstance(mark.args[0], str):
            item.extra_keyword_matches.add(mark.args[0])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A marked test: call it for the kernel, then check the kernel."""
    mark = pyfuncitem.get_closest_marker(MARKER)
    if mark is None:
        return None
    convention, options = _marker_arguments(mark)
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    fn = pyfuncitem.obj(**args)
    if not callable(fn):
        pytest.fail(f"a test marked {MARKER} returns the kernel to check (a callable); "
                    f"{pyfuncitem.name} returned {type(fn).__name__}", pytrace=False)
    run_check(pyfuncitem, fn, convention, **options)
    return True


@pytest.fixture
def check_attention(request):
    """``check_attention(fn, convention, **kw)``: run the checker on ``fn`` (keywords of
    :func:`~arrayattn.testing.check_kernel`); the test fails with the finding's report,
    else the :class:`~arrayattn.testing.KernelCheck` is returned.  Several calls in one
    test are stored apart by convention."""
    def check(fn, convention, **kw):
        unknown = sorted(set(kw) - set(_KEYWORDS))
        if unknown:
            raise TypeError(f"check_attention: unknown keyword(s) {', '.join(unknown)}; "
                            f"known: {', '.join(_KEYWORDS)}")
        return run_check(request.node, fn, convention, **kw)
    return check


def _marker_arguments(mark) -> tuple:
    if len(mark.args) != 1:
        pytest.fail(f"@pytest.mark.{MARKER} takes one positional argument, the convention "
                    f"(e.g. 'flash_attn'); got {len(mark.args)}", pytrace=False)
    unknown = sorted(set(mark.kwargs) - set(_KEYWORDS))
    if unknown:
        pytest.fail(f"@pytest.mark.{MARKER}: unknown keyword(s) {', '.join(unknown)}; known: "
                    f"{', '.join(_KEYWORDS)}", pytrace=False)
    return mark.args[0], dict(mark.kwargs)


def _seed(config, seed) -> int:
    """The marker's seed, else ``--hypothesis-seed`` (an integer, or any text hashed),
    else 0."""
    if seed is not None:
        return int(seed)
    text = config.getoption("hypothesis_seed", None)
    if text is None:
        return 0
    try:
        return int(text)
    except ValueError:
        import hashlib
        return int.from_bytes(hashlib.sha256(str(text).encode()).digest()[:4], "big")


def _budget(config, budget) -> float:
    if budget is None:
        raw = config.getini(INI_BUDGET)
        try:
            budget = float(raw)
        except ValueError:
            raise pytest.UsageError(f"{INI_BUDGET} = {raw!r}: give seconds (a number)") \
                from None
    if float(budget) <= 0:
        raise pytest.UsageError(f"the check's budget must be > 0 seconds; got {budget}")
    return float(budget)


def _repro_path(config, node_id: str, convention: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{node_id}-{convention}")[-150:] + ".npz"
    cache = getattr(config, "cache", None)
    folder = str(cache.mkdir("arrayattn_check")) if cache is not None else \
        tempfile.mkdtemp(prefix="arrayattn_check_")
    return os.path.join(folder, name)


def _database():
    """Hypothesis' configured example database (None when there is none)."""
    from hypothesis import settings
    return settings.default.database


def run_check(node, fn, convention, *, budget=None, seed=None, dtypes=None, grads=True,
              skip=(), device="cpu"):
    """Check ``fn`` for the test ``node`` (replaying the stored finding first, storing a new
    one, failing with its report); the :class:`KernelCheck` when nothing is found."""
    from .check import check_kernel, get_convention
    from .check import database as store
    from .check.search import require_hypothesis

    require_hypothesis()
    config = node.config
    conv = get_convention(convention, device)
    label = conv.name or "custom"
    db = _database()
    key = store.database_key(node.nodeid, label)
    examples = [c for c in (store.stored_cases(db, key, conv) if db is not None else [])
                if (dtypes is None or c.dtype in dtypes) and not set(c.active()) & set(skip)
                and (grads or not c.opts.get("backward"))]      # what this run may draw
    log: list = []
    repro = _repro_path(config, node.nodeid, label)
    res = check_kernel(fn, conv, budget=_budget(config, budget), seed=_seed(config, seed),
                       dtypes=dtypes, grads=grads, skip=skip, repro=repro, device=device,
                       log=log.append, examples=examples)
    text = res.summary()
    if not res.ok:
        text = f"arrayattn check ({label}) FOUND: {res.failure.case.describe()}\n" + text
    if log:
        text += "\n" + "\n".join(["search:"] + ["  " + line for line in log])
    headline = res.summary().splitlines()[0]
    node.user_properties.append((_SUMMARY_KEY, f"{'ok' if res.ok else 'FOUND'}: {headline}"))
    if db is not None:
        if res.ok:
            store.forget_cases(db, key)
        else:
            store.store_case(db, key, res.failure.case)
    if not res.ok:
        pytest.fail(text, pytrace=False)
    node.add_report_section("call", "arrayattn check", text)     # -rA / -rP show it
    return res


def pytest_terminal_summary(terminalreporter):
    """One line per check run (the reports' user properties: the workers' too, under
    xdist), only when some test ran one."""
    lines = [(rep.nodeid, value) for key in ("passed", "failed")
             for rep in terminalreporter.stats.get(key, ())
             if getattr(rep, "when", None) == "call"
             for name, value in getattr(rep, "user_properties", ()) if name == _SUMMARY_KEY]
    if not lines:
        return
    found = sum(1 for _, v in lines if v.startswith("FOUND"))
    terminalreporter.write_sep("-", f"arrayattn check: {len(lines)} kernel check(s), "
                               f"{found} finding(s)")
    for node_id, value in lines:
        terminalreporter.write_line(f"{node_id}: {value}")
