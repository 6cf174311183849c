"""pytest, for the doctests collected from ``arrayattn/``: a module whose every example
needs an optional backend is left out when that backend is not installed (the README's
test command runs on a bare venv).

The run stays quiet about skips: pyproject's ``-rfExX`` leaves them out of pytest's short
summary (one line per test location: hundreds), and :func:`pytest_terminal_summary` prints
one line per reason for the skips the environment causes (a backend or package not
installed, no GPU) and one line counting the skips by design (a variant without the
option under test, a backend without the dtype ...).  ``pytest -rs`` lists every skip.
"""
import collections
import importlib.util
import re

collect_ignore = [] if importlib.util.find_spec("jax") else ["arrayattn/distributed.py"]
if importlib.util.find_spec("torch") is None:
    # the checker's example runs torch's SDPA; the zoo of broken kernels is written in torch
    # (its tests skip without torch, but --doctest-modules would import it)
    collect_ignore += ["arrayattn/testing/check/api.py", "arrayattn/testing/strategies.py",
                       "tests/testing/check/zoo.py",
                       "tests/testing/check/shipped.py",
                       "tests/testing/check/kernels_shipped.py",
                       "tests/testing/check/zoo_sizes.py"]

#: Skip reasons that come from the environment, not from the test's design.
ENVIRONMENT = re.compile(r"unavailable|not installed|no module named|GPU|git checkout|"
                         r"does not run on this|cannot be controlled here", re.I)


def skip_reason(report) -> str:
    """The reason of a skipped report (pytest stores ``(path, line, "Skipped: why")``)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def _reasons(count: int) -> str:
    return f"{count} reason" + ("" if count == 1 else "s")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    chars = config.option.reportchars or ""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or any(c in chars for c in "saA"):   # -rs / -ra: pytest lists them
        return
    reasons = collections.Counter(skip_reason(rep) for rep in skipped)
    env = sorted(((n, r) for r, n in reasons.items() if ENVIRONMENT.search(r)), reverse=True)
    design = sum(reasons.values()) - sum(n for n, _ in env)
    terminalreporter.write_sep("-", f"{len(skipped)} skipped (pytest -rs lists each)")
    for n, reason in env:
        terminalreporter.write_line(f"SKIPPED [{n}] {reason}")
    if design:
        terminalreporter.write_line(
            f"SKIPPED [{design}] by design, {_reasons(len(reasons) - len(env))} (an option the "
            "variant does not take, a dtype the backend lacks, a path another test covers)")
