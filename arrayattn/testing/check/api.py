"""``check_kernel``: search for a case where a kernel disagrees with arrayattn's reference
(the Python face of ``arrayattn check``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .conventions import get_convention
from .search import Outcome, Search, default_dtypes, require_hypothesis

__all__ = ["check_kernel", "assert_kernel_conforms", "KernelCheck", "rerun_line"]


@dataclass
class KernelCheck:
    """The result of :func:`check_kernel`.

    Attributes
    ----------
    ok : bool
        Nothing found within the budget.
    cases : int
        Cases run (catalogue, random draws and shrinking).
    failure : Outcome or None
        The smallest failing case (``.case``) and the verdict that failed (``.verdict``:
        the comparisons, ``.items``, or the ``.error`` the kernel raised).
    flaky : bool
        The failing case passed when run once more (a stateful kernel: compile caches,
        random behaviour); :attr:`rerun` holds that second outcome.  Still a finding
        (``ok`` is False).
    rerun : Outcome or None
        The failing case run once more after the search.
    repro : str or None
        The repro file written (``repro=``), judged by :attr:`validate`.
    validate : str or None
        The ``arrayattn validate`` command line that judges the repro file.
    notes : list of str
        What went wrong besides the kernel (a repro file that could not be written).
    explanation : Explanation or None
        What the finding likely is (:mod:`arrayattn.testing.check.explain`): the named
        deviation its results match (``.likely``, ``.names``) and the dimensions the
        failure needs (``.dims``).
    """

    convention: str
    ok: bool
    cases: int
    seconds: float
    failure: Outcome | None = None
    time_to_finding: float | None = None
    repro: str | None = None
    validate: str | None = None
    unsupported: list = field(default_factory=list)
    covered: dict = field(default_factory=dict)
    worst_ratio: float = 0.0
    worst_case: object = None
    dtypes: tuple = ()
    flaky: bool = False
    rerun: Outcome | None = None
    notes: list = field(default_factory=list)
    explanation: object = None
    replayed: object = None

    def summary(self) -> str:
        """What was run and covered, and the finding (its case, outputs, heads, errors)."""
        cov = self.covered
        lines = [f"arrayattn check ({self.convention}): {self.cases} case(s) in "
                 f"{self.seconds:.1f} s; dtypes {', '.join(sorted(cov.get('dtypes', ())))}; "
                 f"n up to {cov.get('max_n', 0)}, s up to {cov.get('max_s', 0)}"
                 + ("; GQA" if cov.get("gqa") else "")]
        if cov.get("largest"):
            lines.append(f"head dims {', '.join(map(str, sorted(cov.get('dims', ()))))}; "
                         f"largest case: {cov['largest'][1]}")
        if cov.get("values") or cov.get("poison"):
            lines.append("values: normal, " + ", ".join(sorted(cov.get("values", ())))
                         + ("; poison: " + ", ".join(sorted(cov["poison"]))
                            if cov.get("poison") else ""))
        if cov.get("options"):
            lines.append("options covered: " + ", ".join(sorted(cov["options"])))
        if self.unsupported:
            lines.append("unsupported (NotImplementedError): " + ", ".join(self.unsupported))
        if self.ok:
            lines.append(f"OK: nothing found within the budget; worst error / tolerance "
                         f"{self.worst_ratio:.3g} (the full tolerance)"
                         + (f" ({self.worst_case.describe()})" if self.worst_case else ""))
            return "\n".join(lines)
        f = self.failure
        lines.append(f"{self.status} after {self.time_to_finding or 0.0:.1f} s; smallest "
                     f"failing case: {f.case.describe()}")
        if self.flaky:
            lines.append("  failed once:")
        lines += ["  " + line for line in f.verdict.lines()]
        if self.flaky:
            lines.append("  " + rerun_line(self.rerun))
        if self.explanation is not None:
            lines += self.explanation.lines()
        if self.repro:
            lines.append(f"repro: {self.repro}; judge it with: {self.validate}")
        lines += [f"note: {note}" for note in self.notes]
        if any(label.endswith(" rows)") for label, _ in f.verdict.items):
            cols = any(label.endswith(" key columns)") for label, _ in f.verdict.items)
            lines.append("judged on sampled query rows" + (" and key columns" if cols else "")
                         + " (the sampled judge); the repro holds their sub-problem" + (
                             f", the rows in {self.repro}.rows.txt" if self.repro else "")
                         + (f", the key columns' in {self.repro}.cols.npz (keys in "
                            f"{self.repro}.cols.txt)" if cols and self.repro else ""))
        return "\n".join(lines)

    @property
    def status(self) -> str:
        """``"OK"``, ``"FOUND"`` or ``"FLAKY"`` (a finding that passed on re-run)."""
        return "OK" if self.ok else "FLAKY" if self.flaky else "FOUND"

    def __repr__(self) -> str:
        return f"<KernelCheck {self.status if not self.ok else 'ok'}: {self.cases} cases>"


def rerun_line(rerun: Outcome | None) -> str:
    """What the re-run of a flaky finding gave."""
    if rerun is None or rerun.verdict is None:
        return "passed on re-run (it raised NotImplementedError)"
    return f"passed on re-run (worst error / tolerance {rerun.verdict.worst:.3g})"


def check_kernel(fn, convention, *, budget: float = 60, seed: int = 0, dtypes=None,
                 grads: bool = True, skip=(), repro=None, device: str = "cpu",
                 log=None, explain: bool = True, examples=(),
                 max_size: int = 2 ** 24) -> KernelCheck:
    """Search for a case where ``fn`` disagrees with arrayattn's float64 reference.

    Parameters
    ----------
    fn : callable
        The kernel, called as ``convention`` says.
    convention : str or adapter
        A name of :data:`arrayattn.testing.check.CONVENTIONS` (``"sdpa"``,
        ``"flex_attention"``, ``"jax_dot_product_attention"``, ``"flash_attn"``,
        ``"flash_attn_varlen"``, ``"flash_attn_kvcache"``, ``"fla_gla"``,
        ``"fla_simple_gla"``, ``"fla_delta_rule"``, ``"fla_gated_delta_rule"``) or a custom
        adapter object (:class:`arrayattn.testing.check.Custom`).
    budget : float
        Seconds of search (the shrinking of a finding may take up to half as long again).
    seed : int
        The random draws' seed: the same seed, the same cases.
    dtypes : sequence of str, optional
        Default: float32, then the half precisions the kernel accepts.
    grads : bool
        Also judge gradients (torch autograd or ``jax.vjp``) against :func:`arrayattn.vjp`.
    skip : sequence of str
        Options never drawn.
    repro : str, optional
        Where to write the repro ``.npz`` of a finding (``arrayattn validate FILE`` judges
        it alone; a kernel that raised: its inputs, options and the error).
    device : str
        Where the kernel's tensors are put (``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; torch
        conventions); the referee always runs on the host in float64.
    log : callable, optional
        Called with one line of text at each step worth telling (a catalogue or random
        case that fails and is being shrunk, an option found unsupported); the command
        line passes a printer to stderr.  ``None``: silent.
    explain : bool
        After shrinking, name the likely mistake and the dimensions the failure needs
        (:func:`arrayattn.testing.check.explain.explain`: a few more evaluations).
    examples : sequence of Case, optional
        Cases tried before the catalogue (e.g. a finding of an earlier run, which is then
        shrunk again from there); ``.replayed`` is the one that still failed.
    max_size : int
        The elements of the largest tensor of a case (the logits ``b h n s`` or an input;
        default 2**24: 128 MiB in float64): bounds the large cases' memory; 0 keeps to the
        small cases.

    Returns
    -------
    KernelCheck

    Examples
    --------
    >>> import torch
    >>> from arrayattn.testing import check_kernel
    >>> res = check_kernel(torch.nn.functional.scaled_dot_product_attention, "sdpa",
    ...                    budget=2, dtypes=["float32"], grads=False)
    >>> res.ok
    True
    """
    require_hypothesis()
    conv = get_convention(convention, device)
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__}")
    search = Search(fn, conv, budget=float(budget), seed=int(seed), grads=bool(grads),
                    skip=tuple(skip), log=log, examples=tuple(examples),
                    max_size=_max_size(max_size))
    dtypes = default_dtypes(search.evaluate, conv) if dtypes is None else tuple(dtypes)
    search.dtypes = dtypes
    t0 = time.monotonic()
    found = search.run()
    res = KernelCheck(conv.name, found is None, search.cases_run, time.monotonic() - t0,
                      unsupported=sorted(map(str, search.unsupported)),
                      covered=search.covered, worst_ratio=_full_ratio(search),
                      worst_case=search.worst[1], dtypes=dtypes,
                      time_to_finding=search.first_found, replayed=search.replayed)
    if found is not None:
        _classify(res, search, found)
        if explain and not res.flaky and res.failure.verdict is not None \
                and res.failure.verdict.error is None:
            res.explanation = _explain(fn, conv, found, dtypes, log)
        if repro:
            _write(res, repro, conv, fn)
    return res


def _full_ratio(search: Search) -> float:
    """The worst passing case's error / tolerance with every tolerance term measured (the
    search stops measuring once a case is clearly within: its ratios are upper bounds)."""
    from .. import rounding

    ratio, case = search.worst
    if case is None:
        return ratio
    saved, rounding.MEASURE_ALWAYS = rounding.MEASURE_ALWAYS, True
    try:
        out = search.evaluate(case)
    except Exception:  # the search is over: a kernel that breaks now costs no result
        return ratio
    finally:
        rounding.MEASURE_ALWAYS = saved
    if out.verdict is None or not out.verdict.ok:
        return ratio
    return out.verdict.worst


def _classify(res: KernelCheck, search: Search, found) -> None:
    """The finding with the verdict that failed; run once more: FLAKY if it passes."""
    failed = search.failure_of(found)
    res.rerun, again = search.fails_again(found)
    if failed is None:                       # not kept: the re-run is all there is
        failed = res.rerun
    res.failure = failed
    res.flaky = not again
    if res.flaky and search.log is not None:
        search.log(f"the failing case {found.describe()} passed on re-run: FLAKY")


def _write(res: KernelCheck, path: str, conv, fn) -> None:
    """The repro file of the failing outcome; a note instead when it cannot be written."""
    from .repro import write_repro

    try:
        res.validate = write_repro(path, conv, fn, res.failure.case, outcome=res.failure,
                                   flaky=res.flaky)
        res.repro = path
    except Exception as exc:  # never lose the finding over its repro file
        res.notes.append(f"the repro file {path} could not be written: "
                         f"{type(exc).__name__}: {exc}")


def _explain(fn, conv, case, dtypes, log):
    """The finding's explanation; None (and a log line) if explaining it failed: an
    explanation never costs the finding."""
    from .explain import explain
    try:
        return explain(fn, conv, case, dtypes)
    except Exception as exc:  # pragma: no cover - defensive
        if log is not None:
            log(f"explaining the finding failed: {type(exc).__name__}: {exc}")
        return None


def _max_size(value) -> int:
    """``max_size`` checked: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_size must be an int >= 0 (elements); got {value!r}")
    return value


def assert_kernel_conforms(fn, convention, **kwargs) -> KernelCheck:
    """:func:`check_kernel`, raising ``AssertionError`` with its summary on a finding (for
    pytest); the :class:`KernelCheck` otherwise."""
    res = check_kernel(fn, convention, **kwargs)
    if not res.ok:
        raise AssertionError(res.summary())
    return res

