"""The result of a comparison, per head: errors, tolerances, the verdict and the table."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .measures import HeadErrors, working_dtype

__all__ = ["Comparison"]


@dataclass(eq=False, repr=False)
class Comparison:
    """Per-head result of :func:`compare_to_reference` (host NumPy arrays).

    Attributes
    ----------
    variant : str
        Registry name of the reference.
    dtype : str
        dtype of the output under test (sets the tolerance).
    heads : list of tuple
        Index of each head in the leading dimensions, e.g. ``(0, 3)``.
    max_abs, tolerance : ndarray, shape ``(heads,)``
        Largest absolute error and the allowed absolute error.
    worst : list of tuple
        ``(row, column)`` of the largest error in each head: ``(query, output feature)`` for
        an output (:meth:`position` says it in words).
    own_error : ndarray, shape ``(heads,)``
        Largest error of arrayattn's own evaluation in the output's precision.
    ref_scale : ndarray, shape ``(heads,)``
        The head's largest reference entry (``rel = max_abs / ref_scale``).
    notes : list of str
        Known deviations a profile could not reproduce, and other remarks.
    profile : str or None
        The port profile the comparison used.
    rule : str
        The tolerance rule: ``"float64"`` (a multiple of what a plain evaluation in the
        working precision errs by) or ``"same-dtype"`` (FlashAttention's: a multiple of
        what the computation done plainly in the half dtype errs by).
    lenient : ndarray or None, shape ``(heads,)``
        Under the ``same-dtype`` rule, where a head is over ``tolerance``: the tolerance
        the ``float64`` rule gives it.  A head between the two is **less accurate**
        (correct to the float64 rule, more than the factor times a plain half-precision
        evaluation's error): its own class, a pass unless ``strict``.
    strict : bool
        The ``same-dtype`` rule asked for explicitly: a less accurate head fails.
    """

    variant: str
    dtype: str
    heads: list
    max_abs: np.ndarray
    tolerance: np.ndarray
    worst: list
    own_error: np.ndarray
    ref_scale: np.ndarray
    notes: list = field(default_factory=list)
    profile: str | None = None
    rule: str = "float64"
    lenient: np.ndarray | None = None
    strict: bool = False

    @classmethod
    def of(cls, variant: str, dtype: str, errors: HeadErrors, tolerance, own_error,
           notes=(), profile=None, rule: str = "float64", lenient=None,
           strict: bool = False) -> Comparison:
        """The comparison from measured :class:`~arrayattn.testing.measures.HeadErrors`."""
        return cls(variant, dtype, errors.heads, errors.max_abs, tolerance, errors.worst,
                   own_error, np.asarray(errors.scale, dtype=np.float64), list(notes),
                   profile, rule, lenient, strict)

    def _relative(self, err: np.ndarray) -> np.ndarray:
        return err / np.where(self.ref_scale > 0, self.ref_scale, 1.0)

    @property
    def rel(self) -> np.ndarray:
        """Largest absolute error relative to the head's largest reference entry."""
        return self._relative(self.max_abs)

    @property
    def own_rel(self) -> np.ndarray:
        """arrayattn's own error in the working precision relative to the head's largest
        reference entry: what a faithful implementation in that precision achieves on
        these inputs (the rounding baseline beside :attr:`rel`)."""
        return self._relative(self.own_error)

    def precision(self) -> str:
        """The output's error against float64 beside the rounding baseline (worst heads).

        ``this output`` is the largest relative error of the output under test against
        the float64 reference; ``faithful float32`` (or float64) is arrayattn's own
        evaluation in the working precision on the same inputs, i.e. what a correct
        implementation in that precision achieves.  Their ratio says how many times
        rounding the output's error is -- whatever the tolerance.
        """
        r, b = float(np.max(self.rel, initial=0.0)), float(np.max(self.own_rel, initial=0.0))
        ratio = f"{r / b:.3g}x the baseline" if b > 0 else "baseline 0"
        plain = ("the computation done plainly in the inputs' half dtype"
                 if self.rule == "same-dtype"
                 else f"a plain {working_dtype(self.dtype)} evaluation")
        return (f"error vs float64 (relative, worst head): this output {r:.3g}, {plain} "
                f"{b:.3g} ({ratio}; rule {self.rule}, worst head at "
                f"{self.baseline_multiple():.3g}x its baseline)")

    def baseline_multiple(self) -> float:
        """The largest per-head ratio of the error to the baseline error: the factor the
        ``same-dtype`` rule bounds (FlashAttention's 2)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(self.own_error > 0, self.max_abs / np.where(
                self.own_error > 0, self.own_error, 1.0), np.where(self.max_abs > 0, np.inf, 0))
        return float(np.max(np.nan_to_num(ratio, nan=np.inf), initial=0.0))

    def sharp(self) -> np.ndarray:
        """Per head: within :attr:`tolerance` (the rule's own, FlashAttention's 2x under
        ``same-dtype``).  An infinite error (a NaN or inf in the output where the reference
        is finite, or the reverse) never is, whatever the tolerance."""
        return np.isfinite(self.max_abs) & (self.max_abs <= self.tolerance)

    @property
    def less_accurate(self) -> list[int]:
        """Heads over the ``same-dtype`` tolerance but within the ``float64`` rule's:
        correct, less accurate than the factor times a plain half evaluation."""
        if self.lenient is None:
            return []
        return [int(i) for i in np.flatnonzero(~self.sharp() & np.isfinite(self.max_abs)
                                               & (self.max_abs <= self.lenient))]

    def within(self) -> np.ndarray:
        """Per head: passes -- within tolerance, or (not :attr:`strict`) less accurate
        only."""
        ok = self.sharp()
        if self.less_accurate and not self.strict:
            ok = ok | np.isin(np.arange(len(self.heads)), self.less_accurate)
        return ok

    @property
    def failing(self) -> list[int]:
        """Indices of the heads over tolerance, worst (largest error/tolerance) first."""
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = np.where(self.tolerance > 0, self.max_abs / np.where(
                self.tolerance > 0, self.tolerance, 1.0), np.where(self.max_abs > 0, np.inf, 0.0))
        bad = [int(i) for i in np.flatnonzero(~self.within())]
        return sorted(bad, key=lambda i: -np.nan_to_num(ratio[i], nan=np.inf))

    @property
    def ok(self) -> bool:
        """Whether every head is within its tolerance."""
        return not self.failing

    def position(self, i: int) -> str:
        """Where head ``i``'s largest error is, in words: ``query 0, output feature 6`` for
        an output, ``query 3`` for a log-sum-exp, ``key 2, feature 5`` for ``dk`` / ``dv``,
        ``query 1, feature 0`` for ``dq``, ``key feature 1, value feature 4`` for a final
        state (read from the comparison's name, e.g. ``"softmax lse"``)."""
        row, col = self.worst[i]
        kind = self.variant.rsplit(" ", 1)[-1] if " " in self.variant else "out"
        if kind == "lse":
            return f"query {row}"
        if kind in ("dk", "dv"):
            return f"key {row}, feature {col}"
        if kind == "dq":
            return f"query {row}, feature {col}"
        if kind == "final_state":
            return f"key feature {row}, value feature {col}"
        if kind.startswith("d"):                  # a gate's or another argument's gradient
            return f"token {row}, entry {col}"
        return f"query {row}, output feature {col}"

    def head_line(self, i: int) -> str:
        """One line on head ``i``: its largest error, where (:meth:`position`), and its
        tolerance."""
        where = self.position(i)
        if not np.isfinite(self.max_abs[i]):
            return (f"head {self.heads[i]}: non-finite error at {where} "
                    "(a NaN or inf in the output or the reference, not in both alike; never "
                    "within tolerance)")
        return (f"head {self.heads[i]}: max abs error {self.max_abs[i]:.3g} at {where} "
                f"(relative {self.rel[i]:.3g}, tolerance {self.tolerance[i]:.3g})")

    def _less_accurate_line(self) -> str:
        i = max(self.less_accurate, key=lambda j: self.max_abs[j] / max(self.own_error[j],
                                                                         1e-300))
        m = self.max_abs[i] / self.own_error[i] if self.own_error[i] > 0 else float("inf")
        half = self.dtype if self.dtype in ("float16", "bfloat16") else "half"
        return (f"LESS ACCURATE: {self.variant}, {len(self.less_accurate)} of "
                f"{len(self.heads)} head(s) correct to the float64 rule but {m:.3g}x less "
                f"accurate than a plain {half} evaluation (FlashAttention's rule allows "
                f"{self.tolerance[i] / max(self.own_error[i], 1e-300):.3g}x); worst head "
                f"{self.heads[i]} max abs error {self.max_abs[i]:.3g} (float64-rule "
                f"tolerance {self.lenient[i]:.3g})")

    def verdict(self) -> str:
        """One line: MATCH, LESS ACCURATE (its own class under the ``same-dtype`` rule: a
        failure when :attr:`strict`, else a pass that says so) or MISMATCH, with the worst
        head."""
        h = len(self.heads)
        la = self.less_accurate
        hard = [i for i in np.flatnonzero(~self.sharp()) if int(i) not in la]
        if la and not hard:
            line = self._less_accurate_line()
            return (line if self.strict else f"MATCH ({line})") + self._suffix()
        if self.ok:
            i = int(np.argmax(self.max_abs / np.maximum(self.tolerance, 1e-300)))
            return (f"MATCH: {self.variant}, {h} head(s), {self.dtype} output; worst "
                    f"head (by error / tolerance) {self.heads[i]} max abs error "
                    f"{self.max_abs[i]:.3g} <= tolerance {self.tolerance[i]:.3g}"
                    f"{self._suffix()}")
        bad = self.failing
        return (f"MISMATCH: {self.variant}, {len(bad)} of {h} head(s) over tolerance "
                f"({self.dtype} output); worst (by error / tolerance) "
                f"{self.head_line(bad[0])}{self._suffix()}")

    def _suffix(self) -> str:
        prof = f"; profile {self.profile}" if self.profile else ""
        return f"; {self.precision()}{prof}"

    def report(self, *, limit: int = 5) -> str:
        """The verdict, the worst ``limit`` failing heads, the precision and the notes: the
        message of :func:`assert_matches_reference`."""
        lines = [self.verdict()] + ["  " + self.head_line(i) for i in self.failing[:limit]]
        if len(self.failing) > limit:
            lines.append(f"  ... and {len(self.failing) - limit} more head(s)")
        lines += ["  " + self.precision()] + ["  note: " + note for note in self.notes]
        return "\n".join(lines)

    def table(self) -> str:
        """Per-head table: max abs error, relative error, arrayattn's own rounding error
        in the working precision (``own error``), tolerance, worst position, verdict."""
        head = ["head", "max abs error", "rel. error", "own error", "tolerance",
                "worst (query, col)", ""]
        within = self.within()
        rows = [[str(self.heads[i]), f"{self.max_abs[i]:.3e}", f"{self.rel[i]:.3e}",
                 f"{self.own_error[i]:.3e}", f"{self.tolerance[i]:.3e}",
                 str(tuple(self.worst[i])), "ok" if within[i] else "FAIL"]
                for i in range(len(self.heads))]
        widths = [max(len(x) for x in col) for col in zip(head, *rows)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths)).rstrip(),
                 "  ".join("-" * w for w in widths)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Comparison {self.verdict()}>"
