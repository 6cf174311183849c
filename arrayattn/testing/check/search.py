"""The checker's search: the fixed catalogue first, then random draws (Hypothesis), then
shrinking any finding to the smallest failing case, within a wall-clock budget,
reproducible from the seed."""
from __future__ import annotations

import random
import time
import traceback
from dataclasses import dataclass, field

from .cases import (HALF, Case, case_strategy, catalogue, large_catalogue,
                    reach_catalogue, smaller)
from .draws import local_constants_off
from .judge import Verdict
from .sampled import judge_case
from .unsupported import Unsupported, isolate_unsupported

__all__ = ["Search", "Outcome", "OutOfTime", "require_hypothesis", "default_dtypes",
           "Unsupported", "raised"]

#: Failing outcomes kept with their arrays (for the repro file): the smallest cases.
KEEP_FAILURES = 32


class OutOfTime(Exception):
    """The budget is spent."""


def require_hypothesis():
    """The hypothesis module; an ImportError naming the extra when it is missing."""
    try:
        import hypothesis
    except ImportError:
        raise ImportError('arrayattn check needs Hypothesis: pip install "arrayattn[check]"') \
            from None
    return hypothesis


@dataclass
class Outcome:
    """What one case gave: its ``verdict`` (None when the kernel does not support it), and
    what the repro file of a finding is written from: the ``call`` (inputs, options), the
    kernel's ``results`` and ``grads`` (None when it raised)."""

    case: Case
    verdict: Verdict | None
    seconds: float = 0.0
    call: object = field(default=None, repr=False, compare=False)
    results: dict | None = field(default=None, repr=False, compare=False)
    grads: dict | None = field(default=None, repr=False, compare=False)


