"""``check_kernel``: search for a case where a kernel disagrees with arrayattn's reference
(the Python face of ``arrayattn check``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from .conventions import get_convention
from .search import Outcome, Search, default_dtypes, require_hypothesis

__all__ = ["check_kernel", "assert_kernel_conforms", "KernelCheck"]


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
        The smallest failing case (``.case``) and its verdict (``.verdict``: the
        comparisons, ``.items``, or the ``.error`` the kernel raised).
    repro : str or None
        The repro file written (``repro=``), judged by :attr:`validate`.
    validate : str or None
        The ``arrayattn validate`` command line that judges the repro file.
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
                         f"{self.worst_ratio:.3g}"
                         + (f" ({self.worst_case.describe()})" if self.worst_case else ""))
            return "\n".join(lines)
        f = self.failure
        lines.append(f"FOUND after {self.time_to_finding:.1f} s; smallest failing case: "
                     f"{f.case.describe()}")
        lines += ["  " + line for line in f.verdict.lines()]
        if self.repro:
            lines.append(f"repro: {self.repro}; judge it with: {self.validate}")
        if any(label.endswith(" rows)") for label, _ in f.verdict.items):
            lines.append("judged on sampled query rows (the sampled judge); the repro holds "
                         "their sub-problem" + (f", the rows in {self.repro}.rows.txt"
                                                if self.repro else ""))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<KernelCheck {'ok' if self.ok else 'FOUND'}: {self.cases} cases>"


def check_kernel(fn, convention, *, budget: float = 60, seed: int = 0, dtypes=None,
                 grads: bool = True, skip=(), repro=None, device: str = "cpu",
                 log=None, max_size: int = 2 ** 24) -> KernelCheck:
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
        Where to write the repro ``.npz`` of a finding.
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
                    skip=tuple(skip), log=log, max_size=_max_size(max_size))
    dtypes = default_dtypes(search.evaluate, conv) if dtypes is None else tuple(dtypes)
    search.dtypes = dtypes
    t0 = time.monotonic()
    found = search.run()
    res = KernelCheck(conv.name, found is None, search.cases_run, time.monotonic() - t0,
                      unsupported=sorted(map(str, search.unsupported)),
                      covered=search.covered, worst_ratio=search.worst[0],
                      worst_case=search.worst[1], dtypes=dtypes,
                      time_to_finding=search.first_found)
    if found is not None:
        res.failure = search.evaluate(found)
        if repro:
            from .repro import write_repro
            res.repro, res.validate = repro, write_repro(repro, conv, fn, found)
    return res


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