@dataclass
class Search:
    """The search over one kernel and convention (see :func:`~arrayattn.testing.check_kernel`)."""

    fn: object
    conv: object
    budget: float = 60.0
    seed: int = 0
    dtypes: tuple = ("float32",)
    grads: bool = True
    skip: tuple = ()
    log: object = None
    examples: tuple = ()
    replayed: Case | None = None
    unsupported: set = field(default_factory=set)
    cases_run: int = 0
    covered: dict = field(default_factory=dict)
    worst: tuple = (0.0, None)
    first_found: float | None = None
    started: float = 0.0
    failures: dict = field(default_factory=dict)
    #: elements of the largest tensor of a case (cases.Case.elements); 0: small cases only
    max_size: int = 2 ** 24
    _large: list | None = None
    _large_time: float = 0.0
    #: seconds per element of a large case (what a decode shape's run and judge took on
    #: the 2-core test machine, 2026-11-29): a case predicted past the budget is not run
    _rate: float = 3e-7
    _found_large: Case | None = None

    # -- one case -----------------------------------------------------------------
    def evaluate(self, case: Case) -> Outcome:
        """Run the kernel on ``case`` and judge it (NotImplementedError: unsupported)."""
        t0 = time.perf_counter()
        backward = bool(case.opts.get("backward"))
        call = None
        try:
            call = self.conv.build(case)
            results, grads = self.conv.run(self.fn, call, case, backward)
        except NotImplementedError:
            return Outcome(case, None, time.perf_counter() - t0, call)
        except Exception as exc:  # a kernel that raises on a valid case is a finding
            return Outcome(case, Verdict(error=raised("the kernel", exc)),
                           time.perf_counter() - t0, call)
        try:
            verdict = judge_case(case, call, self.conv, results, grads)
        except Exception as exc:  # a result of the wrong shape, a missing state ...
            verdict = Verdict(error=raised("judging its result", exc))
        return Outcome(case, verdict, time.perf_counter() - t0, call, results, grads)

    def excluded(self, case: Case) -> bool:
        """Whether ``case`` has anything found unsupported (an option value, a
        combination, a dtype, a shape property: :class:`Unsupported`)."""
        return any(u.matches(case) for u in self.unsupported)

    def fails(self, case: Case) -> bool:
        """Evaluate ``case`` (counted, covered); True on a finding (its failing outcome is
        kept: :meth:`failure_of`)."""
        if self.excluded(case):
            return False
        out = self.evaluate(case)
        self.cases_run += 1
        if out.verdict is None:
            return self._unsupported(case)
        self._cover(case, out.verdict)
        if not out.verdict.ok:
            if self.first_found is None:
                self.first_found = time.monotonic() - self.started
            self._keep_failure(out)
        return not out.verdict.ok

    def _keep_failure(self, out: Outcome) -> None:
        """Remember the failing outcome of its case (the smallest cases' kept)."""
        self.failures.pop(out.case, None)
        self.failures[out.case] = out
        while len(self.failures) > KEEP_FAILURES:
            del self.failures[max(self.failures, key=lambda c: c.size())]

    def failure_of(self, case: Case) -> Outcome | None:
        """The outcome of ``case``'s last failing evaluation (None if none is kept)."""
        return self.failures.get(case)

    def fails_again(self, case: Case) -> tuple[Outcome, bool]:
        """Run ``case`` once more (not counted): ``(its outcome, whether it fails)``; a
        NotImplementedError fails again only when the plainest case raises it too."""
        out = self.evaluate(case)
        if out.verdict is None:
            return out, isolate_unsupported(case, self.conv,
                                            self._raises_not_implemented) is None
        return out, not out.verdict.ok

    def _unsupported(self, case: Case) -> bool:
        """Isolate what raised NotImplementedError (the backward, the shape, the dtype, an
        option or a combination: :func:`~.unsupported.isolate_unsupported`), exclude it
        from then on; never a finding, except when the plainest case raises it too."""
        what = isolate_unsupported(case, self.conv, self._raises_not_implemented)
        if what is None:                       # the plainest case: nothing can be checked
            out = Outcome(case, Verdict(error=(
                "the kernel raised NotImplementedError on the plainest case of the "
                f"convention ({self.conv.name}): nothing can be checked; is it the "
                "right --convention?")))
            self._keep_failure(out)
            if self.first_found is None:
                self.first_found = time.monotonic() - self.started
            return True
        self._note_unsupported(what)
        return False

    def _raises_not_implemented(self, case: Case) -> bool:
        return self.evaluate(case).verdict is None

    def _note_unsupported(self, what) -> None:
        if what not in self.unsupported:
            self.unsupported.add(what)
            self._say(f"unsupported (NotImplementedError): {_label(what)}; searching on "
                      "without it")

    def _cover(self, case: Case, verdict: Verdict) -> None:
        c = self.covered
        c.setdefault("dtypes", set()).add(case.dtype)
        c.setdefault("options", set()).update(f"{k}={v}" for k, v in case.active().items())
        c["max_n"], c["max_s"] = max(c.get("max_n", 0), case.n), max(c.get("max_s", 0), case.s)
        c.setdefault("dims", set()).add(case.d)
        if case.values != "normal":
            c.setdefault("values", set()).add(case.values)
        if case.poison:
            c.setdefault("poison", set()).add(case.poison.partition(":")[0])
        if case.elements() > c.get("largest", (0, ""))[0]:
            c["largest"] = (case.elements(), case.describe().split(", seed")[0])
        c["gqa"] = c.get("gqa", False) or case.hq != case.hkv
        if verdict.ok and verdict.worst >= self.worst[0]:
            self.worst = (verdict.worst, case)

    def _say(self, text: str) -> None:
        if self.log is not None:
            self.log(text)

    # -- the search ---------------------------------------------------------------
    def run(self) -> Case | None:
        """The smallest failing case found within the budget, or None."""
        self.started = time.monotonic()
        deadline = self.started + self.budget
        try:
            for case in self.examples:      # stored findings of earlier runs, first
                if self.fails(case):
                    self.replayed = case
                    self._say(f"replayed stored case fails: {case.describe()}; shrinking")
                    return self.polish(case, self._shrink_deadline())
                self._say(f"replayed stored case passes now: {case.describe()}")
            for case in self._catalogues():
                if time.monotonic() > deadline:
                    raise OutOfTime
                if self.fails(case):
                    self._say(f"catalogue case fails: {case.describe()}; shrinking")
                    return self.polish(case, self._shrink_deadline())
            found = self._random(deadline)
        except OutOfTime:
            return None
        return found

    def _catalogues(self):
        """The small edge catalogue, then the value classes and poison (the large cases
        are interleaved with the random draws: :meth:`_interleave`)."""
        args = (self.conv, self.dtypes, self.grads, self.skip)
        yield from catalogue(*args)
        yield from reach_catalogue(*args)

    def _interleave(self, since: float) -> None:
        """Run large catalogue cases (cheapest first, within ``max_size``) while they have
        used less than :data:`LARGE_SHARE` of the time since the random draws began
        (``since``): a bug the random draws find today is found at most 1 / (1 -
        LARGE_SHARE) times later; a failing one raises :class:`_FoundLarge`."""
        if self._large is None:
            self._large = large_catalogue(self.conv, self.dtypes, self.grads, self.skip,
                                          max_size=self.max_size) if self.max_size else []
        while self._large and self._large_time < LARGE_SHARE * (time.monotonic() - since):
            case = self._large.pop(0)
            left = self.started + self.budget - time.monotonic()
            if case.elements() * self._rate > left:   # would overrun the budget: not run
                continue
            t0 = time.monotonic()
            failed = self.fails(case)
            self._large_time += time.monotonic() - t0
            if failed:
                self._found_large = case
        if self._found_large is not None:      # every replay of Hypothesis raises it again
            raise _FoundLarge(self._found_large)

    def _shrink_deadline(self) -> float:
        return time.monotonic() + max(10.0, 0.5 * self.budget)

    def _random(self, deadline: float) -> Case | None:
        hyp = require_hypothesis()
        from hypothesis import HealthCheck, Phase, settings
        best: list = []
        limit = [deadline]

        since = time.monotonic()

        def condition(case):
            if time.monotonic() > limit[0]:
                raise OutOfTime
            if not best:
                self._interleave(since)
            if not self.fails(case):
                return False
            if not best:
                limit[0] = self._shrink_deadline()
                self._say(f"random case fails: {case.describe()}; shrinking")
            if not best or case.size() < best[0].size():
                best[:] = [case]
            return True

        strategy = case_strategy(self.conv, self.dtypes, self.grads, self.skip,
                                 max_size=self.max_size)
        opts = settings(max_examples=10**6, deadline=None, database=None,
                        phases=[Phase.generate, Phase.shrink],
                        suppress_health_check=list(HealthCheck))
        try:
            with local_constants_off():    # the same seed, the same draws (see .draws)
                hyp.find(strategy, condition, settings=opts, random=random.Random(self.seed))
        except (OutOfTime, hyp.errors.NoSuchExample):
            pass
        except _FoundLarge:
            pass
        except Exception as exc:  # OutOfTime while shrinking comes back in a group
            if _large_in(exc) is None and not _only_out_of_time(exc):
                if not _hypothesis_gave_up(exc, hyp):
                    raise
                # a kernel whose verdicts change between calls (Flaky): Hypothesis stops
                self._say(f"Hypothesis stopped ({type(exc).__name__}): the kernel's "
                          "verdicts change between calls")
        if not best and self._found_large is None:   # the draws ran out: the rest
            while self._large and time.monotonic() < deadline:
                case = self._large.pop(0)
                if self.fails(case):
                    self._found_large = case
                    break
        if not best and self._found_large is not None:
            case = self._found_large
            self._say(f"large case fails: {case.describe()}; shrinking")
            return self.polish(case, self._shrink_deadline())
        return self.polish(best[0], limit[0]) if best else None

    def polish(self, case: Case, deadline: float) -> Case:
        """Greedy shrinking from ``case``: take any one-step reduction that still fails,
        until none does (or the deadline)."""
        improved = True
        while improved and time.monotonic() < deadline:
            improved = False
            for cand in smaller(case, self.conv):
                if time.monotonic() > deadline:
                    break
                if cand.size() < case.size() and self.fails(cand):
                    case, improved = cand, True
                    break
        return case


#: The share of the random phase's time the large catalogue cases may take.
LARGE_SHARE = 1 / 3


class _FoundLarge(Exception):
    """A large catalogue case failed (raised through Hypothesis to the search)."""

    def __init__(self, case):
        super().__init__(case.describe())
        self.case = case


def _large_in(exc: BaseException):
    """The case of a :class:`_FoundLarge` in ``exc`` or its group, else None."""
    if isinstance(exc, _FoundLarge):
        return exc.case
    for inner in getattr(exc, "exceptions", None) or ():
        found = _large_in(inner)
        if found is not None:
            return found
    return None


def _only_out_of_time(exc: BaseException) -> bool:
    """Whether ``exc`` is OutOfTime or Hypothesis's Found, alone or in a group."""
    inner = getattr(exc, "exceptions", None)  # an exception group (3.11, or the backport)
    if isinstance(inner, (tuple, list)):
        return all(_only_out_of_time(e) for e in inner)
    return isinstance(exc, OutOfTime) or type(exc).__name__ == "Found"


def _hypothesis_gave_up(exc: BaseException, hyp) -> bool:
    """Whether ``exc`` is Hypothesis giving up on an unreliable condition (Flaky and its
    kinds, Unsatisfiable), alone or with OutOfTime/Found in a group: the search goes on
    with what it found.  Any other error (a bug of the checker) is raised."""
    inner = getattr(exc, "exceptions", None)
    kinds = tuple(getattr(hyp.errors, name) for name in ("Flaky", "Unsatisfiable")
                  if isinstance(getattr(hyp.errors, name, None), type))
    if isinstance(exc, kinds) or type(exc).__name__.startswith("Flaky"):
        return True
    if isinstance(inner, (tuple, list)):
        return all(_hypothesis_gave_up(e, hyp) or _only_out_of_time(e) for e in inner)
    return False


def _label(what) -> str:
    if isinstance(what, Unsupported):
        return what.label
    return what if isinstance(what, str) else f"{what[0]}={what[1]}"


def raised(where: str, exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1:] or [None]
    at = f" (at {frame[0].filename}:{frame[0].lineno})" if frame[0] else ""
    return f"{where} raised {type(exc).__name__}: {exc}{at}"


def default_dtypes(search_probe, conv) -> tuple:
    """float32, then the half precisions the kernel accepts (probed on a small case)."""
    dts = ["float32"]
    for dt in HALF:
        if conv.framework == "jax" and dt == "bfloat16":
            continue
        out = search_probe(Case(dtype=dt, s=16))
        if out.verdict is not None and out.verdict.error is None:
            dts.append(dt)
    return tuple(dts)
